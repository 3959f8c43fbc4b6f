"""Bad runs are refused in one line before Ray starts (``preflight.py``), a placement Ray cannot satisfy stops
within its timeout, and an actor's failure ends the run with one line naming the actor and its own error."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from openrlhf_oppo import preflight
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.plan import resolve
from openrlhf_oppo.testing import preflight_sweep

CLI = [sys.executable, "-m", "openrlhf_oppo.cli.train_ppo_ray"]


@pytest.fixture(scope="module")
def swept():
    was_up = ray.is_initialized()
    with tempfile.TemporaryDirectory() as root:
        results = preflight_sweep.sweep(root)
    assert ray.is_initialized() == was_up  # no check starts Ray
    return results


def test_every_bad_input_is_refused_in_one_line(swept):
    categories = {case.category for case, _ in swept}
    assert len(swept) >= 30 and len(categories) == 8, categories
    for case, line in swept:
        assert line is not None, f"not refused: {case.shown()}"
        assert "\n" not in line and ("--" in line or "/" in line), line
        print(f"{case.category:18} {line}")


def test_the_page_lists_the_sweep_as_it_is(swept):
    """docs/preflight.md is what ``python -m openrlhf_oppo.testing.preflight_sweep`` writes today."""
    assert Path(preflight_sweep.PAGE).read_text() == preflight_sweep.page(swept)


@pytest.fixture
def good_root(tmp_path):
    """A folder with the sweep's good prompt file (the good run's other paths are the real checkpoints)."""
    prompts = tmp_path / "data" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"input": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(64)))
    return str(tmp_path)


def _good_run(checkpoints, root, *extra):
    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    argv = preflight_sweep.good_argv(root)
    paths = {f"{root}/models/actor": checkpoints["actor"], f"{root}/models/reward": checkpoints["reward"]}
    return parse_args([paths.get(flag, flag) for flag in argv] + list(extra))


def test_good_args_pass_in_well_under_a_second(checkpoints, good_root):
    """The good run of the sweep on real checkpoints, with an evaluation set, and hub names (not checked offline)."""
    prompts = f"{good_root}/data/prompts.jsonl"
    args = _good_run(checkpoints, good_root, "--eval.dataset", prompts, "--reward.remote_url", "http://rm")
    started = time.perf_counter()
    preflight.check(args)
    preflight.check_launch(args, {"GPU": 8, "CPU": 16})
    took = time.perf_counter() - started
    print(f"preflight of the good run: {took * 1000:.1f} ms")
    assert took < 5
    args.actor.model_name_or_path, args.data.prompt_dataset = "Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k"
    args.reward.model_name_or_path = args.critic.model_name_or_path = "OpenRLHF/Llama-3-8b-rm-700k"
    preflight.check(args)


def test_every_local_format_upstream_loads_passes_and_loads(tmp_path):
    """What the checks let through, upstream's blending_datasets loads with the input key in its rows: JSON lines,
    a JSON array (on one line or many), CSV, parquet, a folder of parquet files, and datasets' save_to_disk of one
    dataset and of a dict of splits (whose split the checks take from its dataset_dict.json)."""
    import datasets
    from openrlhf.datasets.utils import blending_datasets

    rows = [{"input": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
    table = datasets.Dataset.from_list(rows)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "indented.json").write_text(json.dumps(rows, indent=2))
    table.to_csv(str(tmp_path / "p.csv"), index=False)
    table.to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "folder" / "data").mkdir(parents=True)
    table.to_parquet(str(tmp_path / "folder" / "data" / "train-00000.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=table, test=table).save_to_disk(str(tmp_path / "splits"))
    strategy = SimpleNamespace(print=lambda *_: None, is_rank_0=lambda: False, args=SimpleNamespace(use_ms=False))
    keys = [("--data.input_key", "input"), ("--data.label_key", "answer")]
    for name in ("p.jsonl", "p.json", "indented.json", "p.csv", "p.parquet", "folder", "saved", "splits"):
        path = str(tmp_path / name)
        preflight._check_dataset("--data.prompt_dataset", path, keys, ("--data.prompt_split", "train"))
        loaded = blending_datasets(path, None, strategy, dataset_split="train")
        assert len(loaded) == 4 and {"input", "answer"} <= set(loaded[0]), name
    preflight._check_dataset("--eval.dataset", str(tmp_path / "splits"), keys, ("--eval.split", "test"))
    with pytest.raises(OPPOConfigError, match=r"has the splits train, test, not 'validation' \(--eval.split\)"):
        preflight._check_dataset("--eval.dataset", str(tmp_path / "splits"), keys, ("--eval.split", "validation"))


def test_a_data_file_is_read_through_or_its_first_rows(tmp_path, monkeypatch):
    """Upstream's loader parses every row: a file of reasonable size is read through, a broken row far down
    refused by its number; of a larger file the first ROWS_READ rows are checked."""
    rows = "".join(json.dumps({"input": f"{i}+1="}) + "\n" for i in range(5))
    path = tmp_path / "p.jsonl"
    path.write_text(rows + '{"input": "5+1="\n')
    keys = [("--data.input_key", "input")]
    with pytest.raises(OPPOConfigError, match=r"its row 6 \(line 6\) is not JSON"):
        preflight._check_dataset("--data.prompt_dataset", str(path), keys, ("--data.prompt_split", "train"))
    monkeypatch.setattr(preflight, "READ_THROUGH_BYTES", 10)
    monkeypatch.setattr(preflight, "ROWS_READ", 5)
    read = preflight._check_dataset("--data.prompt_dataset", str(path), keys, ("--data.prompt_split", "train"))
    assert len(read.rows) == 5 and not read.complete


@pytest.mark.parametrize(
    "extra, groups",
    [
        ([], [["vLLM engines"], ["actor"], ["ref"], ["critic"], ["reward"]]),
        (["--train.colocate_actor_ref", "--train.colocate_critic_reward"],
         [["actor", "ref"], ["vLLM engines"], ["critic", "reward"]]),
        (["--train.colocate_all"], [["vLLM engines", "actor", "critic", "reward", "ref"]]),
        (["--oppo.colocate_models"], [["actor", "critic", "reward", "ref"], ["vLLM engines"]]),
        (["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2", "--reward.remote_url",
          "http://rm", "--algo.kl.init_coef", "0"], [["vLLM engines"], ["actor"]]),
    ],
    ids=["apart", "actor-ref-critic-reward", "colocate-all", "colocate-models", "actor-and-engines-only"],
)  # fmt: skip
def test_the_placement_lists_the_groups_upstream_places(extra, groups, checkpoints, good_root):
    """As upstream's ``train`` (0.11.2) asks Ray for them, in that order (the engines before the models unless the
    actor's group is colocated): which models share GPUs (one GPU a model here)."""
    placement = preflight.placement(resolve(_good_run(checkpoints, good_root, *extra)).topology)
    assert [names for names, _ in placement] == groups
    assert all(count == 1 for _, count in placement)


