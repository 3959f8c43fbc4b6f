"""Every system the benchmarks compare is a valid train_ppo_ray command (upstream's parser and OPPO's checks),
and the benchmark refuses workloads it would clip."""

import math
import sys

import pytest
import torch
from transformers import get_scheduler

from openrlhf_oppo import preflight
from openrlhf_oppo.bench import addition, learning
from openrlhf_oppo.bench.driver import parse_args
from openrlhf_oppo.bench.learning import LEARNING_SYSTEMS
from openrlhf_oppo.bench.systems import (
    AWAKE,
    COLOCATED_ONLY,
    FLAG_SWAP,
    INTER_ONLY,
    KEEP_KV,
    SPLIT_ONLY,
    SYSTEMS,
    common_flags,
    system_flags,
)
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.plan import resolve


@pytest.mark.parametrize("placement,gpus", [("split", 2), ("split", 4), ("colocated", 1)])
@pytest.mark.parametrize("system", SYSTEMS)
def test_benchmark_system_is_a_valid_command(system, placement, gpus, bench_workdir):
    if system in SPLIT_ONLY and placement == "colocated":
        with pytest.raises(ValueError, match="GPUs of its own"):
            system_flags(system, placement, 16)
        return
    if system in COLOCATED_ONLY and placement == "split":
        with pytest.raises(ValueError, match="use --placement colocated"):
            system_flags(system, placement, 16)
        return
    flags = common_flags(bench_workdir, f"{bench_workdir}/out", system, placement, gpus, 32, 1, 5, 4096, 64, 0, 2.0)
    if system == "oppo-keep" and placement == "colocated":
        # Kept KV needs vLLM awake: the hybrid engine's flags swapped, with no GPU to plan against, keep it asleep.
        with pytest.raises(OPPOConfigError, match="--oppo.carry_kv keep needs the KV cache to survive"):
            parse_args(flags + system_flags(system, placement, 16))
        args = parse_args(flags + system_flags(system, placement, 16) + ["--oppo.gpu_memory_gb", "80"])
        assert resolve(args).carry.kv == "keep" and not args.vllm.enable_sleep  # an 80 GB GPU: the plan wakes it
        return
    args = parse_args(flags + system_flags(system, placement, 16))
    assert args.bench.lengths_from_label and args.bench.seed_prompt_order
    assert args.oppo.enable == system.startswith("oppo")
    assert args.train.async_enable == (system == "upstream-async")
    assert args.oppo.colocate_models == (placement == "split" and system != "upstream-async")
    if system in FLAG_SWAP:  # the flag swap: OpenRLHF's flags and --oppo.enable (and the user's carry_kv)
        assert [flag for flag in flags + system_flags(system, placement, 16) if flag.startswith("--oppo.")] == [
            "--oppo.enable"
        ] + (["--oppo.colocate_models"] if placement == "split" else []) + (
            ["--oppo.carry_kv"] if system == "oppo-keep" else []
        )
    if system.startswith("oppo"):
        plan = resolve(args)
        assert plan.inter_step == (system != "oppo-intra")
        assert plan.carry.top_up == ("step_end" if system in ("oppo-both-early",) + AWAKE else "step_start")
        assert args.vllm.enable_sleep == (placement == "colocated" and system not in AWAKE)
        assert plan.carry.colocated_decode == ("during_training" if system in AWAKE else "pause")
        # Under the hybrid engine, with no GPU to plan its memory against, the plan keeps vLLM asleep: no streaming.
        hybrid_default = system in FLAG_SWAP and placement == "colocated"
        assert bool(plan.stream.roles) == (system not in INTER_ONLY and not hybrid_default)
        # The frozen models go beside vLLM wherever they stream in the split placement.
        beside_vllm = placement == "split" and system not in ("oppo-inter", "oppo-both-frozen-with-models")
        assert plan.stream.frozen_scorers_on == ("generation" if beside_vllm else "models")
        assert plan.carry.kv == ("keep" if system in KEEP_KV else "recompute")
    if placement == "split":
        assert args.vllm.num_engines == gpus // 2 and args.actor.num_gpus_per_node == gpus // 2
    # The run asks Ray for the benchmark's GPUs, no more (a CPU for each and one for the trainer), none fewer.
    preflight.check_resources(args, {"GPU": gpus, "CPU": gpus + 1}, "the machine")
    with pytest.raises(OPPOConfigError, match=f"The placement needs {gpus} GPU"):
        preflight.check_resources(args, {"GPU": gpus - 1, "CPU": 64}, "the machine")


