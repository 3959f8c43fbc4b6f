"""The wrapper CLI: upstream's flags unchanged, the --oppo group, and clear errors before anything starts."""

import json
import re
import runpy
import sys

import pytest
from conftest import run_together

from openrlhf_oppo.cli.train_ppo_ray import parse_args
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.plan import describe, resolve

BASE = [
    "--actor.model_name_or_path", "m",
    "--reward.model_name_or_path", "m",
    "--actor.num_gpus_per_node", "2",
    "--critic.num_gpus_per_node", "2",
    "--reward.num_gpus_per_node", "2",
    "--ref.num_gpus_per_node", "2",
    "--vllm.num_engines", "1",
    "--rollout.batch_size", "16",
    "--train.batch_size", "16",
]  # fmt: skip


class _Captured(Exception):
    pass


def upstream_args(argv, monkeypatch):
    """What upstream's own driver hands to ``train`` (stopped at its first line that touches Ray)."""
    import openrlhf.utils
    import ray

    def capture(args):
        raise _Captured(args)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(openrlhf.utils, "get_strategy", capture)
    monkeypatch.setattr(sys, "argv", ["train_ppo_ray"] + argv)
    with pytest.raises(_Captured) as captured:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    return captured.value.args[0]


def as_dict(namespace):
    return {k: as_dict(v) if hasattr(v, "__dict__") else v for k, v in vars(namespace).items()}


@pytest.mark.parametrize(
    "extra",
    [[], ["--train.colocate_all", "--vllm.enable_sleep", "--algo.advantage.estimator", "group_norm"]],
    ids=["default", "colocated-grpo"],
)
def test_without_oppo_flags_args_are_upstreams(extra, monkeypatch):
    ours = as_dict(parse_args(BASE + extra + ["--rollout.n_samples_per_prompt", "2"]))
    theirs = as_dict(upstream_args(BASE + extra + ["--rollout.n_samples_per_prompt", "2"], monkeypatch))
    assert ours.pop("oppo")["enable"] is False
    assert ours == theirs


@pytest.fixture(scope="module")
def help_text(cli_help):
    return cli_help


def test_help_lists_every_oppo_option(help_text):
    from openrlhf_oppo.config import OPTIONS

    assert "OPPO (pipeline overlap)" in help_text and "--actor.model_name_or_path" in help_text
    for name in OPTIONS:
        assert f"--oppo.{name}" in help_text


def test_the_oppo_group_shows_at_most_eight_options_and_the_advanced_ones_one_sentence_each(help_text):
    """What a user meets first is the plan's knobs; the mechanism switches sit in a group of their own."""
    main = help_text[help_text.index("OPPO (pipeline overlap)") : help_text.index("OPPO advanced")]
    advanced = help_text[help_text.index("OPPO advanced") :]
    assert len(re.findall(r"\n  --oppo\.", main)) <= 8
    for entry in re.split(r"\n  (?=--)", advanced)[1:]:
        flag, sentence = entry.split()[0], " ".join(entry.split()).split(" Default: ")[0]
        assert sentence.count(". ") == 0 and not re.search(r"[0-9]\.[0-9]+x", sentence), flag


def _option_help(help_text):
    """Each --oppo.* option's entry in the help (flag, value and sentence), whitespace folded."""
    ours = help_text[help_text.index("OPPO (pipeline overlap)") :]
    entries = re.split(r"\n  (?=--)", ours)[1:]
    return {entry.split()[0]: " ".join(entry.split()) for entry in entries}


def test_help_shows_every_default_and_what_each_option_takes(help_text):
    from openrlhf_oppo.config import ALL_OPTIONS

    entries = _option_help(help_text)
    assert set(entries) == {"--oppo.enable"} | {f"--oppo.{n}" for n in ALL_OPTIONS}
    for flag, entry in entries.items():
        assert "Default: " in entry, entry
        assert "OPPO." not in entry, f"{flag}: give it a metavar"
    assert entries["--oppo.chunk_size"].startswith("--oppo.chunk_size N|auto ")
    assert entries["--oppo.overcommit"].startswith("--oppo.overcommit N|auto ")
    assert "Default: 4," in entries["--oppo.cache_budget_gb"]
    assert entries["--oppo.intra_step"].startswith("--oppo.intra_step {auto,on,off} ")
    assert entries["--oppo.intra_step"].endswith("Default: auto.")
    assert entries["--oppo.enable"].endswith("Default: off.")