@pytest.mark.process
def test_a_placement_ray_cannot_satisfy_stops_within_its_timeout(ray_session):
    """A real Ray without GPUs: the group of one GPU waits, and is given up after the timeout in one line."""
    from openrlhf_oppo import launch

    started = time.time()
    with pytest.raises(OPPOConfigError, match=r"Ray could not place a group of 1 GPU within 3 s: 0 of the cluster"):
        launch.placed([{"GPU": 1, "CPU": 1}], 3.0)
    print(f"given up after {time.time() - started:.1f} s")
    assert time.time() - started < 30


def _cli(argv, env=None, timeout=300):
    done = subprocess.run(
        CLI + argv, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {}))
    )
    return done.returncode, done.stdout, done.stderr.strip().splitlines()


@pytest.mark.process
def test_the_cli_refuses_a_bad_dataset_and_missing_gpus_in_one_line(checkpoints, tmp_path):
    """The driver itself: a prompt file without the input key, then a good run on a machine without the GPUs the
    placement asks for; each ends with its line and no traceback, before Ray starts."""
    import torch

    if torch.cuda.device_count() >= 5:
        pytest.skip("this machine has the five GPUs")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "1+1="}) + "\n")
    argv = [
        "--actor.model_name_or_path", checkpoints["actor"], "--reward.model_name_or_path", checkpoints["reward"],
        "--vllm.num_engines", "1", "--ckpt.output_dir", str(tmp_path / "ckpt"), "--data.prompt_dataset", str(prompts),
    ] + [flag for role in ("actor", "critic", "reward", "ref") for flag in (f"--{role}.num_gpus_per_node", "1")]  # fmt: skip
    for fix, expected in (
        (None, f"--data.prompt_dataset {prompts} has no 'input' in its first row (--data.input_key"),
        ({"input": "1+1="}, "The placement needs 5 GPUs (vLLM engines: 1; actor: 1; ref: 1; critic: 1; reward: 1) "
                            f"and this machine has {torch.cuda.device_count()}: lower the"),
    ):  # fmt: skip
        if fix:
            prompts.write_text(json.dumps(fix) + "\n")
        code, stdout, stderr = _cli(argv, env={"RAY_ADDRESS": ""})
        assert code == 1 and stderr[-1].startswith(f"openrlhf-oppo: error: {expected}"), stderr[-20:]
        assert "Traceback" not in "\n".join(stderr) and "Started a local Ray instance" not in "\n".join(stderr)


