"""OPPOTrainer's step loop end to end on CPU: a real vLLM engine, real scoring models, upstream's
PPOTrainer.fit, and the CPU stand-in for DeepSpeed training (weights do not change, versions do).
Checks the oppo/* metrics in OpenRLHF's tensorboard log, the traces, and checkpointing of carried prompts.
"""

import glob
import inspect
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from openrlhf_oppo import tiny
from openrlhf_oppo.bench.report import read_steps
from openrlhf_oppo.testing import cpu_pipeline

# --train.agent_func_path: the engine grades its samples itself (the grading_engine fixture).
GRADING_AGENT = str(Path(__file__).parent / "data" / "grading_engine.py")

pytestmark = pytest.mark.engine

# Mostly short responses and a few long ones, so that groups are carried over.
LENGTHS = [4, 6, 3, 90, 5, 7, 4, 100, 6, 5, 3, 6]
# A step's timed phases, in order: upstream's generation (in its fit), then those of OPPOTrainer.train_step.
STEP_PHASES = ["generation", "end_of_generation", "make_experience", "ppo_train", "broadcast"]


def run(checkpoints, engine, workdir, prompts, *extra):
    args = cpu_pipeline.ppo_args(
        str(workdir), checkpoints["actor"], checkpoints["reward"],
        "--data.prompt_dataset", prompts,
        "--data.max_len", "256",
        "--rollout.batch_size", "4",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", "4",
        "--train.batch_size", "8",
        "--train.micro_batch_size", "2",
        "--logger.tensorboard_dir", str(workdir / "tb"),
        "--logger.wandb.run_name", "run",
        *extra,
    )  # fmt: skip
    pipeline = cpu_pipeline.CPUPipeline(args, checkpoints["actor"], checkpoints["reward"], [engine])
    try:
        from openrlhf_oppo.trainer import OPPOTrainerRayActor

        pipeline.run_ppo(OPPOTrainerRayActor)
    finally:
        pipeline.coordinator.resume(0, resume=False)  # the shared engine starts the next test at version 0
        pipeline.kill()
    return read_steps(str(workdir / "tb" / "run"))