def test_help_lists_no_benchmark_flags(help_text, capsys):
    """The benchmark's workload flags are its driver's (``bench.driver``), not the user CLI's."""
    assert "--bench." not in help_text and "Benchmark" not in help_text
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--bench.lengths_from_label"])
    assert "unrecognized arguments: --bench.lengths_from_label" in capsys.readouterr().err


def test_help_quotes_no_benchmark_results(help_text):
    for flag, entry in _option_help(help_text).items():
        assert not re.search(r"RESULTS|H[12]00|\bGPU runs?\b|\d(\.\d+)?x\b", entry), entry


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--oppo.chunk_size", "32"], "given without --oppo.enable"),
        (["--oppo.enable", "--train.async_enable"], "--train.async_enable is not supported"),
        (["--oppo.enable", "--ds.ring_attn_size", "2", "--ds.packing_samples"], "--ds.ring_attn_size"),
        (["--oppo.enable", "--ds.lora.rank", "8"], "--ds.lora.rank"),
        (["--oppo.enable", "--train.colocate_all", "--vllm.enable_sleep", "--oppo.carry_kv", "keep"], "carry_kv"),
        (["--oppo.enable", "--oppo.overcommit_min", "5", "--oppo.overcommit_max", "2"], "overcommit_min"),
        (
            ["--oppo.enable", "--train.colocate_all", "--oppo.top_up", "step_end", "--oppo.colocated_decode", "pause"],
            "with --oppo.colocated_decode continue",
        ),
        (["--oppo.enable", "--oppo.colocated_decode", "continue"], "decode through training anyway: drop it"),
        (["--oppo.enable", "--oppo.colocated_decode", "pause"], "decode through training anyway: drop it"),
        (
            ["--oppo.enable", "--train.colocate_all", "--vllm.enable_sleep", "--oppo.colocated_decode", "continue"],
            "drop --vllm.enable_sleep",
        ),
        (
            ["--oppo.enable", "--train.colocate_all", "--oppo.overcommit", "0", "--oppo.colocated_decode", "continue"],
            "--oppo.max_lag 0 turns off",
        ),
        (["--oppo.enable", "--oppo.overcommit", "0", "--oppo.top_up", "step_end"], "needs inter-step overlap"),
        (["--oppo.enable", "--train.colocate_all", "--oppo.weight_sync", "paused"], "place vLLM apart, awake"),
        (["--oppo.enable", "--vllm.enable_sleep", "--oppo.weight_sync", "staged"], "sleep through the sync"),
        (
            [
                "--oppo.enable",
                "--ds.enable_sleep",
                "--oppo.critic_catch_up",
                "after_fit",
                "--oppo.state_moves",
                "serial",
            ],
            "add --oppo.state_moves",
        ),
        (
            [
                "--oppo.enable",
                "--ds.enable_sleep",
                "--oppo.critic_catch_up",
                "next_batch",
                "--oppo.state_moves",
                "serial",
            ],
            "add --oppo.state_moves",
        ),
        (["--oppo.enable", "--oppo.overcommit", "0", "--oppo.critic_catch_up", "after_fit"], "max_lag 0 turns off"),
        (["--oppo.enable", "--oppo.intra_step", "off", "--oppo.critic_catch_up", "after_fit"], "no critic streams"),
        (["--oppo.enable", "--oppo.policy_logprobs", "vllm", "--rollout.temperature", "0.7"], "given 0.7"),
        (["--oppo.enable", "--oppo.policy_logprobs", "vllm", "--vllm.enable_sleep"], "no --vllm.enable_sleep"),
        (["--oppo.enable", "--train.colocate_all", "--oppo.policy_logprobs", "vllm"], "the policy does not stream"),
        (
            ["--oppo.enable", "--oppo.intra_step", "off", "--oppo.policy_logprobs", "vllm"],
            "the policy does not stream",
        ),
        (["--oppo.enable", "--oppo.state_moves", "overlap"], "add --ds.enable_sleep or drop"),
        (
            ["--oppo.enable", "--ds.enable_sleep", "--oppo.state_moves", "overlap"]
            + ["--algo.advantage.estimator", "group_norm"],
            "group_norm trains no critic",
        ),
        (["--oppo.colocate_models", "--train.colocate_all"], "two different placements"),
        (["--oppo.colocate_models", "--ref.num_gpus_per_node", "1"], "--ref.num_nodes"),
        # Settings that would quietly undo what was asked for, with what to use instead.
        (["--oppo.enable", "--oppo.chunk_size", "512", "--rollout.max_new_tokens", "512"], "a chunk size below 512"),
        (["--oppo.enable", "--oppo.intra_step", "off", "--oppo.chunk_size", "16"], "which is off in this run"),
        (
            ["--oppo.enable", "--train.colocate_all", "--vllm.enable_sleep", "--oppo.cache_budget_gb", "2"],
            "auto under the hybrid engine",
        ),
        (
            ["--oppo.enable", "--train.colocate_all", "--oppo.intra_step", "on", "--reward.remote_url", "http://rm"]
            + ["--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0"],
            "no model of this run can stream",
        ),
        (["--oppo.enable", "--oppo.overcommit", "100000"], "Use at most 48"),  # max_defer_steps 3 x batch 16
        (["--oppo.enable", "--oppo.overcommit_max", "60"], "--oppo.overcommit_max 60 is above"),
        (["--oppo.enable", "--oppo.max_lag", "0", "--oppo.overcommit", "8"], "drop one of them"),
        (["--oppo.enable", "--oppo.max_lag", "2", "--oppo.max_defer_steps", "3"], "above --oppo.max_lag 2"),
        (["--oppo.enable", "--oppo.overcommit_max", "0"], "keeps Delta at 0"),
        (
            ["--oppo.enable", "--oppo.max_lag", "0", "--oppo.overcommit_min", "2"],
            "--oppo.overcommit_min tunes inter-step",
        ),
        (["--rollout.batch_size", "0"], "--rollout.batch_size 0: it counts prompts a step"),
        (["--oppo.enable", "--oppo.max_lag", "0", "--rollout.batch_size", "0"], "--rollout.batch_size 0: it counts"),
        (["--rollout.max_new_tokens", "0"], "--rollout.max_new_tokens 0: vLLM generates at least one token"),
        (["--train.batch_size", "32"], "--train.batch_size 32 is above the samples a step makes"),
        (["--rollout.max_new_tokens", "2048"], "leaves no room for a prompt in --data.max_len 2048"),
        (["--rollout.micro_batch_size", "16"], "makes 1 micro-batches of --rollout.micro_batch_size 16, fewer than"),
        (["--oppo.enable", "--oppo.overcommit", "8", "--data.max_samples", "20"], "use at most 4"),
        (["--oppo.enable", "--oppo.overcommit", "0", "--oppo.max_defer_steps", "3"], "--oppo.max_lag 0 turns off"),
        (["--oppo.enable", "--oppo.overcommit", "4", "--oppo.overcommit_window", "3"], "drop it, or use auto"),
        (["--oppo.enable", "--oppo.trace_dir", __file__], "is a file"),
        (["--oppo.enable", "--oppo.profile_step", "2"], "add --oppo.trace_dir"),
        (["--oppo.enable", "--oppo.chunk_size", "8", "--oppo.stream_interval", "16"], "of at most 8, or auto"),
        (["--oppo.enable", "--oppo.stream_interval", "32"], "of at most 16, or auto"),  # the smallest auto chunk
    ],
)
def test_bad_combinations_are_refused_with_what_to_do(extra, message):
    with pytest.raises(OPPOConfigError, match=message.replace(".", r"\.")) as refused:
        parse_args(BASE + extra)
    given = {word for word in BASE + extra if word.startswith("--")}
    named = set(re.findall(r"--[a-z_]+\.[a-z_.]+[a-z]", str(refused.value)))
    assert named & given, f"names no flag the user gave: {refused.value}"