def test_the_driver_hands_the_cli_every_flag_but_its_own_and_sets_up_the_workload(monkeypatch, bench_workdir):
    """What the benchmark's driver does before the user CLI starts a run: the CLI gets the other flags in their
    order, the rollout actors the fixed-length hook, upstream's strategy the seeded prompt order."""
    from openrlhf.utils import deepspeed

    from openrlhf_oppo import extension
    from openrlhf_oppo.bench import driver
    from openrlhf_oppo.bench.fixed_lengths import fixed_length_params

    monkeypatch.setattr(deepspeed, "DeepspeedStrategy", deepspeed.DeepspeedStrategy)
    monkeypatch.setattr(extension, "_sampling_params_hook", None)
    flags = common_flags(bench_workdir, f"{bench_workdir}/out", "oppo-both", "split", 2, 32, 1, 5, 4096, 64, 0, 2.0)
    flags += system_flags("oppo-both", "split", 16)
    workload, rest = driver.split(flags)
    assert vars(workload) == dict(lengths_from_label=True, seed_prompt_order=True, kv_cache_gb=None)
    assert rest == [flag for flag in flags if not flag.startswith("--bench.")] and len(rest) == len(flags) - 2
    assert vars(driver.split(rest)[0]) == dict(lengths_from_label=False, seed_prompt_order=False, kv_cache_gb=None)
    # A valued option leaves with its value; the engines' KV cache then has that size.
    sized, same = driver.split(rest[:2] + ["--bench.kv_cache_gb", "1.5"] + rest[2:])
    assert sized.kv_cache_gb == 1.5 and same == rest
    monkeypatch.setattr(extension, "_engine_kwargs", {})
    driver.install(sized)
    assert extension._engine_kwargs == dict(kv_cache_memory_bytes=int(1.5 * 2**30))
    driver.install(workload)
    assert extension._sampling_params_hook is fixed_length_params
    assert deepspeed.DeepspeedStrategy.__name__ == "SeededOrderStrategy"


def test_the_drivers_help_shows_its_own_flags_then_the_clis(monkeypatch, capsys):
    from openrlhf.trainer import ppo_trainer

    from openrlhf_oppo.bench import driver

    monkeypatch.setattr(ppo_trainer, "PPOTrainer", ppo_trainer.PPOTrainer)  # the CLI swaps upstream's trainer
    monkeypatch.setattr(sys, "argv", ["driver", "--help"])
    with pytest.raises(SystemExit):
        driver.main()
    shown = capsys.readouterr().out
    assert shown.index("--bench.lengths_from_label") < shown.index("--bench.seed_prompt_order")
    assert shown.index("--bench.seed_prompt_order") < shown.index("--oppo.enable")


@pytest.mark.parametrize("system", ["upstream-sync", "oppo-both", "oppo-both-awake", "oppo-inter-awake"])
def test_colocated_models_keep_their_states_on_the_gpu_without_ds_sleep(system, monkeypatch, bench_workdir):
    """``--ds_sleep off``: every colocated system runs without --ds.enable_sleep, and only that changes."""
    from openrlhf_oppo.bench.__main__ import parse, system_command

    commands = {}
    for ds_sleep in ("on", "off"):
        monkeypatch.setattr(sys, "argv", ["bench", "--out", "/o", "--systems", system, "--ds_sleep", ds_sleep])
        args = parse()
        args.scratch = f"{bench_workdir}/out"
        commands[ds_sleep] = system_command(args, system, bench_workdir, 16)
    assert [flag for flag in commands["on"] if flag not in commands["off"]] == ["--ds.enable_sleep"]
    args = parse_args(commands["off"])
    assert args.train.colocate_all and not args.ds.enable_sleep
    assert args.vllm.enable_sleep == (system not in AWAKE)


