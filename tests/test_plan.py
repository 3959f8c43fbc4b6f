"""The run's plan: what ``--oppo.enable`` alone resolves to for each placement, the lag bound it derives, that the
user's options win, and that resolving never writes into the parsed namespace."""

import copy
import json
import random

import pytest

from openrlhf_oppo import tiny
from openrlhf_oppo.cli.train_ppo_ray import parse_args
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.overcommit.sampler import OvercommitSamplesGenerator, PromptGroup
from openrlhf_oppo.plan import describe, resolve


def _roles(gpus: int, frozen_gpus: int = None) -> list:
    flags = []
    for role in ("actor", "critic", "reward", "ref"):
        count = frozen_gpus if frozen_gpus and role in ("reward", "ref") else gpus
        flags += [f"--{role}.num_nodes", "1", f"--{role}.num_gpus_per_node", str(count)]
    return flags


def _model(folder, shape: str) -> str:
    """A checkpoint folder that holds only the shape's config (the plan reads no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny.qwen2_config(shape).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {shape: _model(root / shape, shape) for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b")}


def _run(actor: str, batch: int = 32, max_new_tokens: int = 2048) -> list:
    """The benchmark's PPO settings (GAE critic, KL to the reference, one sample a prompt)."""
    return [
        "--actor.model_name_or_path", actor,
        "--reward.model_name_or_path", actor,
        "--critic.model_name_or_path", actor,
        "--rollout.batch_size", str(batch),
        "--train.batch_size", str(batch),
        "--rollout.max_new_tokens", str(max_new_tokens),
        "--data.max_len", str(max_new_tokens + 72),
        "--data.max_samples", "100000",
        "--algo.advantage.estimator", "gae",
        "--algo.kl.init_coef", "0.01",
        "--ds.zero_stage", "2",
    ]  # fmt: skip


def _split(actor, gpus: int) -> list:
    """vLLM on half the GPUs, the models on the other half (the benchmark's split placement)."""
    half = gpus // 2
    return _run(actor) + _roles(half) + [
        "--vllm.num_engines", str(half), "--vllm.gpu_memory_utilization", "0.75", "--oppo.colocate_models",
    ]  # fmt: skip


@pytest.mark.parametrize("gpus, shape", [(2, "qwen2.5-1.5b"), (4, "qwen2.5-3b")])
def test_the_split_placement_resolves_to_the_best_measured_runs_settings(models, gpus, shape):
    """The fastest split runs (2 GPUs at 1.5B, 4 GPUs at 3B, docs/results): the policy's log-probs from vLLM, the
    critic's catch-up of the next batch after its fit, the frozen models beside vLLM, new prompts after the sync,
    and Delta reaching twice the batch. Their deferral limit of 4 is what --oppo.max_lag 4 gives."""
    plan = resolve(parse_args(_split(models[shape], gpus) + ["--oppo.enable"]))
    assert (plan.stream.policy_logprobs, plan.stream.critic_catch_up, plan.stream.frozen_scorers_on) == (
        "vllm",
        "next_batch",
        "generation",
    )
    assert plan.stream.roles == ("policy", "critic", "reward", "reference")
    assert (plan.carry.top_up, plan.carry.kv, plan.sync.mode, plan.staged_sync) == (
        "step_start",
        "recompute",
        "staged",
        True,
    )
    assert plan.carry.overcommit.auto and (plan.carry.overcommit.initial, plan.carry.overcommit.maximum) == (32, 64)
    assert (plan.carry.max_lag, plan.carry.max_defer_steps) == (3, 3) and not plan.upstream_changes
    wider = resolve(parse_args(_split(models[shape], gpus) + ["--oppo.enable", "--oppo.max_lag", "4"]))
    assert wider.carry.max_defer_steps == 4 and wider.carry.overcommit.maximum == 64