def test_upstreams_default_training_batch_above_a_steps_samples_is_warned_of(capsys):
    """Left at upstream's default (128), a training batch larger than a step's 16 samples steps the optimizer
    once every 8 PPO steps: said, not refused, as the user did not ask for it."""
    args = parse_args(BASE[:-2])  # without its --train.batch_size
    assert args.train.batch_size == 128
    assert "upstream's default --train.batch_size 128 is above the samples a step makes" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, pauses, resumes",
    [
        ([], False, False),  # the engines have GPUs of their own
        (["--train.colocate_all", "--vllm.enable_sleep"], False, False),  # asleep through training
        (["--train.colocate_all"], True, True),  # auto: they decode beside training
        (["--train.colocate_all", "--oppo.colocated_decode", "pause"], True, False),
        (
            ["--train.colocate_all", "--oppo.colocated_decode", "during_training", "--oppo.top_up", "step_end"],
            True,
            True,
        ),
        (["--train.colocate_all", "--oppo.colocated_decode", "continue", "--oppo.top_up", "step_end"], False, False),
    ],
)
def test_colocated_engines_pause_carried_requests_in_training_unless_they_continue(flags, pauses, resumes):
    """Where the awake engines share the models' GPUs, the trainer has them pause their carried requests when the
    step's groups are done (``Plan.pauses_after_generation``) until the weight sync; with --oppo.colocated_decode
    during_training they decode again once the experiences are made, and with continue they never pause. Under
    either, the next step's prompts may start at the step's end too."""
    plan = resolve(parse_args(BASE + ["--oppo.enable", "--oppo.overcommit", "4"] + flags))
    assert plan.pauses_after_generation == pauses
    assert plan.resumes_for_training == resumes
    beside = plan.sync.colocate_all and plan.carry.colocated_decode != "pause"
    assert ("decoding beside training" in describe(plan)) == beside
    assert ("not beside making experiences" in describe(plan)) == resumes


