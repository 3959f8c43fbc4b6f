"""Exactly once across every checkpoint: a two-episode OPPOTrainer run on CPU (a real vLLM engine, upstream's
PPOTrainer.fit), resumed from each of its checkpoints in a new trainer process, trains every prompt once per
episode, including from the checkpoints taken after the prompt dataloader ran out.

Rewards come with the samples (``grading_engine``'s agent), so only the policy model runs beside the engine;
it is built once and serves every run (the CPU stand-in for training keeps no state between runs).
Everything a resume restores lives in the trainer actor, which each run starts afresh.
"""

import functools
import json
from collections import Counter
from pathlib import Path

import pytest
import ray
import torch
from openrlhf.trainer.ray.launcher import RayActorGroup

from openrlhf_oppo import tiny
from openrlhf_oppo.testing import cpu_pipeline

# --train.agent_func_path: the engine grades its samples itself (the grading_engine fixture).
GRADING_AGENT = str(Path(__file__).parent / "data" / "grading_engine.py")

pytestmark = pytest.mark.engine

N_SAMPLES = 2
# Carried at most one step, and so trained at most one weight version behind (the bound the trainer enforces).
OVERCOMMIT = ["--oppo.overcommit", "2", "--oppo.max_defer_steps", "1", "--oppo.max_lag", "1"]


def _recording_trainer(path):
    """OPPOTrainer that appends each step's trained prompts to ``path`` (built in a function so that Ray
    pickles the class by value for the trainer's process)."""
    from openrlhf_oppo.trainer import OPPOTrainer

    class Recording(OPPOTrainer):
        def train_step(self, rollout_samples, global_step):
            with open(path, "a") as f:
                f.write(json.dumps([s.prompts[0] for s in rollout_samples]) + "\n")
            status, global_step = super().train_step(rollout_samples, global_step)
            with open(path + ".lag", "a") as f:
                f.write(json.dumps(status.get("oppo/policy_lag_max")) + "\n")
            return status, global_step

    return ray.remote(Recording)


def _train(workdir, prompts, checkpoints, policy, engine, record, *extra):
    args = cpu_pipeline.ppo_args(
        str(workdir), checkpoints["actor"], checkpoints["reward"],
        "--data.prompt_dataset", prompts,
        "--data.max_len", "64",
        "--rollout.batch_size", "2",
        "--rollout.n_samples_per_prompt", str(N_SAMPLES),
        "--rollout.micro_batch_size", "4",
        "--train.batch_size", "4",
        "--train.micro_batch_size", "2",
        "--train.num_episodes", "2",
        "--algo.advantage.estimator", "reinforce",
        "--algo.kl.init_coef", "0",
        "--train.agent_func_path", GRADING_AGENT,  # the engine's agent gives the rewards
        "--oppo.enable", "--oppo.intra_step", "off",
        *extra,
    )  # fmt: skip
    pipeline = cpu_pipeline.CPUPipeline(args, checkpoints["actor"], checkpoints["reward"], [engine], with_models=False)
    pipeline.groups = dict(policy=policy, critic=None, reward=None, reference=None)
    try:
        pipeline.run_ppo(_recording_trainer(str(record)))
    finally:
        ray.get(engine.oppo_resume.remote(0, resume=False))
    return [json.loads(line) for line in open(record)] if record.exists() else []


@pytest.fixture
def policy(checkpoints, tmp_path):
    """The policy model actor; its checkpoints go to ``tmp_path / "ckpt"``."""
    args = cpu_pipeline.ppo_args(str(tmp_path), checkpoints["actor"], checkpoints["reward"])
    group = RayActorGroup(1, 1, cpu_pipeline.ACTOR_CLASSES["policy"], pg=None, num_gpus_per_actor=0)
    ray.get(group.async_init_model_from_pretrained(cpu_pipeline.get_strategy(args), checkpoints["actor"]))
    yield group
    for handle in group._actor_handlers:
        ray.kill(handle)


def _groups(steps):
    return [prompt for samples in steps for prompt in samples[::N_SAMPLES]]


def _assert_once_an_episode(steps, prompts, where):
    """Each prompt once in the first episode's steps, then once in the second's."""
    trained = _groups(steps)
    first, second = trained[: len(prompts)], trained[len(prompts) :]
    assert Counter(first) == Counter(second) == Counter(prompts), where
    bounds = {len(_groups(steps[:i])) for i in range(len(steps) + 1)}
    assert len(prompts) in bounds, f"{where}: a step mixes the two episodes"


def _checkpoints(tmp_path, steps):
    folder = tmp_path / "ckpt" / "_actor"
    return [torch.load(folder / f"global_step{step}.pt", weights_only=False) for step in range(1, steps + 1)]


def _resume_from(tmp_path, train, step, *flags):
    (tmp_path / "ckpt" / "_actor" / "latest").write_text(f"global_step{step}")
    return train(tmp_path / f"resumed-{step}.jsonl", *flags, "--ckpt.load_enable", "--ckpt.save_steps", "-1")


def test_resume_from_every_checkpoint_trains_every_prompt_once_an_episode(
    checkpoints, grading_engine, policy, tmp_path
):
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, [3, 5, 4, 3, 5], seed=11)
    everyone = [json.loads(line)["input"] for line in open(prompts)]
    train = functools.partial(_train, tmp_path, prompts, checkpoints, policy, grading_engine)
    full = train(tmp_path / "full.jsonl", *OVERCOMMIT, "--ckpt.save_steps", "1")
    _assert_once_an_episode(full, everyone, "the run")

    states = _checkpoints(tmp_path, len(full))
    # 5 prompts, B=2, Delta=2: the second step of an episode draws the last prompt and runs the dataloader out
    # with a group carried; the third trains that group and ends the episode.
    assert [s["overcommit_sampler"]["loader_exhausted"] for s in states] == [False, True, False] * 2
    assert [len(s["overcommit_sampler"]["carried"]) for s in states] == [2, 1, 0] * 2
    assert [s["episode"] for s in states] == [0, 0, 1, 1, 1, 2]  # where each resumes
    for step in range(1, len(full) + 1):
        resumed = _resume_from(tmp_path, train, step, *OVERCOMMIT)
        _assert_once_an_episode(full[:step] + resumed, everyone, f"resumed from step {step}")
    # The lag bound across carries, deferrals and every resume: reached, never passed.
    lags = [json.loads(line) for path in tmp_path.glob("*.jsonl.lag") for line in open(path)]
    assert lags and max(lags) == 1 and all(lag is not None and lag <= 1 for lag in lags)


def test_without_overcommit_the_checkpoint_of_an_episodes_end_resumes_the_next(
    checkpoints, grading_engine, policy, tmp_path
):
    """``--oppo.overcommit 0`` (upstream's samples generator): 3 prompts, B=2, the second step of an episode
    runs the dataloader out and ends the episode; its checkpoint resumes in the next episode."""
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, [3, 5, 3], seed=12)
    everyone = [json.loads(line)["input"] for line in open(prompts)]
    train = functools.partial(_train, tmp_path, prompts, checkpoints, policy, grading_engine)
    full = train(tmp_path / "full.jsonl", "--oppo.overcommit", "0", "--ckpt.save_steps", "1")
    assert [s["episode"] for s in _checkpoints(tmp_path, len(full))] == [0, 1, 1, 2]
    resumed = _resume_from(tmp_path, train, 2, "--oppo.overcommit", "0")
    _assert_once_an_episode(full[:2] + resumed, everyone, "resumed from step 2")
