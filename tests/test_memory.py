"""No leak under load: OPPOTrainer on CPU (a real vLLM engine, real scoring models, upstream's PPOTrainer.fit)
for 200 steps with streaming, overcommit, dynamic filtering and evaluation on. The scores waiting in the
scoring actors, the discarded sequences not yet cleared (tombstones), the scorers' KV cache, Ray's object
store, the object references the trainer holds and every actor's resident memory stay flat: the last 50
steps go no higher than the first 50 (or, for the scores, than the carried samples that wait by design).
Every actor's CPU time is logged per step.
"""

import json
import os
import time
from pathlib import Path

import pytest
import ray
from openrlhf.trainer.ray.launcher import RayActorGroup

from openrlhf_oppo import tiny
from openrlhf_oppo.testing import cpu_pipeline

# --train.agent_func_path: the engine grades its samples itself (the grading_engine fixture).
GRADING_AGENT = str(Path(__file__).parent / "data" / "grading_engine.py")

pytestmark = pytest.mark.engine

STEPS = 200
WINDOW = 50
BATCH, DELTA, N_SAMPLES = 2, 2, 2


def _sampling_trainer(path):
    """OPPOTrainer that appends, after each step, its ``oppo/*`` metrics, Ray's object store use (plasma, the
    whole node) and the number of object references its own process holds, to ``path`` (built in a function
    so that Ray pickles the class by value for the trainer's process)."""
    from openrlhf_oppo.trainer import OPPOTrainer

    class Sampling(OPPOTrainer):
        evaluations = 0

        def evaluate(self, *args, **kwargs):
            self.evaluations += 1
            return super().evaluate(*args, **kwargs)

        def train_step(self, rollout_samples, global_step):
            from ray._private.internal_api import get_memory_info_reply, get_state_from_address

            status, global_step = super().train_step(rollout_samples, global_step)
            worker = ray._private.worker.global_worker
            store = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
            sample = {k: v for k, v in status.items() if k.startswith("oppo/")}
            sample.update(
                step=global_step,
                store_bytes=store.object_store_bytes_used,
                store_objects=store.num_local_objects,
                trainer_refs=len(worker.core_worker.get_all_reference_counts()),
                evaluations=self.evaluations,
                time=time.time(),
            )
            with open(path, "a") as f:
                f.write(json.dumps(sample) + "\n")
            return status, global_step

    return ray.remote(Sampling)


