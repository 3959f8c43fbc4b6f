"""A run whose rollout or scoring actor dies ends within a bound, with one line that names the actor and the
call that found it, leaves no process of the run behind, and no checkpoint that a resume would trust but is
incomplete.

OPPOTrainer runs on CPU (a real vLLM engine, real scoring models, upstream's PPOTrainer.fit) and kills one of
its actors as a phase of the step begins. A scoring actor whose prefill runs out of memory does not end the run:
its streaming is turned off, and its forward scores its micro-batches after generation."""

import os
import re
import subprocess
import sys
import time

import psutil
import pytest
import ray
import torch

from openrlhf_oppo import tiny
from openrlhf_oppo.bench.report import read_steps
from openrlhf_oppo.cli.train_ppo_ray import failure_line
from openrlhf_oppo.protocol import FROZEN_ROLES
from openrlhf_oppo.testing import cpu_pipeline

pytestmark = pytest.mark.engine

# phase: (the OPPOTrainer method that begins it, the role whose actor dies there, what the line names: a regex)
PHASES = {
    "make_experience": ("train_step", "reward", r"(CPURewardModelActor|reward rank 0)\b.* died while"),
    # Ray kills asynchronously: the phase or, if the actor is still up then, the next call names it
    "training": ("ppo_train", "critic", r"(CPUCriticModelActor died while training|critic rank 0 died while)"),
    "weight_sync": ("broadcast_to_vllm", "policy", r"(CPUPolicyModelActor|policy rank 0) died while"),
    "checkpoint": ("save_logs_and_checkpoints", "policy", "CPUPolicyModelActor died while saving the logs"),
}
BOUND_S = 60
# The processes of one run: Ray names an actor's worker after its class; multiprocessing's resource tracker
# is what a dying actor's torch or vLLM can leave behind.
RUN_PROCESSES = tuple(
    f"ray::{name}"
    for name in (
        "Killing",
        "CPUPolicyModelActor",
        "CPUCriticModelActor",
        "CPURewardModelActor",
        "CPUReferenceModelActor",
    )
)


def _alive(pid: int) -> str:
    """The command line of a running process, or "" if it ended."""
    try:
        process = psutil.Process(pid)
        return "" if process.status() == psutil.STATUS_ZOMBIE else _cmdline(process) or "?"
    except psutil.Error:
        return ""