@pytest.mark.parametrize("top_up", ["step_start", "step_end"])
def test_oppo_trainer_runs_two_episodes_with_streaming_and_overcommit(checkpoints, engine, tmp_path, top_up):
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=3)
    steps = run(
        checkpoints, engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "2", "--oppo.chunk_size", "8", "--oppo.top_up", top_up,
        # The policy's own ranks score its log-probs and the critic catches up at the next step (what the plan
        # picks with vLLM asleep or at another temperature): both hold their chunks through training.
        "--oppo.policy_logprobs", "policy", "--oppo.critic_catch_up", "next_step",
        "--oppo.trace_dir", str(tmp_path / "trace"), "--oppo.profile_step", "2",
        "--train.num_episodes", "2",
    )  # fmt: skip
    # step_end: prompts of the next step were in flight through training and the weight update.
    assert (max(s["oppo/topped_up_at_step_end"] for s in steps) > 0) == (top_up == "step_end")
    assert sum(s["rollout/num_samples"] for s in steps) == 2 * len(LENGTHS) * 2  # each prompt once an episode
    for step in steps:
        assert step["oppo/chunk_size"] == 8 and step["oppo/overcommit"] == 2
        assert step["oppo/fallback_micro_batches"] == 0  # carried samples were rescored, not recomputed
        assert 0 <= step["oppo/prefill_hidden_fraction"] <= 1
        assert step["oppo/discarded_sequences"] == 0
        assert step["oppo/scores_waiting"] <= step["oppo/carried_groups"] * 2  # only carried samples wait
        # Each model's own training lies within the step's training phase, which waits for both.
        assert 0 < step["oppo/critic_fit_s"] <= step["timing/ppo_train"]
        assert 0 < step["oppo/policy_fit_s"] <= step["timing/ppo_train"]
    assert max(s["oppo/deferred_groups_trained"] for s in steps) > 0
    assert max(s["oppo/policy_lag_max"] for s in steps) >= 1
    traces = sorted(glob.glob(str(tmp_path / "trace" / "step_*.json")))
    assert len(traces) == len(steps)
    names = {event["name"] for event in json.load(open(traces[-1]))["traceEvents"]}
    assert {"generation", "make_experience", "ppo_train", "weight_sync", "prefill", "fit"} <= names
    assert {"flush", "collect", "kl_advantages", "advantages"} <= names  # the parts of make_experience
    assert {"top_up", "wait"} <= names  # the parts of generation
    assert {"hold", "release"} <= names  # the carried chunks, held from generation's end to the weight sync's
    for trace, step in zip(traces, steps):
        phases = timed_phases(trace)
        assert [phase["name"] for phase in phases] == STEP_PHASES
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(phases, phases[1:]))  # one after the other (us)
        for phase in phases[1:]:  # one timing for both the trace and the logged timing/* metric
            assert step[f"timing/{phase['name']}"] == pytest.approx(phase["dur"] / 1e6, rel=1e-5)
    # Chunks held through training reach the critic and the policy only once the weight sync is done.
    assert not any(prefills_while_training(trace, role) for trace in traces for role in ("critic", "policy"))
    # --oppo.profile_step 2: each trained model's second fit, operator by operator, and no other step's.
    profiles = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "trace" / "profile_*.json")))
    assert profiles == ["profile_critic_rank0_step00002.json", "profile_policy_rank0_step00002.json"]
    for profile in profiles:
        ops = {event.get("name") for event in json.load(open(tmp_path / "trace" / profile))["traceEvents"]}
        assert {"aten::pow", "aten::sum"} <= ops  # the CPU stand-in's training, as torch.profiler saw it


def timed_phases(trace: str) -> list:
    """The spans of the step's phases on the trace's "trainer" track, in the order they started."""
    events = json.load(open(trace))["traceEvents"]
    return sorted((e for e in events if e["tid"] == "trainer" and e["name"] in STEP_PHASES), key=lambda e: e["ts"])


def test_colocated_engines_pause_then_take_the_next_prompts_which_start_with_training(checkpoints, engine, tmp_path):
    """Awake engines on the models' GPUs pause while the step makes its experiences and decode beside training
    (--oppo.colocated_decode during_training); with --oppo.top_up step_end the next step's prompts go to the
    engines after the pause, where they wait queued until training restarts the engines: added before the pause,
    the pause would wait behind them; added as training starts, they would start late."""
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=3)
    steps = run(
        checkpoints, engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "2", "--oppo.chunk_size", "8", "--oppo.max_lag", "2",
        "--train.colocate_all", "--oppo.colocated_decode", "during_training", "--oppo.top_up", "step_end",
        "--oppo.trace_dir", str(tmp_path / "trace"),
    )  # fmt: skip
    assert max(s["oppo/topped_up_at_step_end"] for s in steps) > 0
    topped_up = 0
    for trace in sorted(glob.glob(str(tmp_path / "trace" / "step_*.json"))):
        spans = {e["name"]: e for e in json.load(open(trace))["traceEvents"] if e["tid"] == "trainer"}
        if "top_up" not in spans:
            continue  # the episode's last step: no next prompts
        topped_up += 1
        pause, top_up, unpause, training = spans["pause"], spans["top_up"], spans["unpause"], spans["ppo_train"]
        assert pause["ts"] + pause["dur"] <= top_up["ts"]  # every step pauses first, carried groups or not
        assert top_up["ts"] + top_up["dur"] <= training["ts"] <= unpause["ts"]
    assert topped_up > 0


def test_a_step_reads_as_its_phases():
    """``train_step`` stays a short list of phase calls, each phase a method that times itself (``_timed``)."""
    from openrlhf_oppo.trainer import OPPOTrainer

    source = inspect.getsource(OPPOTrainer.train_step)
    assert len(source.splitlines()) <= 40
    assert "time.time()" not in source