HOLDER = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(num_cpus=4, num_gpus=2, include_dashboard=False)  # two GPUs declared: Ray only counts them
held = placement_group([{"GPU": 1}])
ray.get(held.ready())
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the tests are done
"""


@pytest.fixture(scope="module")
def cluster():
    """The address of a Ray cluster of two GPUs (declared, on this CPU machine), one held by another job."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = holder.stdout.readline().strip()
        assert address, "the holder's cluster did not start"
        yield address
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _cluster_run(cluster, checkpoints, tmp_path, *flags):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input": "1+1=", "answer": "2"}) + "\n")
    argv = [
        "--actor.model_name_or_path", checkpoints["actor"], "--data.prompt_dataset", str(prompts),
        "--ckpt.output_dir", str(tmp_path / "ckpt"), "--ds.attn_implementation", "sdpa",
    ]  # fmt: skip
    env = {"RAY_ADDRESS": cluster, "OPENRLHF_OPPO_PLACEMENT_TIMEOUT_S": "5"}
    started = time.time()
    code, _, stderr = _cli(argv + list(flags), env=env)
    print(f"{time.time() - started:.0f} s: {stderr[-1]}")
    return code, stderr, time.time() - started


@pytest.mark.process
@pytest.mark.parametrize(
    "gpus, expected",
    [
        (4, "The placement needs 4 GPUs (vLLM engines + actor + critic + reward + ref: 4) and the Ray cluster has 2"),
        (2, "Ray could not place a group of 2 GPUs within 5 s: 1 of the cluster's 2 GPUs are free."),
    ],
)
def test_the_cli_stops_on_a_cluster_that_lacks_the_gpus(gpus, expected, cluster, checkpoints, tmp_path):
    """``RAY_ADDRESS``: a run asking for four GPUs of the two is refused at its first placement group; one asking for
    two, of which one is free, gives up waiting for them after the timeout."""
    counts = [
        flag for role in ("actor", "critic", "reward", "ref") for flag in (f"--{role}.num_gpus_per_node", str(gpus))
    ]
    code, stderr, took = _cluster_run(
        cluster, checkpoints, tmp_path, "--reward.model_name_or_path", checkpoints["reward"], "--train.colocate_all",
        "--vllm.num_engines", str(gpus), "--rollout.batch_size", "8", *counts,
    )  # fmt: skip
    assert code == 1 and stderr[-1].startswith(f"openrlhf-oppo: error: {expected}"), stderr[-30:]
    assert "Traceback" not in "\n".join(stderr)
    assert took < 120  # the start of upstream's driver on a busy CPU, and at most 5 s of waiting