def test_four_gpu_split_under_zero3_streams_every_role(bench_workdir):
    """examples/scripts/bench_4gpu_split.sh with ZERO=3 OFFLOAD=1 ROLLOUT_MB=32 TRAIN_MB=8: two engines, two ranks
    a model, ZeRO-3, Adam states in host memory, OpenRLHF's recipe micro-batches, and vLLM's smaller share of its
    GPUs leaves the frozen models room beside it."""
    flags = common_flags(
        bench_workdir, f"{bench_workdir}/out", "oppo-both", "split", 4, 64, 1, 5, 4096, 64, 0, 4.0, 32, 8
    )
    extra = ["--ds.zero_stage", "3", "--ds.adam_offload", "--vllm.gpu_memory_utilization", "0.6"]
    args = parse_args(flags + system_flags("oppo-both", "split", 32) + extra)
    assert args.ds.zero_stage == 3 and args.ds.adam_offload and args.vllm.gpu_memory_utilization == 0.6
    assert args.rollout.micro_batch_size == 32 and args.train.micro_batch_size == 8
    plan = resolve(args)
    assert plan.stream.roles == ("policy", "critic", "reward", "reference")
    assert plan.stream.frozen_scorers_on == "generation" and args.reward.num_gpus_per_node == 2


@pytest.mark.parametrize("system", ["upstream-sync", "upstream-async", "oppo-both", "oppo-inter"])
def test_models_on_three_gpus_and_vllm_on_one(system, bench_workdir):
    """``--model_gpus 3`` of 4: one engine, three ranks for the policy and critic; the OPPO systems whose frozen
    models stream put one reward and one reference rank beside the engine, the others keep three with the models
    (upstream's own checks of its placements included: the patched upstream repeats them)."""
    flags = common_flags(
        bench_workdir, f"{bench_workdir}/out", system, "split", 4, 32, 1, 5, 4096, 64, 0, 4.0, 8, 2, 3
    )
    args = parse_args(flags + system_flags(system, "split", 32) + ["--ds.zero_stage", "3"])
    assert args.vllm.num_engines == 1 and args.actor.num_gpus_per_node == args.critic.num_gpus_per_node == 3
    beside_vllm = system == "oppo-both"
    assert args.reward.num_gpus_per_node == args.ref.num_gpus_per_node == (1 if beside_vllm else 3)
    if system.startswith("oppo"):
        assert resolve(args).stream.frozen_scorers_on == ("generation" if beside_vllm else "models")


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--gpus", "4", "--placement", "split", "--model_gpus", "4"], "1 to 3 of the --gpus 4"),
        (["--gpus", "4", "--placement", "split", "--model_gpus", "0"], "1 to 3 of the --gpus 4"),
        (["--gpus", "1", "--placement", "colocated", "--model_gpus", "1"], "is for --placement split"),
        (["--gpus", "1", "--placement", "split"], "needs --gpus 2 or more"),
        (["--gpus", "2", "--placement", "split", "--ds_sleep", "off"], "--ds_sleep is for --placement colocated"),
    ],
)
def test_benchmark_refuses_a_split_it_cannot_place(argv, error, monkeypatch, capsys):
    from openrlhf_oppo.bench.__main__ import parse

    monkeypatch.setattr(sys, "argv", ["bench", "--out", "/o"] + argv)
    with pytest.raises(SystemExit):
        parse()
    assert error in capsys.readouterr().err