def prefills_while_training(trace: str, role: str) -> list:
    """``role``'s prefill calls that started between the start of the step's training and the end of its
    weight sync."""
    events = json.load(open(trace))["traceEvents"]
    trainer = {event["name"]: event for event in events if event["tid"] == "trainer"}
    start = trainer["ppo_train"]["ts"]
    end = trainer["weight_sync"]["ts"] + trainer["weight_sync"]["dur"]
    return [e for e in events if e["tid"] == role and e["name"] == "prefill" and start <= e["ts"] <= end]


def test_the_critic_catches_up_as_soon_as_its_training_ends(checkpoints, engine, tmp_path):
    """``--oppo.critic_catch_up after_fit``: the critic's held chunks go out when its own fit returns, while
    the policy's wait for the next step; every prompt is still trained once."""
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=3)
    steps = run(
        checkpoints, engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "2", "--oppo.chunk_size", "8", "--oppo.critic_catch_up", "after_fit",
        "--oppo.trace_dir", str(tmp_path / "trace"),
    )  # fmt: skip
    assert sum(s["rollout/num_samples"] for s in steps) == len(LENGTHS) * 2
    assert all(s["oppo/fallback_micro_batches"] == 0 for s in steps)  # carried samples rescored, not recomputed
    traces = sorted(glob.glob(str(tmp_path / "trace" / "step_*.json")))
    assert any(prefills_while_training(trace, "critic") for trace in traces)
    assert not any(prefills_while_training(trace, "policy") for trace in traces)


def test_the_critic_catches_up_on_the_next_batch_only(checkpoints, engine, tmp_path):
    """``--oppo.critic_catch_up next_batch`` with Delta twice the batch: when the critic's fit ends and the
    next step's groups are all done, the critic gets their held chunks only, the rest wait, and every prompt is
    still trained once with streamed scores (test_streaming_pipeline.py checks what reaches the critic)."""
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=3)
    steps = run(
        checkpoints, engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "8", "--oppo.chunk_size", "8", "--oppo.critic_catch_up", "next_batch",
    )  # fmt: skip
    assert sum(s["rollout/num_samples"] for s in steps) == len(LENGTHS) * 2
    assert all(s["oppo/fallback_micro_batches"] == 0 for s in steps)  # the critic's scores were streamed
    assert {s["oppo/critic_catch_up_batch_only"] for s in steps} <= {0.0, 1.0}
    assert max(s["oppo/critic_catch_up_batch_only"] for s in steps) == 1.0


class _Group:
    """A model group whose calls return at once; ``ray.get`` (patched below) logs when each is awaited."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def async_run_method(self, method_name, **kwargs):
        self.log.append(f"{self.name} {method_name}")
        return [f"{self.name} {method_name}"]


def _state_moves_trainer(monkeypatch, log, frozen_policy=False, vllm_asleep=True, critic_catch_up="next_step"):
    """What ``OPPOTrainer``'s state-move methods read, with ``ray.get`` logging each wait."""
    from openrlhf_oppo import trainer as trainer_module
    from openrlhf_oppo.plan import Plan, Stream, Sync

    def get(refs):
        log.extend(f"{ref} awaited" for ref in refs)
        return [{f"{ref} loss": 1.0} for ref in refs]

    monkeypatch.setattr(trainer_module.ray, "get", get)
    trainer = SimpleNamespace(
        args=SimpleNamespace(
            critic=SimpleNamespace(freezing_steps=5 if frozen_policy else -1),
            vllm=SimpleNamespace(enable_sleep=vllm_asleep),
        ),
        plan=Plan(enabled=True, stream=Stream(critic_catch_up=critic_catch_up), sync=Sync(vllm_sleeps=vllm_asleep)),
        coordinator=SimpleNamespace(
            catch_up=lambda role, streams: log.append(  # the coordinator releases the role without a next batch
                f"release {role}" if streams is None else f"catch_up {role} {' '.join(streams)}"
            ),
        ),
        samples_generator=SimpleNamespace(next_batch_streams=lambda: ["next", "batch"]),  # all done
        critic_model_group=_Group("critic", log),
        actor_model_group=_Group("actor", log),
        kl_ctl=SimpleNamespace(value=0.0),
        critic_reload=[],
        policy_offload=[],
        policy_offload_due=False,
    )
    trainer._critic_catch_up = lambda: trainer_module.OPPOTrainer._critic_catch_up(trainer)
    return trainer