def _cmdline(process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _run_processes() -> set:
    """The workers of the run's actors (this process's Ray cluster starts them) and the resource trackers of
    this Python (a tracker outlives the actor that started it: it is no longer a descendant then)."""
    workers = {
        p.pid for p in psutil.Process().children(recursive=True) if any(n in _cmdline(p) for n in RUN_PROCESSES)
    }
    trackers = {
        p.pid
        for p in psutil.process_iter()
        if "resource_tracker" in _cmdline(p) and _cmdline(p).startswith(sys.executable)
    }
    return workers | trackers


def fault_run_args(workdir: str, actor: str, reward: str, *extra: str):
    """The run these tests stop (also ``head_stop_helper.py``'s): 8 prompts, 2 a step with 2 samples each,
    OPPO with Delta 1 and 4-token chunks."""
    prompts = os.path.join(workdir, "prompts.jsonl")
    tiny.write_prompts(prompts, [5, 7, 6, 9, 4, 8, 5, 6], seed=12)
    return cpu_pipeline.ppo_args(
        workdir, actor, reward,
        "--data.prompt_dataset", prompts,
        "--data.max_len", "64",
        "--rollout.batch_size", "2",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", "4",
        "--train.batch_size", "4",
        "--train.micro_batch_size", "2",
        "--oppo.enable", "--oppo.overcommit", "1", "--oppo.chunk_size", "4",
        *extra,
    )  # fmt: skip


def _still_running(pids, seconds: int) -> list:
    """The command lines of those of ``pids`` still running after up to ``seconds`` of waiting for them."""
    left = []
    for _ in range(seconds):
        left = [cmdline for cmdline in map(_alive, pids) if cmdline]
        if not left:
            break
        time.sleep(1)
    return left


def _killing_trainer(method: str, role: str, at_step: int, killed_at: str):
    """OPPOTrainer that kills ``role``'s actor when ``method`` begins in step ``at_step`` and writes the time to
    ``killed_at`` (built in a function so that Ray pickles the class by value for the trainer's process)."""
    from openrlhf_oppo.trainer import OPPOTrainer

    class Killing(OPPOTrainer):
        def _maybe_kill(self):
            if self.policy_version + 1 >= at_step:
                group = dict(
                    policy=self.actor_model_group, critic=self.critic_model_group, reward=self.reward_model_group
                )
                for handle in group[role]._actor_handlers:
                    ray.kill(handle)
                with open(killed_at, "w") as f:
                    f.write(str(time.time()))

        def __getattribute__(self, name):
            attribute = super().__getattribute__(name)
            if name != method:
                return attribute

            def killing_first(*args, **kwargs):
                self._maybe_kill()
                return attribute(*args, **kwargs)

            return killing_first

    return ray.remote(Killing)


@pytest.mark.parametrize("phase", PHASES)
def test_an_actor_dying_ends_the_run_with_one_line(phase, checkpoints, engine, tmp_path):
    method, role, named = PHASES[phase]
    killed_at = tmp_path / "killed_at"
    args = fault_run_args(str(tmp_path), checkpoints["actor"], checkpoints["reward"], "--ckpt.save_steps", "1")
    before = _run_processes()
    pipeline = cpu_pipeline.CPUPipeline(args, checkpoints["actor"], checkpoints["reward"], [engine])
    try:
        with pytest.raises(Exception) as raised:
            pipeline.run_ppo(_killing_trainer(method, role, at_step=2, killed_at=str(killed_at)))
    finally:
        pipeline.coordinator.resume(0, resume=False)  # the shared engine starts the next test at version 0
        pipeline.kill()
    ended = time.time()
    line = failure_line(raised.value)
    print(f"{phase}: openrlhf-oppo: error: {line}")
    assert line is not None and "\n" not in line and re.search(named, line), (line, raised.value)
    assert ended - float(killed_at.read_text()) < BOUND_S
    # Ray reaps a killed actor's worker within a few seconds.
    left = _still_running(_run_processes() - before, seconds=30)
    assert not left, left
    # The checkpoint a resume would load is whole: the policy died before it wrote, so 'latest' still names
    # the previous step's checkpoint, which loads.
    folder = os.path.join(args.ckpt.path, "_actor")
    if os.path.exists(os.path.join(folder, "latest")):
        tag = open(os.path.join(folder, "latest")).read()
        assert "overcommit_sampler" in torch.load(os.path.join(folder, f"{tag}.pt"), weights_only=False)


# The critic's prefill forward that runs out of memory: one of the run's second step (the run's four steps take about
# four forwards each, as the chunks batch).
OUT_OF_MEMORY_AT_FORWARD = 8


def test_a_scorer_out_of_memory_turns_its_streaming_off_and_the_run_goes_on(checkpoints, engine, tmp_path):
    """The critic's prefill runs out of GPU memory mid-run: the run trains every step, the critic streams no more and
    says so in its stats, and from that step on its micro-batch is scored by its forward after generation
    (``oppo/fallback_micro_batches``) while the other models keep streaming."""
    from openrlhf_oppo.trainer import OPPOTrainerRayActor

    tensorboard = ["--logger.tensorboard_dir", str(tmp_path / "tb"), "--logger.wandb.run_name", "run"]
    args = fault_run_args(str(tmp_path), checkpoints["actor"], checkpoints["reward"], *tensorboard)
    pipeline = cpu_pipeline.CPUPipeline(args, checkpoints["actor"], checkpoints["reward"], [engine])
    try:
        (critic,) = pipeline.coordinator.models["critic"]
        ray.get(critic.run_out_of_memory_at_prefill.remote(OUT_OF_MEMORY_AT_FORWARD))
        pipeline.run_ppo(OPPOTrainerRayActor)
        # The model ranks that stream (the plan has the engine score the policy's log-probs).
        stats = {role: ray.get(pipeline.coordinator.models[role][0].oppo_stats.remote()) for role in FROZEN_ROLES}
        stats["critic"] = ray.get(critic.oppo_stats.remote())
    finally:
        pipeline.coordinator.resume(0, resume=False)  # the shared engine starts the next test at version 0
        pipeline.kill()
    steps = read_steps(str(tmp_path / "tb" / "run"))
    assert len(steps) == 4 and sum(s["rollout/num_samples"] for s in steps) == 8 * 2  # 2 prompts a step
    assert {role: rank.streaming_off for role, rank in stats.items()} == dict(
        critic=True, reward=False, reference=False
    )
    off = next(i for i, step in enumerate(steps) if step["oppo/fallback_micro_batches"])
    # The flag is read as each step ends: the critic may run out in the step whose micro-batch falls back, or in
    # the one before, after that step collected its scores (the carried groups' chunks); once off, it stays off.
    flags = [step["oppo/streaming_off/critic"] for step in steps]
    went_off = flags.index(1.0)
    assert off - 1 <= went_off <= off and all(flags[went_off:]) and not any(flags[:went_off]), (flags, off)
    assert 0 < off < len(steps) - 1, "the critic ran out of memory in the first or the last step"
    for i, step in enumerate(steps):
        assert step["oppo/fallback_micro_batches"] == float(i >= off)  # each step's one micro-batch, the critic's
        assert step["oppo/busy_s/reward"] > 0 and step["oppo/busy_s/policy"] > 0
        assert step["oppo/streaming_off/reward"] == 0
        if i > off:
            assert step["oppo/busy_s/critic"] == 0  # no prefill call ran


def test_stopping_the_ray_head_mid_step_ends_the_run(tmp_path):
    """The head's GCS dies in step 2 of a run with its own Ray cluster: Ray ends the driver after
    ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default, 10 s here) with one line naming the GCS, and every
    process of the run ends (Ray's agents a little later)."""
    marker, log = tmp_path / "step", tmp_path / "helper.log"
    helper = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "head_stop_helper.py"), str(tmp_path), str(marker)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, RAY_gcs_rpc_server_reconnect_timeout_s="10"),  # every process of its cluster reads it
    )
    try:
        for _ in range(600):
            if marker.exists() and marker.read_text() and int(marker.read_text()) >= 2:
                break
            assert helper.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("the run did not reach step 2")
        family = psutil.Process(helper.pid).children(recursive=True)
        heads = [p for p in family if "gcs_server" in _cmdline(p)]
        assert heads
        killed = time.time()
        for process in heads:
            process.kill()
        helper.wait(timeout=180)
    finally:
        if helper.poll() is None:
            helper.kill()
    assert time.time() - killed < 120 and helper.returncode != 0
    assert "Failed to connect to GCS" in log.read_text()
    left = _still_running([p.pid for p in family], seconds=180)
    assert not left, left