def test_the_users_options_win_over_the_plan(models):
    base = _split(models["qwen2.5-1.5b"], 2) + ["--oppo.enable"]
    plan = resolve(
        parse_args(
            base
            + ["--oppo.overcommit", "16", "--oppo.policy_logprobs", "policy", "--oppo.frozen_scorers_on", "models"]
        )
    )
    assert not plan.carry.overcommit.auto and plan.carry.overcommit.initial == plan.carry.overcommit.maximum == 16
    assert (plan.stream.policy_logprobs, plan.stream.critic_catch_up, plan.stream.frozen_scorers_on) == (
        "policy",
        "next_step",
        "models",
    )
    assert not any(choice.setting == "policy_logprobs" for choice in plan.choices)


@pytest.mark.parametrize(
    "lag, top_up, defer, delta_max", [(1, "step_start", 1, 32), (2, "step_end", 1, 32), (3, "step_end", 2, 32)]
)
def test_the_lag_bound_sets_the_deferral_limit_and_delta(models, lag, top_up, defer, delta_max):
    """Under --train.colocate_all with vLLM awake, new prompts start before training (one version early) where the
    bound leaves them a step to be carried: the deferral limit is the bound, less that version."""
    argv = _run(models["qwen2.5-1.5b"]) + _roles(1) + ["--vllm.num_engines", "1", "--train.colocate_all"]
    plan = resolve(parse_args(argv + ["--oppo.enable", "--oppo.max_lag", str(lag), "--oppo.memory_flags", "as_given"]))
    assert (plan.carry.top_up, plan.carry.max_defer_steps, plan.carry.overcommit.maximum) == (top_up, defer, delta_max)
    assert plan.carry.max_defer_steps + (plan.carry.top_up == "step_end") == lag
    line = describe(plan)
    assert f"max lag {lag}: " in line and f"carried up to {defer} step{'s' * (defer > 1)}, " in line


def test_a_lag_of_zero_turns_inter_step_overlap_off(models):
    plan = resolve(parse_args(_split(models["qwen2.5-1.5b"], 2) + ["--oppo.enable", "--oppo.max_lag", "0"]))
    assert not plan.inter_step and plan.carry.max_lag == 0 and plan.stream.policy_logprobs == "policy"
    assert "no inter-step overlap" in describe(plan)


def test_resolving_never_writes_into_the_parsed_namespace(models):
    args = parse_args(_split(models["qwen2.5-1.5b"], 2) + ["--oppo.enable"])
    fresh = copy.deepcopy(args)  # not resolved yet: resolve works on it from scratch
    before = json.dumps(fresh, default=vars, sort_keys=True)
    resolve(fresh)
    assert json.dumps(fresh, default=vars, sort_keys=True) == before
    assert fresh.oppo.overcommit is None and fresh.oppo.policy_logprobs is None  # what the user gave: nothing
    assert resolve(fresh) is resolve(fresh)  # once per namespace


def test_the_memory_plan_weighs_its_candidates_without_touching_the_flags(models):
    """Under the hybrid engine on one H200 the plan tries vLLM awake beside the models: the candidates are layouts,
    and OpenRLHF's flags change only where apply_upstream_changes writes the one it kept."""
    hybrid = ["--vllm.enable_sleep", "--ds.enable_sleep", "--oppo.enable"] + H200
    args = parse_args(_colocated(models["qwen2.5-1.5b"], 2048, *hybrid))
    fresh = copy.deepcopy(args)
    for change in resolve(args).upstream_changes:  # parse_args applied them: the user's flags again
        group, name = change.flag[2:].split(".", 1)
        setattr(getattr(fresh, group), name, change.given)
    before = json.dumps(fresh, default=vars, sort_keys=True)
    plan = resolve(fresh)
    assert plan.upstream_changes and json.dumps(fresh, default=vars, sort_keys=True) == before