def test_oppo_extra_reaches_the_oppo_systems_only(monkeypatch, bench_workdir):
    """``--oppo_extra`` flags go to the OPPO systems after their own (``--extra`` to all): Delta under the
    throughput rule up to the batch, here."""
    from openrlhf_oppo.bench.__main__ import parse, system_command

    oppo_extra = ["--oppo.overcommit", "auto", "--oppo.overcommit_rule", "throughput", "--oppo.overcommit_max", "64"]
    argv = ["bench", "--gpus", "4", "--placement", "split", "--batch", "64", "--steps", "5", "--out", "/o"]
    argv += ["--extra=--train.micro_batch_size", "--extra=4"] + [f"--oppo_extra={flag}" for flag in oppo_extra]
    monkeypatch.setattr(sys, "argv", argv)
    args = parse()
    args.scratch = f"{bench_workdir}/out"
    oppo = parse_args(system_command(args, "oppo-both", bench_workdir, 16))
    assert oppo.oppo.overcommit == "auto" and oppo.oppo.overcommit_rule == "throughput"
    assert oppo.oppo.overcommit_max == 64 and oppo.train.micro_batch_size == 4
    upstream = system_command(args, "upstream-sync", bench_workdir, 16)
    assert not set(oppo_extra[::2]) & set(upstream) and parse_args(upstream).train.micro_batch_size == 4


@pytest.mark.parametrize(
    "placement, system", [(placement, system) for placement, systems in LEARNING_SYSTEMS.items() for system in systems]
)
def test_learning_benchmark_run_is_a_valid_command(placement, system, bench_workdir):
    """Every run of the learning benchmark: the task's prompts and rule reward, responses ending where the model
    ends them, advantages from the group of samples (no critic), the system's own flags."""
    gpus = "1" if placement == "colocated" else "2"
    options = learning.parse(["--task", "addition", "--out", "/o", "--placement", placement, "--gpus", gpus])
    assert system in options.systems.split(",")  # the placement's default systems
    flags = learning.run_flags(bench_workdir, f"{bench_workdir}/out", f"{system}-seed1", system, 1, options)
    args = parse_args(flags)
    assert args.reward.remote_url == [addition.__file__] and args.data.label_key == "answer"
    assert not args.bench.lengths_from_label and args.bench.seed_prompt_order and args.train.seed == 1
    assert args.critic.model_name_or_path is None  # group_norm: no critic
    assert args.logger.wandb.run_name == f"{system}-seed1"
    assert args.rollout.max_new_tokens == 2 * (10 * options.digits_high + 2)  # twice the longest right response
    assert args.train.async_enable == (system == "upstream-async")
    # Every system weighs samples by pi_train/pi_rollout (clipped), which needs vLLM's log-probs.
    assert (args.algo.advantage.is_correction_level, args.algo.advantage.is_correction_mode) == ("token", "clip")
    assert args.train.micro_batch_size == args.train.batch_size == 64  # one micro-batch per policy update
    assert not args.actor.gradient_checkpointing_enable  # the small model: recomputing would only slow training
    assert args.actor.lr_scheduler == "constant_with_warmup"
    if system.startswith("oppo"):
        # No reward model, no critic; colocated, the policy's log-probs wait for the step (streaming auto). The flag
        # swap of the hybrid engine, with no GPU to plan against, keeps vLLM asleep and streams nothing.
        plan = resolve(args)
        streamed = ("policy", "reference") if placement == "split" else ("reference",)
        assert plan.stream.roles == (() if system in FLAG_SWAP and placement == "colocated" else streamed)
        assert plan.carry.kv == ("keep" if system in KEEP_KV else "recompute")