@pytest.mark.parametrize("frozen_policy", [False, True])
def test_state_moves_overlap_the_other_models_training(monkeypatch, frozen_policy):
    """``--oppo.state_moves overlap``: the policy's states start loading before the critic's fit is awaited,
    and the critic's start going back before the policy's fit starts; with the policy frozen
    (``--critic.freezing_steps``) only the critic trains and moves. Each fit's status is merged as upstream's
    sleep-mode branch merges it (its first rank's), and the trainer's wait on the moves is logged."""
    from openrlhf_oppo.trainer import OPPOTrainer

    log = []
    trainer = _state_moves_trainer(monkeypatch, log, frozen_policy)
    status = OPPOTrainer._train_overlapping_state_moves(trainer, 1)
    assert not any(entry.startswith("release") for entry in log)  # --oppo.critic_catch_up next_step
    if frozen_policy:
        assert [e for e in log if not e.endswith("awaited")] == [
            "critic reload_states",
            "critic fit",
            "critic offload_states",
        ]
        assert set(status) == {"critic fit loss", "oppo/state_moves_wait_s"}
        return
    assert log.index("actor reload_states") < log.index("critic fit awaited")
    assert log.index("critic offload_states") < log.index("actor fit")
    assert log.index("actor reload_states awaited") < log.index("actor fit")  # the policy trains on its states
    assert log.index("critic reload_states awaited") < log.index("critic fit")
    assert log[-2:] == ["actor offload_states awaited", "critic offload_states awaited"]  # both back when it returns
    assert set(status) == {"critic fit loss", "actor fit loss", "oppo/state_moves_wait_s"}
    assert status["oppo/state_moves_wait_s"] >= 0


@pytest.mark.parametrize(
    "critic_catch_up, sent", [("after_fit", "release critic"), ("next_batch", "catch_up critic next batch")]
)
def test_the_critic_catches_up_between_the_fits_with_the_state_moves_overlapped(monkeypatch, critic_catch_up, sent):
    """``--oppo.critic_catch_up after_fit`` or ``next_batch`` under ``--oppo.state_moves overlap``: the critic's
    held chunks (with next_batch, those of the next batch, all done here) go out once its fit has returned, before
    the policy's fit starts."""
    from openrlhf_oppo.trainer import OPPOTrainer

    log = []
    trainer = _state_moves_trainer(monkeypatch, log, critic_catch_up=critic_catch_up)
    status = OPPOTrainer._train_overlapping_state_moves(trainer, 1)
    assert log.index("critic fit awaited") < log.index(sent) < log.index("actor fit")
    assert status["oppo/critic_catch_up_batch_only"] == float(critic_catch_up == "next_batch")