def test_the_hybrid_engine_stays_where_the_plan_has_no_gpu_to_measure(models):
    """On a machine without a GPU (and no --oppo.gpu_memory_gb), the memory plan cannot say what fits: the user's
    sleep flags stay, and so does upstream's memory share."""
    argv = _run(models["qwen2.5-1.5b"]) + _roles(1) + ["--vllm.num_engines", "1", "--train.colocate_all"]
    args = parse_args(argv + ["--vllm.enable_sleep", "--ds.enable_sleep", "--oppo.enable"])
    plan = resolve(args)
    assert plan.sync.vllm_sleeps and not plan.upstream_changes and args.vllm.enable_sleep and args.ds.enable_sleep
    assert plan.stream.roles == () and plan.sync.state_moves == "serial"  # overlapped moves hold two models' states


# -- the sampler keeps the bound: the deadlines ------------------------------------------------------------------


def _sampler(batch: int, limit: int):
    sampler = OvercommitSamplesGenerator.__new__(OvercommitSamplesGenerator)
    sampler.args = type("Args", (), {"rollout": type("Rollout", (), {"batch_size": batch})})()
    sampler.max_defer_steps, sampler.groups = limit, []
    return sampler


def test_the_due_groups_are_those_a_later_step_could_not_hold():
    """B = 2, carried at most 2 steps: one group overdue and three due next step; this step must train the
    overdue one and one of the three, or the next step would have three groups it must train."""
    sampler = _sampler(batch=2, limit=2)
    sampler.groups = [PromptGroup(f"p{i}", None, deferrals=d) for i, d in enumerate([1, 2, 1, 1, 0])]
    assert {sampler.groups[i].prompt for i in range(5) if id(sampler.groups[i]) in sampler._due()} == {"p0", "p1"}
    sampler.groups = [PromptGroup(f"p{i}", None, deferrals=d) for i, d in enumerate([1, 1, 0, 0])]
    assert sampler._due() == set()  # spread over the steps: nothing has to be waited for yet


@pytest.mark.parametrize("batch, limit, delta", [(4, 3, 8), (4, 2, 4), (3, 1, 3), (8, 4, 16)])
def test_no_group_is_carried_past_the_limit_whatever_finishes_first(batch, limit, delta):
    """The sampler's own take order and deadlines over 300 steps of random finishing orders: the step waits for
    the due groups (as ``_wait`` does) and takes B; no trained group was carried more than the limit."""
    rng = random.Random(batch * 100 + limit)
    sampler = _sampler(batch, limit)
    worst = 0
    for step in range(300):
        sampler.groups += [PromptGroup(f"{step}-{i}", None) for i in range(batch + delta - len(sampler.groups))]
        for group in sampler.groups:  # some finish while the step runs, the long ones rarely
            if group.experiences is None and rng.random() < 0.3:
                group.experiences = []
        due = sampler._due()
        for group in sampler.groups:
            if id(group) in due:
                group.experiences = []  # the step waits for it
        for group in sampler._in_take_order([g for g in sampler.groups if g.experiences is None]):
            if sum(g.experiences is not None for g in sampler.groups) >= batch:
                break
            group.experiences = []  # ... and for the B-th group
        taken = sampler._take(batch)
        assert len(taken) == batch
        worst = max([worst] + [g.deferrals for g in taken])
    assert 1 <= worst <= limit  # groups were carried, never past the limit


def test_every_option_is_documented():
    from pathlib import Path

    from openrlhf_oppo.config import ALL_OPTIONS

    page = (Path(__file__).parent.parent / "docs" / "options.md").read_text()
    assert all(f"`--oppo.{name}" in page for name in ALL_OPTIONS)


def _colocated(actor, max_new_tokens, *flags) -> list:
    """One GPU, everything on it (the benchmark's colocated placement), vLLM at 0.45."""
    argv = _run(actor, max_new_tokens=max_new_tokens) + _roles(1) + ["--actor.gradient_checkpointing_enable"]
    argv += ["--rollout.micro_batch_size", "8", "--train.micro_batch_size", "2", "--vllm.num_engines", "1"]
    return argv + ["--train.colocate_all", "--vllm.gpu_memory_utilization", "0.45", *flags]