def test_no_leak_over_200_steps_with_filtering_and_evaluation(checkpoints, grading_engine, tmp_path):
    """The engine's agent (``grading_engine``) drops the groups of even lengths (dynamic filtering), edits the
    responses of more than 8 tokens (their streams are replaced), and evaluation runs every 10 steps."""
    prompts, evals = str(tmp_path / "prompts.jsonl"), str(tmp_path / "eval.jsonl")
    lengths = [3, 4, 5, 9, 7, 6, 11, 3]  # 6 groups pass the filter: 3 steps of 2 an episode
    tiny.write_prompts(prompts, lengths, seed=8)
    tiny.write_prompts(evals, [3, 5], seed=9)
    args = cpu_pipeline.ppo_args(
        str(tmp_path), checkpoints["actor"], checkpoints["reward"],
        "--data.prompt_dataset", prompts,
        "--data.max_len", "64",
        "--rollout.batch_size", str(BATCH),
        "--rollout.n_samples_per_prompt", str(N_SAMPLES),
        "--rollout.micro_batch_size", "4",
        "--train.batch_size", "4",
        "--train.micro_batch_size", "2",
        "--train.num_episodes", str(STEPS // 3 + 2),
        "--train.agent_func_path", GRADING_AGENT,  # the engine's agent gives the rewards
        "--algo.dynamic_filtering_enable",
        "--eval.dataset", evals, "--eval.steps", "10", "--eval.n_samples_per_prompt", "2",
        "--oppo.enable", "--oppo.overcommit", str(DELTA), "--oppo.chunk_size", "4",
    )  # fmt: skip
    pipeline = cpu_pipeline.CPUPipeline(args, checkpoints["actor"], checkpoints["reward"], [grading_engine], False)
    # The rewards come with the samples: no reward model.
    paths = dict(policy=checkpoints["actor"], reference=checkpoints["actor"], critic=checkpoints["reward"])
    groups = {
        name: RayActorGroup(1, 1, cpu_pipeline.ACTOR_CLASSES[name], pg=None, num_gpus_per_actor=0) for name in paths
    }
    pipeline.groups = dict(groups, reward=None)
    record = tmp_path / "memory.jsonl"
    try:
        ray.get(
            [
                ref
                for name, g in groups.items()
                for ref in g.async_init_model_from_pretrained(pipeline.strategy, paths[name])
            ]
        )
        pipeline.run_ppo(_sampling_trainer(str(record)))
    finally:
        ray.get(grading_engine.oppo_resume.remote(0, resume=False))
        for group in groups.values():
            for handle in group._actor_handlers:
                ray.kill(handle)
    steps = [json.loads(line) for line in open(record)]
    assert len(steps) >= STEPS
    assert steps[-1]["evaluations"] == len(steps) // 10
    assert sum(s["oppo/discarded_sequences"] for s in steps) > 0  # filtering and edits did drop sequences
    assert max(s["oppo/carried_groups"] for s in steps) > 0
    # Plasma fills with the experiences sent to training (ray.put) and is freed in bursts: a slack of 1 MiB
    # and 50 objects (a burst is about 150 kB and 36 objects here).
    slack = dict(store_bytes=1 << 20, store_objects=50, trainer_refs=4)
    # What may wait by design: the samples of the groups carried to the next step, and those of groups that
    # dynamic filtering dropped and the trainer has not discarded yet (a generation whose every group was
    # dropped trains nothing, so its drops wait for the next step), with their tombstones: at most the groups
    # of a step (B + Delta, n samples each). How many varies with timing, so the bound is that, not the first
    # steps' count.
    by_design = dict.fromkeys(("oppo/scores_waiting", "oppo/score_tombstones"), (BATCH + DELTA) * N_SAMPLES)
    # Every actor's resident memory (``oppo/memory/*_host_gb``): allocators keep what they once took, so the
    # slack is 16 MiB, about 100 kB a step over the last 150 steps (each actor grew by 1-3 MB in this test).
    host = [f"oppo/memory/{kind}_host_gb" for kind in ("trainer", "rollout", "policy", "critic", "reference")]
    slack.update(dict.fromkeys(host, 16 / 1024))
    assert all(s[key] > 0 for s in steps for key in host)
    # CPU seconds per step (``oppo/cpu/*``): the rollout actor (its engine core decodes on the CPU here) and
    # the trainer work every step, and no actor uses more than the machine's cores for the step's wall time
    # (a running total instead of the step's share would soon exceed it).
    kinds = ("trainer", "rollout", "policy", "critic", "reference")
    print(
        "CPU s a step, mean:",
        {kind: round(sum(s[f"oppo/cpu/{kind}_s"] for s in steps) / len(steps), 3) for kind in kinds},
    )
    for before, step in zip(steps, steps[1:]):
        assert step["oppo/cpu/rollout_s"] > 0 and step["oppo/cpu/trainer_s"] > 0
        for kind in kinds:
            assert step[f"oppo/cpu/{kind}_s"] <= (step["time"] - before["time"]) * os.cpu_count() + 1.0, kind
    for key in ("oppo/scores_waiting", "oppo/score_tombstones", "oppo/scorer_cached_gb", *slack):
        first, last = max(s[key] for s in steps[:WINDOW]), max(s[key] for s in steps[-WINDOW:])
        print(f"{key}: max {first} in the first {WINDOW} steps, {last} in the last {WINDOW}")
        assert last <= max(first, by_design.get(key, 0)) + slack.get(key, 0), key