@pytest.mark.parametrize(
    "placement, system, message",
    [
        ("colocated", "upstream-async", "GPUs of its own"),
        ("split", "oppo-both-awake-keep", "use --placement colocated"),
    ],
)
def test_learning_benchmark_refuses_a_system_its_placement_cannot_run(placement, system, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        learning.parse(["--task", "addition", "--out", "/o", "--placement", placement, "--systems", system])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_learning_benchmarks_schedule_keeps_the_learning_rate_after_its_warm_up(bench_workdir):
    """What OpenRLHF's strategy builds from --actor.lr_scheduler for a learning run: transformers' scheduler of that
    name, with the run's --actor.lr_warmup_ratio (OpenRLHF's default) and no min_lr_rate (which only its cosine
    schedules take). After the warm-up the rate stays at the run's."""
    options = learning.parse(["--task", "addition", "--out", "/o"])
    args = parse_args(
        learning.run_flags(bench_workdir, f"{bench_workdir}/out", "oppo-both-seed0", "oppo-both", 0, options)
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.actor.adam.lr)
    steps = options.steps * options.updates
    warmup = math.ceil(steps * args.actor.lr_warmup_ratio)  # as DeepspeedStrategy builds it
    schedule = get_scheduler(args.actor.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert 0 < warmup < steps and rates[0] == 0 and rates[warmup:] == [options.lr] * (steps - warmup)


@pytest.mark.parametrize("system", ["upstream-sync", "upstream-async", "oppo-both"])
def test_group_norm_benchmark_drops_the_critic(system, bench_workdir):
    """examples/scripts/bench_2gpu_split_group_norm.sh: 4 samples a prompt, group advantages; no critic is
    trained or streamed, and the last --algo.advantage.estimator (the script's --extra) wins."""
    flags = common_flags(bench_workdir, f"{bench_workdir}/out", system, "split", 2, 16, 4, 7, 4096, 64, 0, 2.0)
    args = parse_args(flags + system_flags(system, "split", 8) + ["--algo.advantage.estimator", "group_norm"])
    assert args.algo.advantage.estimator == "group_norm" and args.critic.model_name_or_path is None
    assert args.rollout.n_samples_per_prompt == 4 and args.train.batch_size == 64
    assert args.actor.gradient_checkpointing_enable  # the speed benchmark's shapes train with it
    if system == "oppo-both":
        assert resolve(args).stream.roles == ("policy", "reward", "reference") and args.oppo.overcommit == 8


def test_bimodal_workload_takes_its_two_lengths_and_their_share():
    from openrlhf_oppo.tiny import response_lengths

    lengths = response_lengths(4000, "bimodal", seed=3, short=256, long=6144, long_fraction=0.05, high=6144)
    assert set(lengths) == {256, 6144}
    assert 0.04 < lengths.count(6144) / len(lengths) < 0.06


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--long", "8192"], "--long 8192 is outside [--low 16, --high 4096]"),
        (["--long_fraction", "1.5"], "--long_fraction 1.5 must be between 0 and 1"),
        (["--short", "8"], "--short 8 is outside"),
    ],
)
def test_benchmark_refuses_a_bimodal_workload_it_would_clip(flags, message, monkeypatch, capsys):
    from openrlhf_oppo.bench.__main__ import parse

    monkeypatch.setattr(sys, "argv", ["bench", "--out", "x", "--lengths", "bimodal", *flags])
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_benchmark_takes_a_bimodal_workload_within_its_bounds(monkeypatch):
    from openrlhf_oppo.bench.__main__ import parse
    from openrlhf_oppo.bench.workload import length_params

    argv = ["bench", "--out", "x", "--lengths", "bimodal", "--short", "256", "--long", "6144", "--high", "6144"]
    monkeypatch.setattr(sys, "argv", argv + ["--long_fraction", "0.05"])
    params = length_params(parse())
    assert (params["short"], params["long"], params["long_fraction"], params["high"]) == (256, 6144, 0.05, 6144)


def test_oppo_tag_names_the_oppo_systems_only(monkeypatch):
    """--oppo_extra changes the OPPO systems only, so its --oppo_tag must not rename the upstream baseline run
    beside them; --tag (a seed, say) names every system."""
    from openrlhf_oppo.bench.__main__ import parse, result_name

    argv = ["bench", "--out", "x", "--systems", "upstream-sync,oppo-both", "--tag=-seed1", "--oppo_tag=-vllm-0.15"]
    monkeypatch.setattr(sys, "argv", argv + ["--oppo_extra=--vllm.gpu_memory_utilization", "--oppo_extra=0.15"])
    args = parse()
    names = [result_name(args, system) for system in args.systems.split(",")]
    assert names == ["upstream-sync-seed1", "oppo-both-seed1-vllm-0.15"]