@pytest.mark.parametrize(
    "flag, value",
    [
        ("chunk_size", "0"),
        ("chunk_size", "big"),
        ("overcommit", "-1"),
        ("cache_budget_gb", "nan"),
        ("cache_budget_gb", "inf"),
        ("cache_budget_gb", "-1"),
        ("max_defer_steps", "0"),
        ("max_lag", "-1"),
        ("overcommit_window", "1"),
        ("profile_step", "-1"),
        ("cache_budget_gb", "0"),
        ("max_lag", "1e9"),
    ],
)
def test_bad_values_are_refused_by_the_parser_in_one_line(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--oppo.enable", f"--oppo.{flag}", value])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"openrlhf-oppo: error: --oppo.{flag} ") and line.endswith("(see --help)"), line
    assert " a int" not in line and ">= 0.0" not in line


ORDER = """
import json, sys
from openrlhf.utils import get_strategy
from openrlhf_oppo.bench import driver
def order(*flags):
    args = driver.parse_args(sys.argv[1:] + list(flags))
    driver.install(args.bench)  # as the benchmark's driver does before the run
    loader = get_strategy(args).setup_dataloader(list(range(64)), 1, True, True, None)
    return [int(i) for i in loader]
# Upstream's first: --bench.seed_prompt_order swaps the strategy for the rest of the process.
print(json.dumps([order(), order(), order("--bench.seed_prompt_order", "--train.seed", "3"),
                  order("--bench.seed_prompt_order", "--train.seed", "4")]))
"""
# The driver's own ends, each its flags, exit code and what its last line says.
ENDS = {
    "parser": (["--oppo.cache_budget_gb", "nan"], 2, "--oppo.cache_budget_gb takes a finite number, got 'nan'"),
    "plan": (["--oppo.max_lag", "0", "--oppo.overcommit_min", "2"], 1, "--oppo.overcommit_min tunes inter-step"),
    "upstream": (["--algo.advantage.estimator", "group_norm"], 1, "group_norm requires n_samples_per_prompt > 1"),
}


@pytest.fixture(scope="module")
def fresh_processes():
    """The driver run with each of ENDS' flags, and ORDER in two processes, all side by side."""
    driver = [sys.executable, "-m", "openrlhf_oppo.cli.train_ppo_ray", *BASE, "--oppo.enable"]
    order = [sys.executable, "-c", ORDER, *BASE]
    commands = [driver + flags for flags, _, _ in ENDS.values()] + [order, order]
    *ends, first, second = run_together(commands, timeout=300)
    return dict(zip(ENDS, ends), orders=[first, second])


@pytest.mark.process
@pytest.mark.parametrize("end", ENDS)
def test_the_cli_ends_with_one_line_before_ray_starts(end, fresh_processes):
    """The driver itself: what it prints is its own, a parser error in one line, the last line says what is wrong,
    with no traceback, and Ray never starts. The libraries' start-up notices are in the log, not on the console."""
    _, code, message = ENDS[end]
    done = fresh_processes[end]
    assert done.returncode == code
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert all(line.startswith(("openrlhf-oppo: ", "[openrlhf-oppo] ")) for line in lines), lines
    assert len(lines) <= 4 and message in lines[-1]
    assert "Traceback" not in done.stderr and "ray" not in done.stdout.lower()


@pytest.mark.process
def test_seed_prompt_order_fixes_the_order_upstream_leaves_to_chance(fresh_processes):
    """The order in which a fresh trainer process draws 64 prompts: upstream's, twice in each of two processes
    (a new process, a new default generator), then seeded with --train.seed 3 and 4."""
    orders = []
    for done in fresh_processes["orders"]:
        assert done.returncode == 0, done.stderr[-3000:]
        orders.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (unseeded, _, seed3, seed4), (other_unseeded, _, other_seed3, _) = orders
    assert seed3 == other_seed3 != list(range(64))  # the same in every process
    assert seed4 != seed3
    assert unseeded != other_unseeded  # upstream: another order in every process


@pytest.mark.parametrize(
    "extra, streamed",
    [
        ([], ["policy", "critic", "reward", "reference"]),
        (["--ds.zero_stage", "3"], ["policy", "critic", "reward", "reference"]),  # on full copies (zero3.py)
        (["--train.colocate_all", "--vllm.enable_sleep"], []),  # auto: off under the hybrid engine
        (["--train.colocate_all"], ["critic", "reward", "reference"]),  # auto: on beside awake engines
        (["--train.colocate_all", "--oppo.intra_step", "on"], ["critic", "reward", "reference"]),
        (["--reward.remote_url", "http://localhost:1/rm"], ["policy", "critic", "reference"]),
        (["--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0"], ["policy", "reward"]),
        (["--oppo.intra_step", "off"], []),
    ],
)
def test_which_roles_stream(extra, streamed):
    assert list(resolve(parse_args(BASE + ["--oppo.enable"] + extra)).stream.roles) == streamed


@pytest.mark.parametrize(
    "extra, interval", [([], 16), (["--oppo.chunk_size", "8"], 8), (["--oppo.stream_interval", "1"], 1)]
)
def test_the_stream_interval_never_exceeds_the_smallest_chunk(extra, interval):
    assert resolve(parse_args(BASE + ["--oppo.enable"] + extra)).stream.interval == interval


def test_overcommit_defaults_follow_the_batch_size_and_the_lag_bound():
    plan = resolve(parse_args(BASE + ["--oppo.enable"]))
    assert plan.inter_step and plan.carry.overcommit.auto and plan.carry.max_lag == 3
    assert (plan.carry.overcommit.initial, plan.carry.overcommit.maximum, plan.carry.max_defer_steps) == (
        16,
        32,
        3,
    )  # B, 2B for B=16
    assert not resolve(parse_args(BASE + ["--oppo.enable", "--oppo.overcommit", "0"])).inter_step
    assert not resolve(parse_args(BASE + ["--oppo.enable", "--oppo.max_lag", "0"])).inter_step


def test_colocate_models_without_oppo_marks_models_colocated():
    args = parse_args(BASE + ["--oppo.colocate_models"])
    assert args.oppo.colocate_models and not args.oppo.enable
    assert args.train.colocate_actor_ref and args.train.colocate_critic_reward


SPLIT_2GPU = [
    "--actor.model_name_or_path", "m",
    "--reward.model_name_or_path", "m",
    "--actor.num_gpus_per_node", "1",
    "--critic.num_gpus_per_node", "1",
    "--reward.num_gpus_per_node", "1",
    "--ref.num_gpus_per_node", "1",
    "--vllm.num_engines", "1",
    "--oppo.colocate_models",
    "--oppo.enable",
]  # fmt: skip


@pytest.mark.parametrize("correction", ["off", "token"])
def test_the_importance_correction_warns_of_the_first_tokens_log_prob(correction, capsys):
    """OpenRLHF as published samples with min_tokens=1 and has no flag for it: the warning names the patch."""
    parse_args(BASE + ["--algo.advantage.is_correction_level", correction])
    out = capsys.readouterr().out
    assert ("the correction is biased there" in out) == (correction != "off")
    assert ("(patches/openrlhf/0015 removes it)" in out) == (correction != "off")


@pytest.mark.parametrize(
    "extra, placed",
    [
        (["--vllm.gpu_memory_utilization", "0.75"], "generation"),
        ([], "models"),  # upstream's default 0.95 leaves no room beside the engine
        (["--vllm.gpu_memory_utilization", "0.75", "--oppo.frozen_scorers_on", "models"], "models"),
        (["--vllm.gpu_memory_utilization", "0.75", "--oppo.intra_step", "off"], "models"),  # nothing to stream
    ],
)
def test_frozen_scorers_go_beside_vllm_where_they_fit(extra, placed, capsys):
    args = parse_args(SPLIT_2GPU + extra)
    assert resolve(args).stream.frozen_scorers_on == placed
    assert args.train.frozen_models_with_vllm == (placed == "generation")
    # Only 'auto' finding no room beside vLLM explains itself, with what would make room.
    note = "--vllm.gpu_memory_utilization 0.95 leaves them no room beside vLLM (at most 0.8 would)"
    assert (note in capsys.readouterr().out) == (extra == [])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--oppo.frozen_scorers_on", "generation"], "gpu_memory_utilization 0.95"),
        (
            ["--oppo.frozen_scorers_on", "generation", "--vllm.gpu_memory_utilization", "0.7",
             "--reward.num_gpus_per_node", "2"],
            "one reward rank on each vLLM GPU",
        ),
    ],
)  # fmt: skip
def test_frozen_scorers_beside_vllm_refuses_what_cannot_work(extra, message):
    with pytest.raises(OPPOConfigError, match=message):
        parse_args(SPLIT_2GPU + extra)