def test_state_moves_start_outside_training_where_they_can(monkeypatch):
    """The critic's states start loading when its scores are in, and with the engines awake the policy's go back
    after the weight sync: training awaits the first, the next step's training the second, and neither is started
    twice."""
    from openrlhf_oppo.trainer import OPPOTrainer

    log = []
    trainer = _state_moves_trainer(monkeypatch, log, vllm_asleep=False)
    for step in (1, 2):
        OPPOTrainer._prefetch_critic_states(trainer)  # make_experience, once the streamed scores are collected
        assert log[-1] == "critic reload_states"
        started = len(log)
        OPPOTrainer._train_overlapping_state_moves(trainer, step)
        this_step = log[started:]
        assert "critic reload_states" not in this_step  # started once, before training
        assert this_step.index("critic reload_states awaited") < this_step.index("critic fit")
        assert "actor offload_states" not in this_step  # the weight sync reads the policy's weights first
        if step == 2:  # the first step's offload, awaited before this step's moves
            assert this_step[0] == "actor offload_states awaited"
        OPPOTrainer._offload_policy_states(trainer)  # after the weight sync
        assert log[-1] == "actor offload_states"
    OPPOTrainer._offload_policy_states(trainer)
    assert log.count("actor offload_states") == 2  # once a step


@pytest.mark.parametrize("critic_catch_up", ["next_step", "after_fit"])
def test_a_run_with_the_state_moves_overlapped(checkpoints, engine, tmp_path, critic_catch_up):
    """``--ds.enable_sleep --oppo.state_moves overlap`` end to end (DeepSpeed's moves are the CPU stand-in's):
    every prompt is trained once, both models train every step, and the wait on the moves is logged. With
    ``--oppo.critic_catch_up after_fit`` the critic scores its held chunks during training, and no sample falls
    back to a forward pass for want of its scores."""
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=3)
    steps = run(
        checkpoints, engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "2", "--oppo.chunk_size", "8",
        "--ds.enable_sleep", "--oppo.state_moves", "overlap", "--oppo.critic_catch_up", critic_catch_up,
        "--oppo.trace_dir", str(tmp_path / "trace"),
    )  # fmt: skip
    assert sum(s["rollout/num_samples"] for s in steps) == len(LENGTHS) * 2
    for step in steps:
        assert 0 <= step["oppo/state_moves_wait_s"] <= step["timing/ppo_train"]
        assert 0 < step["oppo/critic_fit_s"] + step["oppo/policy_fit_s"] <= step["timing/ppo_train"]
        assert step["oppo/fallback_micro_batches"] == 0
    traces = sorted(glob.glob(str(tmp_path / "trace" / "step_*.json")))
    assert any(prefills_while_training(trace, "critic") for trace in traces) == (critic_catch_up == "after_fit")


def test_the_engine_scores_the_policys_logprobs(checkpoints, engine, tmp_path):
    """``--oppo.policy_logprobs vllm``: the engine scores the policy's log-probs of its samples (no micro-batch
    falls back to the policy's forward, and the policy's ranks, which have no scorer, prefill nothing), every
    prompt is trained once and no score is left behind. With Delta twice the batch, the next step's groups are
    all done by some weight sync, and the engine then scores theirs only."""
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=3)
    steps = run(
        checkpoints, engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "8", "--oppo.chunk_size", "8", "--oppo.policy_logprobs", "vllm",
        "--rollout.temperature", "1.0", "--oppo.trace_dir", str(tmp_path / "trace"),
    )  # fmt: skip
    assert sum(s["rollout/num_samples"] for s in steps) == len(LENGTHS) * 2
    for step in steps:
        assert step["oppo/fallback_micro_batches"] == 0
        assert step["oppo/scores_waiting"] <= step["oppo/carried_groups"] * 2  # only carried samples wait
        assert step["oppo/busy_s/policy"] > 0 and step["oppo/busy_s/critic"] > 0  # the engine's time, the critic's
    assert max(s["oppo/engine_scoring_batch_only"] for s in steps) == 1.0
    traces = glob.glob(str(tmp_path / "trace" / "step_*.json"))
    events = [event for trace in traces for event in json.load(open(trace))["traceEvents"]]
    prefills = {event["tid"] for event in events if event["name"] == "prefill"}
    assert "critic" in prefills and "policy" not in prefills
    # The engine scores what finished during training as soon as it holds the new weights, not from the next
    # step's start.
    trainer = sorted((e for e in events if e["tid"] == "trainer"), key=lambda e: e["ts"])
    syncs = [e["ts"] + e["dur"] for e in trainer if e["name"] == "weight_sync"]
    generations = [e["ts"] for e in trainer if e["name"] == "generation"]
    gaps = [(end, min(t for t in generations if t > end)) for end in syncs if any(t > end for t in generations)]
    scoring = [e["ts"] for e in events if e["name"] == "policy_logprobs"]
    assert any(start <= t <= next_step for start, next_step in gaps for t in scoring)