@pytest.mark.process
def test_a_system_run_again_reads_its_own_steps_only(tmp_path, monkeypatch):
    """Two runs of one system in one scratch folder (two --tag variants) log to the same tensorboard folder;
    the second run's steps must not take the first one's keys."""
    from argparse import Namespace

    from torch.utils.tensorboard import SummaryWriter

    from openrlhf_oppo.bench import __main__ as harness

    # The run stops at its parser and starts no Ray; the harness's `ray stop` would end the tests' Ray cluster.
    monkeypatch.setattr(harness, "_stop", lambda process: process.wait(timeout=120))
    run_system = harness.run_system
    with SummaryWriter(str(tmp_path / "tb" / "oppo-both" / "earlier")) as writer:
        writer.add_scalar("train/oppo/state_moves_wait_s", 1.5, 1)
    args = Namespace(scratch=str(tmp_path), warmup=0, steps=1, timeout=120)
    result = run_system("oppo-both", ["--no.such_flag"], args)  # the second run stops at its parser
    assert result["returncode"] != 0 and "no.such_flag" in result["log_tail"] and not result["stopped_by_harness"]
    assert result["steps"] == [] and result["summary"] == {}


@pytest.mark.process
def test_a_run_with_a_kv_cache_of_its_own_size_starts_beside_other_runs_without_waiting(tmp_path, monkeypatch, capsys):
    """A run that waits for a busy GPU waits and warns (vLLM sizes its KV cache from the memory free); one whose
    engines get a KV cache of a given size (``--bench.kv_cache_gb``, runs side by side) starts at once, and both
    record the memory in use at their start."""
    from argparse import Namespace

    from openrlhf_oppo.bench import __main__ as harness

    waits = []

    def busy_gpu(wait_s):  # NVML's reading of a GPU that another run holds
        waits.append(wait_s)
        return [(0, 40.0)]

    monkeypatch.setattr(harness, "wait_for_free_gpus", busy_gpu)
    monkeypatch.setattr(harness, "_stop", lambda process: process.wait(timeout=120))
    args = Namespace(scratch=str(tmp_path), warmup=0, steps=1, timeout=120)
    for flags, wait_s, warned in (
        (["--no.such_flag"], 30, True),
        (["--bench.kv_cache_gb", "2", "--no.such_flag"], 0, False),
    ):
        result = harness.run_system("upstream-sync", flags, args)  # stops at its parser
        assert waits.pop() == wait_s and result["gpu_gib_in_use_at_start"] == [(0, 40.0)]
        assert ("GPU 0 with 40.0 GiB in use" in capsys.readouterr().out) == warned


@pytest.mark.parametrize(
    "placement, systems, message",
    [
        ("colocated", "upstream-sync,upstream-async", "upstream-async needs GPUs of its own"),
        ("split", "oppo-both-awake", "use --placement colocated"),
        ("split", "oppo-inter-awake", "use --placement colocated"),
    ],
)
def test_benchmark_refuses_a_system_its_placement_cannot_run_before_any_runs(
    placement, systems, message, monkeypatch, capsys
):
    from openrlhf_oppo.bench.__main__ import parse

    gpus = "2" if placement == "split" else "1"
    argv = ["bench", "--out", "x", "--placement", placement, "--gpus", gpus, "--systems", systems]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_benchmark_runs_by_default_every_system_its_placement_can(placement, monkeypatch):
    from openrlhf_oppo.bench.__main__ import parse

    gpus = "2" if placement == "split" else "1"
    monkeypatch.setattr(sys, "argv", ["bench", "--out", "x", "--placement", placement, "--gpus", gpus])
    systems = parse().systems.split(",")
    other_only = SPLIT_ONLY if placement == "colocated" else COLOCATED_ONLY
    assert systems == [s for s in SYSTEMS if s not in other_only] and "oppo-both" in systems


def test_learning_benchmark_updates_a_step(bench_workdir):
    """--updates sets the policy updates a step (each one micro-batch); a count that does not divide the step's
    samples is refused before anything runs."""
    options = learning.parse(["--task", "addition", "--out", "/o", "--updates", "2"])
    args = parse_args(
        learning.run_flags(bench_workdir, f"{bench_workdir}/out", "oppo-both-seed0", "oppo-both", 0, options)
    )
    assert args.train.micro_batch_size == args.train.batch_size == 128
    with pytest.raises(SystemExit):
        learning.parse(["--task", "addition", "--out", "/o", "--updates", "3"])