H200 = ["--oppo.gpu_memory_gb", "140.4"]


def test_the_hybrid_engine_wakes_up_where_the_memory_plan_fits_it(models):
    """The repository's measured best on one H200 (1.5B, responses up to 2048 tokens): vLLM awake with a small
    share and the DeepSpeed states on the GPU, carried requests and new prompts decoding beside training."""
    hybrid = ["--vllm.enable_sleep", "--ds.enable_sleep", "--oppo.enable"] + H200
    args = parse_args(_colocated(models["qwen2.5-1.5b"], 2048, *hybrid))
    plan = resolve(args)
    assert not plan.sync.vllm_sleeps and not args.vllm.enable_sleep and not args.ds.enable_sleep  # applied
    assert args.vllm.gpu_memory_utilization == 0.1
    assert {c.flag for c in plan.upstream_changes} == {
        "--vllm.enable_sleep",
        "--ds.enable_sleep",
        "--vllm.gpu_memory_utilization",
    }
    assert (plan.carry.colocated_decode, plan.carry.top_up, plan.carry.max_defer_steps) == (
        "during_training",
        "step_end",
        2,
    )
    assert plan.stream.roles == ("critic", "reward", "reference") and plan.memory.fits
    assert "changed --vllm.enable_sleep on -> off" in describe(plan)


def test_states_the_user_keeps_on_the_gpu_stay_there(models):
    """Moving them off was slower than upstream's own layout in every paired run on one H200: where vLLM awake does
    not fit beside them (responses up to 4096 tokens), the plan keeps the user's layout; the scorers' caches do not
    fit beside vLLM's 0.45 either, so nothing streams, and at 2048 tokens they do."""
    args = parse_args(_colocated(models["qwen2.5-1.5b"], 4096, "--vllm.enable_sleep", "--oppo.enable", *H200))
    plan = resolve(args)
    assert plan.sync.vllm_sleeps and not args.ds.enable_sleep and not plan.upstream_changes
    assert plan.sync.state_moves == "serial" and plan.stream.roles == ()
    shorter = resolve(
        parse_args(_colocated(models["qwen2.5-1.5b"], 1024, "--vllm.enable_sleep", "--oppo.enable", *H200))
    )
    assert not shorter.sync.vllm_sleeps  # and at 1024 tokens vLLM awake fits beside the states


H100 = ["--oppo.gpu_memory_gb", "79.6"]


def test_a_hybrid_engine_run_with_no_model_to_stream_is_not_refused(models):
    """Group norm with a remote reward and no KL: no critic, reward or reference model, and the policy shares vLLM's
    GPU. On 96 GiB a 3B run fits asleep but not awake; the plan must not then try streaming beside the sleeping
    engines, which nothing here can do, and refuse the run OpenRLHF makes."""
    argv = _colocated(models["qwen2.5-3b"], 2048, "--vllm.enable_sleep", "--ds.enable_sleep", "--oppo.enable")
    argv += ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "http://localhost:5000/get_reward"]
    argv += ["--algo.kl.init_coef", "0", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "128"]
    plan = resolve(parse_args(argv + ["--vllm.gpu_memory_utilization", "0.5", "--oppo.gpu_memory_gb", "96"]))
    assert plan.sync.vllm_sleeps and plan.stream.roles == () and plan.inter_step
    assert not any(choice.setting == "intra_step" for choice in plan.choices)


def test_oppo_runs_where_openrlhf_runs_dropping_its_extras_to_fit(models, capsys):
    """One H100, 1.5B, the hybrid engine, responses up to 4096 tokens: OpenRLHF ran it. The plan drops OPPO's own
    additions where they do not fit, never refuses the run, and its line shows OpenRLHF's own estimate beside OPPO's.
    """
    args = parse_args(
        _colocated(models["qwen2.5-1.5b"], 4096, "--vllm.enable_sleep", "--ds.enable_sleep", "--oppo.enable", *H100)
    )
    plan = resolve(args)
    assert plan.inter_step and plan.sync.vllm_sleeps
    line = describe(plan)
    assert "OpenRLHF alone" in line and f"of {79.6:.1f} GiB" in line
    assert plan.memory.estimate.worst.peak_gib <= plan.memory.upstream.worst.peak_gib + 1e-6 or plan.memory.fits