def test_frozen_scorers_beside_vllm_need_the_split_placement():
    argv = [a for a in SPLIT_2GPU if a != "--oppo.colocate_models"]
    with pytest.raises(OPPOConfigError, match="add --oppo.colocate_models"):
        parse_args(argv + ["--oppo.frozen_scorers_on", "generation", "--vllm.gpu_memory_utilization", "0.7"])


def test_policy_logprobs_from_vllm_leave_the_policy_streamed_and_say_so(capsys):
    """``--oppo.policy_logprobs vllm``: the policy is still a streamed role (its scores come with the stream), the
    trainer's coordinator puts the engines where its ranks would be (``OPPOTrainer.__init__``), and the log says
    so before Ray starts."""
    plan = resolve(parse_args(BASE + ["--oppo.enable", "--oppo.policy_logprobs", "vllm"]))
    assert plan.stream.policy_logprobs == "vllm" and "policy" in plan.stream.roles
    assert "the policy's log-probs from vLLM" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, catch_up",
    [
        ([], "next_batch"),  # the plan takes the policy's log-probs from vLLM here
        (["--oppo.policy_logprobs", "policy"], "next_step"),
        (["--oppo.policy_logprobs", "vllm", "--oppo.critic_catch_up", "next_step"], "next_step"),
        (["--oppo.policy_logprobs", "vllm", "--oppo.overcommit", "0"], "next_step"),
        (["--oppo.critic_catch_up", "after_fit"], "after_fit"),
    ],
)
def test_critic_catch_up_auto_catches_up_after_the_fit_where_the_engines_score_the_policy(extra, catch_up, capsys):
    """'auto' picks next_batch (after_fit, of the next batch only) only where the critic's catch-up is the one
    prefill left after the weight sync."""
    assert resolve(parse_args(BASE + ["--oppo.enable"] + extra)).stream.critic_catch_up == catch_up
    out = capsys.readouterr().out
    assert ("the critic's catch-up after its fit" in out) == (catch_up == "after_fit")
    assert ("the critic's catch-up of the next batch after its fit" in out) == (catch_up == "next_batch")


@pytest.mark.parametrize("utilization", ["0.75", "0.95"])
def test_frozen_scorers_with_the_engines_rank_count_go_beside_vllm_or_are_refused(utilization):
    """Three trained ranks and one engine with one reward and one reference rank (the benchmark's ``--model_gpus
    3`` of 4): 'auto' puts them beside the engine where vLLM leaves room; where it does not, they would stay on
    the models' GPUs with fewer ranks than the actor, which the placement cannot do."""
    argv = SPLIT_2GPU + ["--actor.num_gpus_per_node", "3", "--critic.num_gpus_per_node", "3"]
    argv += ["--vllm.gpu_memory_utilization", utilization]
    if utilization == "0.95":
        with pytest.raises(OPPOConfigError, match=r"--reward.num_gpus_per_node to the actor's \(1 and 3\)"):
            parse_args(argv)
        return
    args = parse_args(argv)
    assert resolve(args).stream.frozen_scorers_on == "generation" and args.train.frozen_models_with_vllm
    assert args.reward.num_gpus_per_node == args.ref.num_gpus_per_node == 1