@pytest.mark.process
def test_the_cli_names_the_actor_that_failed_before_its_traceback(cluster, checkpoints, tmp_path):
    """A run placed on the cluster's free GPU, which this machine does not have: the policy's rank 0 fails in
    upstream's ``init_model_from_pretrained`` (DeepSpeed sets its CUDA device). The driver prints the actor and its
    error, then the traceback, then the same line last."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the policy would start on this machine's GPU")
    code, stderr, _ = _cluster_run(
        cluster, checkpoints, tmp_path, "--reward.remote_url", str(Path(__file__).parents[1] / "openrlhf_oppo" /
        "bench" / "addition.py"), "--data.label_key", "answer", "--algo.advantage.estimator", "reinforce",
        "--algo.kl.init_coef", "0", "--vllm.num_engines", "0", "--actor.num_gpus_per_node", "1",
        "--rollout.batch_size", "1",
    )  # fmt: skip
    line = stderr[-1]
    assert code == 1 and line.startswith(
        "openrlhf-oppo: error: actor rank 0 (PolicyModelActor) failed in init_model_from_pretrained: "
    ), stderr[-30:]
    assert "\n".join(stderr).count(line) == 2 and stderr.index(line) < stderr.index(
        "Traceback (most recent call last):"
    )


# -- the root cause of an actor's failure --------------------------------------------------------------------------


@ray.remote
class _Critic:
    """Upstream's model-actor contract as ``RayActorGroup`` uses it (world size, rank, the master's address): rank 1
    raises in ``init_model_from_pretrained``, rank 0 dies in ``fit``. Without upstream's base class, whose imports
    would take each worker process half a minute on a small CPU machine."""

    def __init__(self, world_size, rank, master_addr, master_port):
        self.rank = rank

    def get_master_addr_port(self):
        return "127.0.0.1", 29500

    def init_model_from_pretrained(self):
        if self.rank == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(the allocator's stats)")
        return self.rank

    def fit(self):
        if self.rank == 0:
            os._exit(1)
        return self.rank


@ray.remote
class _CriticFailingToStart:
    def __init__(self, world_size, rank, master_addr, master_port):
        if rank == 1:
            raise FileNotFoundError("no config.json in /models/critic")

    def get_master_addr_port(self):
        return "127.0.0.1", 29500

    def init_model_from_pretrained(self):
        return True


@ray.remote
class _Trainer:
    def fit(self, actors, method):
        return ray.get([getattr(actor, method).remote() for actor in actors])


@pytest.mark.process
def test_a_failed_actor_is_named_by_role_and_rank_with_its_own_error(ray_session):
    """Groups built as the CLI builds them (``launch.NamedActorGroup``: upstream's group, its actors named), whose
    failure reaches the driver directly or through the trainer actor that waited on them: a call that raised, an
    actor that failed in ``__init__``, one whose process died."""
    from openrlhf_oppo.cli.train_ppo_ray import failure_line
    from openrlhf_oppo.launch import NamedActorGroup
    from openrlhf_oppo.streaming.rollout import BoundActorClass

    trainer = _Trainer.remote()
    # Bound as --oppo.enable binds the run's plan to the model classes: the group reads the class's name through it.
    critics = NamedActorGroup(2, 1, BoundActorClass(_Critic, {}), pg=None, num_gpus_per_actor=0)
    not_started = NamedActorGroup(2, 1, _CriticFailingToStart, pg=None, num_gpus_per_actor=0)
    waited = " while _Trainer.fit waited on it"
    cases = [
        (critics, "init_model_from_pretrained", "critic rank 1 (_Critic) failed in init_model_from_pretrained: "
                                                "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", ""),
        (not_started, "init_model_from_pretrained", "critic rank 1 (_CriticFailingToStart) failed to start{}: "
                                                    "FileNotFoundError: no config.json in /models/critic", waited),
        (critics, "fit", "critic rank 0 (_Critic) died{}: The actor is dead because its worker process has died.",
         waited),
    ]  # fmt: skip
    for group, method, expected, while_waited in cases:
        for through_trainer in (True, False):
            call = trainer.fit.remote(group._actor_handlers, method) if through_trainer else None
            with pytest.raises(ray.exceptions.RayError) as raised:
                ray.get(call or group.async_run_method(method), timeout=120)
            line = failure_line(raised.value)
            print(line)
            assert line is not None and "\n" not in line, raised.value
            assert line.startswith(expected.format(while_waited if through_trainer else "")), (line, expected)
    for actor in critics._actor_handlers + not_started._actor_handlers + [trainer]:
        ray.kill(actor)