def test_checkpoint_keeps_carried_prompts_and_resume_trains_them_first(checkpoints, engine, tmp_path):
    prompts = str(tmp_path / "prompts.jsonl")
    tiny.write_prompts(prompts, LENGTHS, seed=4)
    common = ["--oppo.enable", "--oppo.overcommit", "3", "--oppo.intra_step", "off", "--train.num_episodes", "1"]
    run(checkpoints, engine, tmp_path, prompts, *common, "--ckpt.save_steps", "1", "--oppo.max_defer_steps", "3")

    saved = sorted(glob.glob(str(tmp_path / "ckpt" / "_actor" / "global_step*.pt")))
    states = [torch.load(path, weights_only=False) for path in saved]
    with_carry = [s for s in states if s["overcommit_sampler"]["carried"]]
    assert with_carry, "no step ended with groups carried over"
    # Resume from the first checkpoint that has carried groups.
    state = with_carry[0]
    with open(tmp_path / "ckpt" / "_actor" / "latest", "w") as f:
        f.write(f"global_step{state['global_step']}")
    os.makedirs(tmp_path / "resumed", exist_ok=True)
    resumed = run(
        checkpoints, engine, tmp_path / "resumed", prompts, *common,
        "--ckpt.load_enable", "--ckpt.path", str(tmp_path / "ckpt"),
    )  # fmt: skip
    carried = len(state["overcommit_sampler"]["carried"])
    trained_before = state["total_consumed_prompts"]
    trained_after = sum(s["rollout/num_samples"] for s in resumed) / 2
    assert trained_before + trained_after == len(LENGTHS)  # nothing lost, nothing twice
    assert sum(s["oppo/deferred_groups_trained"] for s in resumed) >= carried  # the restored groups were trained


def test_filtered_and_edited_samples_are_discarded_and_evaluation_is_not_streamed(
    checkpoints, grading_engine, tmp_path
):
    """The engine grades and edits its samples (``grading_engine``): dynamic filtering drops the groups of
    even lengths, responses of more than 8 tokens are edited after generation, and every step evaluates.
    No score is left waiting in a scoring actor after any step.

    One step an episode with all four prompts. With more, the shuffle could leave a filtered prompt for a
    last generation that has nothing to train: no step would discard what it dropped."""
    prompts, evals = str(tmp_path / "prompts.jsonl"), str(tmp_path / "eval.jsonl")
    tiny.write_prompts(prompts, [3, 4, 10, 9], seed=6)
    tiny.write_prompts(evals, [3, 5], seed=7)
    steps = run(
        checkpoints, grading_engine, tmp_path, prompts,
        "--oppo.enable", "--oppo.overcommit", "0", "--oppo.chunk_size", "4",
        # The engine's executor is the agent; the flag tells upstream's checks that rewards come with samples.
        "--algo.dynamic_filtering_enable", "--train.agent_func_path", GRADING_AGENT,
        "--eval.dataset", evals, "--eval.steps", "1", "--eval.n_samples_per_prompt", "2",
        "--train.num_episodes", "2",
    )  # fmt: skip
    assert len(steps) == 2
    for step in steps:
        # The samples of the filtered groups (4 and 10), and the streams replaced when 10 and 9 were edited.
        assert step["oppo/discarded_sequences"] == 2 * 2 + 2 * 2
        assert step["oppo/scores_waiting"] == 0  # the first step's evaluation samples would wait here
        assert step["oppo/fallback_micro_batches"] == 0