def test_extras_go_one_at_a_time_cheapest_first_and_a_given_one_stays(models):
    """On a GPU too small for the scorers' caches: the cache budget halves down to its floor, then one role after
    the other stops streaming, the log-prob roles first, until the run fits or none streams. A budget the user gave
    is theirs: it stays, and a run that does not fit then runs with a warning naming the flag."""
    argv = _colocated(models["qwen2.5-0.5b"], 1024, "--oppo.enable", "--oppo.memory_flags", "as_given")
    roomy = resolve(parse_args(argv + ["--oppo.gpu_memory_gb", "140"]))
    tight = resolve(parse_args(argv + ["--oppo.gpu_memory_gb", "80"]))
    assert roomy.memory.fits and not roomy.memory.dropped and roomy.stream.roles
    dropped = [(c.setting, c.value) for c in tight.memory.dropped]
    assert dropped[:3] == [("cache_budget_gb", 2.0), ("cache_budget_gb", 1.0), ("cache_budget_gb", 0.5)]
    streams_dropped = [value.split()[-1] for setting, value in dropped[3:]]
    assert streams_dropped and streams_dropped == [
        r for r in ("reference", "critic", "reward") if r in streams_dropped
    ]
    assert set(tight.stream.roles) == set(roomy.stream.roles) - set(streams_dropped)
    assert tight.memory.fits or not tight.stream.roles
    assert "dropped to fit: cache_budget_gb 0.5, streaming off for " in describe(tight)

    given = resolve(parse_args(argv + ["--oppo.gpu_memory_gb", "80", "--oppo.cache_budget_gb", "4"]))
    assert given.stream.cache_budget_gb == 4 and set(given.stream.roles) == set(roomy.stream.roles)
    assert not given.memory.fits and "change --" in given.memory.warning()


def test_a_run_that_does_not_fit_runs_with_a_warning_unless_strict(models):
    """3B on a 40 GiB GPU: OpenRLHF's own layout is estimated over it. Without --oppo.strict_memory the plan
    resolves and warns in one line naming the flag to change; with it the run is refused before Ray starts."""
    argv = _colocated(models["qwen2.5-3b"], 4096, "--vllm.enable_sleep", "--oppo.enable", "--oppo.gpu_memory_gb", "40")
    plan = resolve(parse_args(argv))
    warning = plan.memory.warning()
    assert warning.startswith("OpenRLHF's own layout is estimated at") and "change --" in warning
    assert "\n" not in warning
    with pytest.raises(OPPOConfigError, match=r"does not fit the GPU's 40.0 GiB: .*change --"):
        parse_args(argv + ["--oppo.strict_memory"])


def test_a_deferral_limit_given_alone_sets_the_lag_bound(models):
    plan = resolve(parse_args(_split(models["qwen2.5-1.5b"], 2) + ["--oppo.enable", "--oppo.max_defer_steps", "4"]))
    assert (plan.carry.max_defer_steps, plan.carry.max_lag) == (4, 4)
    assert [c.reason for c in plan.choices if c.setting == "overcommit"] == ["max lag 4: groups carried up to 4 steps"]


@pytest.mark.parametrize("off", [["--oppo.max_lag", "0"], ["--oppo.overcommit", "0"]])
def test_a_rule_for_delta_without_inter_step_overlap_names_what_turned_it_off(models, off):
    argv = _split(models["qwen2.5-1.5b"], 2) + ["--oppo.enable", *off, "--oppo.overcommit_rule", "reward_slope"]
    with pytest.raises(
        OPPOConfigError, match=r"^--oppo.overcommit_rule tunes inter-step overlap, which --oppo.overcommit 0 "
    ):
        parse_args(argv)
