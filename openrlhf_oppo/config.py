"""The ``--oppo.*`` options and the checks of a combination of them.

Every option is defined here with the sentence ``--help`` shows: ``OPTIONS`` are the ones a user sets, ``ADVANCED``
the mechanism switches whose ``auto`` the plan decides (``plan.resolve``). The checks run on the plan's working
copy of the parsed namespace before any Ray actor or GPU is touched; each raises ``OPPOConfigError`` with what is
wrong and what to use instead.
"""

import argparse
import math
import os

from openrlhf_oppo import topology
from openrlhf_oppo.streaming.chunking import CANDIDATES as CHUNK_CANDIDATES

# The policy reaches the engines in buckets of this many MB; patches/openrlhf/0007's --vllm.sync_bucket_mb
# (same default) sets it where the patch is applied.
SYNC_BUCKET_MB = 512


class OPPOConfigError(ValueError):
    """A configuration OPPO cannot run; the message says what to use instead."""


def _int_or_auto(name, minimum):
    def parse(value):
        if value == "auto":
            return value
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes an integer or 'auto', got {value!r}")
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum} or 'auto', got {number}")
        return number

    parse.metavar = "N|auto"  # what --help shows for the value
    return parse


def _bounded(kind, name, minimum, above=False):
    """A number of ``kind`` at least ``minimum`` (``above``: more than it)."""
    what = "an integer" if kind is int else "a number"

    def parse(value):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes {what}, got {value!r}")
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{name} takes a finite number, got {value!r}")
        if number < minimum or above and number == minimum:
            raise argparse.ArgumentTypeError(f"{name} must be {'>' if above else '>='} {minimum:g}, got {value}")
        return number

    parse.metavar = "N" if kind is int else "X"
    return parse


# name: (argparse kwargs, default). Defaults are applied by the plan (plan.resolve) so that an option given can be
# told apart from one left alone: a given option always wins over the plan's choice.
# The options a user sets: everything else is the plan's (ADVANCED below, for experiments and the benchmark).
OPTIONS = {
    "max_lag": (
        dict(
            type=_bounded(int, "--oppo.max_lag", 0),
            help="The most weight versions a trained sample may be behind the policy that trains on it (PipelineRL's "
            "max_lag, verl's staleness_threshold). Inter-step overlap keeps B + Delta prompt groups in flight and "
            "carries the unfinished ones into the next step; Delta, the deferral limit and the top-up follow from "
            "this bound, which every trained sample keeps. 0 turns inter-step overlap off. Logged as "
            "oppo/policy_lag_max and oppo/policy_lag_mean.",
        ),
        3,
    ),
    "intra_step": (
        dict(
            choices=["auto", "on", "off"],
            help="Intra-step overlap: the reward, critic and reference models (and the policy, where its GPUs are "
            "idle during generation) prefill each response chunk while vLLM decodes, so that only the last chunk "
            "is left when a response ends. 'auto': on, except where vLLM sleeps on the models' GPUs (the hybrid "
            "engine) and the memory plan keeps it asleep.",
        ),
        "auto",
    ),
    "carry_kv": (
        dict(
            choices=["recompute", "keep"],
            help="What carried requests do at a weight update: 'recompute' prefills prompt and partial response "
            "again with the new weights; 'keep' keeps the KV cache of the old weights (cheaper, more off-policy).",
        ),
        "recompute",
    ),
    "cache_budget_gb": (
        dict(
            type=_bounded(float, "--oppo.cache_budget_gb", 0.0, above=True),
            metavar="GIB",
            help="KV cache each scoring model may hold for streamed sequences, in GiB; past it, the newest lose "
            "their cache and are scored in full when they end (--oppo.intra_step off streams nothing). Default: 4, "
            "or less where the memory plan needs the room.",
        ),
        None,
    ),
    "colocate_models": (
        dict(
            action="store_true",
            help="Place the models on the actor's GPUs and the vLLM engines on GPUs of their own (upstream needs "
            "three GPU groups for that); works with OPPO on and off.",
        ),
        False,
    ),
    "trace_dir": (
        dict(
            metavar="DIR",
            help="Write a Chrome/Perfetto trace of every step here (generation per engine, chunk prefills, "
            "experience, training, weight sync); open it in https://ui.perfetto.dev.",
        ),
        None,
    ),
}

# The mechanism switches: 'auto' is the plan's choice. docs/options.md describes each one.
ADVANCED = {
    "overcommit": (
        dict(type=_int_or_auto("--oppo.overcommit", 0), help="Prompt groups in flight beyond --rollout.batch_size."),
        "auto",
    ),
    "overcommit_rule": (
        dict(
            choices=["throughput", "reward_slope"],
            help="How Delta moves under --oppo.overcommit auto: by the waits for generation, or the paper's reward "
            "slope.",
        ),
        "throughput",
    ),
    "overcommit_window": (
        dict(type=_bounded(int, "--oppo.overcommit_window", 2), help="Steps over which the rule judges Delta."),
        3,
    ),
    "overcommit_inc": (
        dict(type=_int_or_auto("--oppo.overcommit_inc", 1), help="Groups Delta grows by (auto: a quarter of B)."),
        "auto",
    ),
    "overcommit_dec": (
        dict(type=_int_or_auto("--oppo.overcommit_dec", 1), help="Groups Delta shrinks by (auto: an eighth of B)."),
        "auto",
    ),
    "overcommit_min": (dict(type=_bounded(int, "--oppo.overcommit_min", 0), help="Lower bound of Delta."), 0),
    "overcommit_max": (
        dict(type=_int_or_auto("--oppo.overcommit_max", 0), help="Upper bound of Delta (auto: from --oppo.max_lag)."),
        "auto",
    ),
    "max_defer_steps": (
        dict(
            type=_int_or_auto("--oppo.max_defer_steps", 1),
            help="Steps a group may be carried before a step waits for it (auto: from --oppo.max_lag).",
        ),
        "auto",
    ),
    "top_up": (
        dict(
            choices=["auto", "step_start", "step_end"],
            help="When new prompts start: after the weight sync, or before training so that they decode through "
            "it.",
        ),
        "auto",
    ),
    "colocated_decode": (
        dict(
            choices=["auto", "pause", "during_training", "continue"],
            help="What awake engines on the models' GPUs do while the models make experiences and train.",
        ),
        "auto",
    ),
    "policy_logprobs": (
        dict(
            choices=["auto", "policy", "vllm"],
            help="What computes the policy's old log-probs: its own ranks on streamed chunks, or vLLM's prompt "
            "log-probs after the weight sync.",
        ),
        "auto",
    ),
    "critic_catch_up": (
        dict(
            choices=["auto", "next_step", "after_fit", "next_batch"],
            help="When the critic scores the chunks held through training: at the next step, after its own fit, "
            "or after its fit for the next batch only.",
        ),
        "auto",
    ),
    "state_moves": (
        dict(
            choices=["auto", "serial", "overlap"],
            help="Under --ds.enable_sleep: move one model's DeepSpeed states while the other trains, or one after "
            "the other as upstream.",
        ),
        "auto",
    ),
    "frozen_scorers_on": (
        dict(
            choices=["auto", "generation", "models"],
            help="With --oppo.colocate_models: the reward and reference models beside the vLLM engines, or on the "
            "models' GPUs.",
        ),
        "auto",
    ),
    "weight_sync": (
        dict(
            choices=["staged", "paused"],
            help="Engines on GPUs of their own receive new weights into a staging copy while they decode, or "
            "pause for the whole sync.",
        ),
        "staged",
    ),
    "memory_flags": (
        dict(
            choices=["plan", "as_given"],
            help="Whether the memory plan may change OpenRLHF's speed-for-memory flags under --train.colocate_all "
            "(the sleep modes, vLLM's share).",
        ),
        "plan",
    ),
    "strict_memory": (
        dict(
            action="store_true",
            help="Refuse a run whose leanest layout the memory plan estimates not to fit the GPU, instead of running "
            "it as OpenRLHF would with a warning naming the flag to change.",
        ),
        False,
    ),
    "gpu_memory_gb": (
        dict(
            type=_bounded(float, "--oppo.gpu_memory_gb", 1.0),
            metavar="GIB",
            help="Memory of one GPU for the memory plan, in GiB. Default: read from the first visible GPU.",
        ),
        None,
    ),
    "chunk_size": (
        dict(
            type=_int_or_auto("--oppo.chunk_size", 1),
            help="Tokens per streamed chunk (auto: from the decode rate and the scorers' prefill cost).",
        ),
        "auto",
    ),
    "stream_interval": (
        dict(
            type=_int_or_auto("--oppo.stream_interval", 1),
            help="Tokens a request decodes between two outputs to the rollout actor (auto: 16, at most a chunk).",
        ),
        "auto",
    ),
    "prefill_calls_in_flight": (
        dict(
            type=_bounded(int, "--oppo.prefill_calls_in_flight", 1),
            help="Prefill calls a rollout actor keeps in flight to one scoring actor.",
        ),
        2,
    ),
    "flush_interval_ms": (
        dict(
            type=_bounded(float, "--oppo.flush_interval_ms", 0.0),
            help="How long a ready chunk waits so that one decode step's chunks go out in one call.",
        ),
        5.0,
    ),
    "max_prefill_tokens": (
        dict(
            type=_bounded(int, "--oppo.max_prefill_tokens", 1),
            help="New tokens (padded) in one prefill forward pass of a scorer.",
        ),
        16384,
    ),
    "max_prefill_cached_tokens": (
        dict(
            type=_bounded(int, "--oppo.max_prefill_cached_tokens", 1),
            help="Cached tokens (padded) gathered for one prefill forward pass of a scorer.",
        ),
        65536,
    ),
    "call_timeout_s": (
        dict(
            type=_bounded(float, "--oppo.call_timeout_s", 1.0),
            help="The longest the trainer waits for a call to a rollout or scoring actor before it stops the run.",
        ),
        900.0,
    ),
    "profile_step": (
        dict(
            type=_bounded(int, "--oppo.profile_step", 0),
            metavar="N",
            help="Profile the policy's and the critic's training of step N with torch.profiler into "
            "--oppo.trace_dir (0: off).",
        ),
        0,
    ),
}
ALL_OPTIONS = {**OPTIONS, **ADVANCED}

# Options that keep their meaning with OPPO off.
WITHOUT_ENABLE = {"colocate_models"}

# Upstream's --train.batch_size default. add_arguments leaves it out of the parse, so that extension.configure can
# tell a batch given from the default, which is warned of where a step makes fewer samples (preflight.check_flags).
UPSTREAM_TRAIN_BATCH_SIZE = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{"train.batch_size": None})
    group = parser.add_argument_group("OPPO (pipeline overlap)", "Options of openrlhf-oppo; see its README.")
    group.add_argument("--oppo.enable", action="store_true", default=False, help="Turn OPPO on. Default: off.")
    _add_options(group, OPTIONS)
    advanced = parser.add_argument_group(
        "OPPO advanced", "Mechanism switches for experiments and the benchmark; 'auto' is the plan's choice."
    )
    _add_options(advanced, ADVANCED)


def _add_options(group, options: dict) -> None:
    for name, (kwargs, default) in options.items():
        kwargs = dict(kwargs, help=_with_default(kwargs["help"], default))
        if kwargs.get("action") != "store_true":
            kwargs["default"] = None
            if "choices" not in kwargs:
                kwargs.setdefault("metavar", getattr(kwargs.get("type"), "metavar", None))
        group.add_argument(f"--oppo.{name}", **kwargs)


def _with_default(help_text: str, default) -> str:
    """The help sentence with the default it shows (argparse's own default is None, see OPTIONS)."""
    if "default" in help_text.lower():
        return help_text
    shown = "off" if default is None or default is False else f"{default:g}" if isinstance(default, float) else default
    return f"{help_text} Default: {shown}."


def given_options(oppo) -> list:
    """The ``--oppo.*`` options the user set (argparse's default is None for all of them, see OPTIONS)."""
    return [name for name in ALL_OPTIONS if getattr(oppo, name, None) not in (None, False)]


def check_given(oppo, given) -> None:
    if not oppo.enable:
        stray = [name for name in given if name not in WITHOUT_ENABLE]
        if stray:
            flags = ", ".join(f"--oppo.{name}" for name in stray)
            raise OPPOConfigError(f"{flags} given without --oppo.enable: add --oppo.enable or drop them.")


def fill_defaults(oppo) -> None:
    """``oppo``: the plan's working copy of the options (plan.resolve), never the user's namespace."""
    for name, (_, default) in ALL_OPTIONS.items():
        if getattr(oppo, name, None) is None:
            setattr(oppo, name, default)


def warn_of_the_first_tokens_log_prob(args) -> None:
    """OpenRLHF samples with vLLM's min_tokens=1, which masks the end of text at the first token; with the
    importance correction on, vLLM's log-prob of that token (pi_rollout) then leaves out the end of text's
    probability, and a response that ends there is never sampled, so never corrected. Patch 0015 makes it
    ``--rollout.min_new_tokens``."""
    if args.algo.advantage.is_correction_level == "off" or getattr(args.rollout, "min_new_tokens", 1) < 1:
        return
    fix = "--rollout.min_new_tokens 0" if hasattr(args.rollout, "min_new_tokens") else "patches/openrlhf/0015"
    print(
        f"[openrlhf-oppo] warning: --algo.advantage.is_correction_level {args.algo.advantage.is_correction_level} "
        "with responses of at least one token: vLLM's log-prob of the first token leaves out the end of text's "
        f"probability, so the correction is biased there and can drift the policy towards it ({fix} removes it).",
        flush=True,
    )


def check_placement(args) -> None:
    if args.oppo.frozen_scorers_on == "generation":
        _check_frozen_beside_vllm(args)
    if not args.oppo.colocate_models:
        return
    if args.train.colocate_all:
        raise OPPOConfigError(
            "--oppo.colocate_models and --train.colocate_all are two different placements: with colocate_all the "
            "vLLM engines share the models' GPUs; with colocate_models they have GPUs of their own. Pick one."
        )
    if args.train.async_enable:
        raise OPPOConfigError(
            "--oppo.colocate_models is a synchronous placement. With --train.async_enable use --train.colocate_all, "
            "which in async mode already places only the DeepSpeed models together."
        )
    # The frozen models beside vLLM are checked against the engines' GPUs; under 'auto' that is decided once the
    # streamed roles are known (resolve_roles), which checks them against the actor's if they stay.
    frozen_may_go = args.oppo.enable and args.oppo.frozen_scorers_on != "models"
    _check_on_the_actors_gpus(args, ("critic",) if frozen_may_go else ("critic", "reward", "ref"))
    if not args.vllm.num_engines:
        raise OPPOConfigError("--oppo.colocate_models places the vLLM engines apart: set --vllm.num_engines >= 1.")


def _check_on_the_actors_gpus(args, groups) -> None:
    actor = (args.actor.num_nodes, args.actor.num_gpus_per_node)
    for group in groups:
        other = (getattr(args, group).num_nodes, getattr(args, group).num_gpus_per_node)
        if other != actor:
            raise OPPOConfigError(
                f"--oppo.colocate_models puts every model on the actor's GPUs: set --{group}.num_nodes and "
                f"--{group}.num_gpus_per_node to the actor's ({actor[0]} and {actor[1]}), got {other}."
            )


# vLLM's share of a GPU it shares with the frozen models; the rest holds their weights, KV caches and activations.
FROZEN_BESIDE_VLLM_MAX_UTILIZATION = 0.8


def _check_frozen_beside_vllm(args) -> None:
    if not args.oppo.colocate_models:
        raise OPPOConfigError(
            "--oppo.frozen_scorers_on generation places the reward and reference models on the vLLM engines' GPUs "
            "of the split placement: add --oppo.colocate_models, or use --oppo.frozen_scorers_on models."
        )
    engine_gpus = (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    for group in ("reward", "ref"):
        ranks = getattr(args, group).num_nodes * getattr(args, group).num_gpus_per_node
        if ranks != engine_gpus:
            raise OPPOConfigError(
                f"--oppo.frozen_scorers_on generation puts one {group} rank on each vLLM GPU: set "
                f"--{group}.num_nodes and --{group}.num_gpus_per_node to {engine_gpus} GPUs in all "
                f"(--vllm.num_engines x --vllm.tensor_parallel_size), got {ranks}."
            )
    if args.vllm.gpu_memory_utilization > FROZEN_BESIDE_VLLM_MAX_UTILIZATION:
        raise OPPOConfigError(
            f"--oppo.frozen_scorers_on generation loads the reward and reference models beside vLLM, which takes "
            f"--vllm.gpu_memory_utilization {args.vllm.gpu_memory_utilization:g} of each GPU: set it to at most "
            f"{FROZEN_BESIDE_VLLM_MAX_UTILIZATION} (the KV cache shrinks accordingly), or use "
            "--oppo.frozen_scorers_on models."
        )


def check_oppo(args, given) -> None:
    oppo = args.oppo
    if not args.vllm.num_engines:
        raise OPPOConfigError("OPPO overlaps vLLM generation with the other stages: set --vllm.num_engines >= 1.")
    if args.train.async_enable:
        raise OPPOConfigError(
            "--oppo.enable with --train.async_enable is not supported: OPPO's inter-step overlap takes the place "
            "of the async trainer. Use one or the other (the benchmark runs both side by side)."
        )
    if streams(args):
        unsupported = {
            "--ds.ring_attn_size > 1": args.ds.ring_attn_size > 1,
            "--ds.tensor_parallel_size > 1": args.ds.tensor_parallel_size > 1,
            "--ds.lora.rank > 0": args.ds.lora.rank > 0,
            "--data.max_images_per_prompt > 0 (VLM)": args.data.max_images_per_prompt > 0,
        }
        for what, hit in unsupported.items():
            if hit:
                raise OPPOConfigError(
                    f"Intra-step streaming does not support {what} yet: use --oppo.intra_step off (inter-step "
                    "overlap still works) or change that setting."
                )
    if oppo.carry_kv == "keep" and args.vllm.enable_sleep:
        raise OPPOConfigError(
            "--oppo.carry_kv keep needs the KV cache to survive between steps, but --vllm.enable_sleep drops it: "
            "use --oppo.carry_kv recompute (carried requests are re-prefilled on wake) or drop --vllm.enable_sleep."
        )
    if "colocated_decode" in given and not args.train.colocate_all:
        raise OPPOConfigError(
            "--oppo.colocated_decode sets what the engines do while the models train on the same GPUs, but without "
            "--train.colocate_all they have GPUs of their own and decode through training anyway: drop it."
        )
    if "colocated_decode" in given and args.vllm.enable_sleep:
        raise OPPOConfigError(
            "--oppo.colocated_decode sets what the engines do while the models train, but --vllm.enable_sleep puts "
            "them to sleep then: drop --vllm.enable_sleep (the engines then keep their GPU memory through "
            "training; leave the models room with --vllm.gpu_memory_utilization) or the option."
        )
    pausing = args.train.colocate_all and oppo.colocated_decode == "pause"
    if oppo.top_up == "step_end" and (pausing or oppo.overcommit == 0):
        raise OPPOConfigError(
            "--oppo.top_up step_end starts the next step's prompts during training, so it needs inter-step overlap "
            "(--oppo.overcommit > 0 or auto) and vLLM engines that decode through training: on GPUs of their own, "
            "or under --train.colocate_all awake (no --vllm.enable_sleep) with --oppo.colocated_decode continue or "
            "during_training (otherwise they wait or sleep through training). Use --oppo.top_up step_start there."
        )
    if oppo.critic_catch_up in ("after_fit", "next_batch") and args.ds.enable_sleep and oppo.state_moves != "overlap":
        raise OPPOConfigError(
            f"--oppo.critic_catch_up {oppo.critic_catch_up} sends the critic its held chunks as soon as its fit "
            "ends, but under --ds.enable_sleep upstream's training moves the models' states and trains them one "
            "after the other, with nothing between the two fits: add --oppo.state_moves overlap, whose training "
            "sends them there, or use --oppo.critic_catch_up next_step."
        )
    if oppo.state_moves == "overlap" and not args.ds.enable_sleep:
        raise OPPOConfigError(
            "--oppo.state_moves overlap moves DeepSpeed states that --ds.enable_sleep takes off the GPU between "
            "steps; without it they stay on the GPU and there is nothing to overlap: add --ds.enable_sleep or drop "
            "the option."
        )
    if oppo.state_moves == "overlap" and args.algo.advantage.estimator != "gae":
        raise OPPOConfigError(
            "--oppo.state_moves overlap loads the policy's states while the critic trains, but "
            f"--algo.advantage.estimator {args.algo.advantage.estimator} trains no critic: drop the option."
        )
    if oppo.policy_logprobs == "vllm" and (args.rollout.temperature != 1.0 or args.vllm.enable_sleep):
        raise OPPOConfigError(
            "--oppo.policy_logprobs vllm takes vLLM's prompt log-probs, which come from the raw logits and need the "
            "engines awake after the weight sync: it needs --rollout.temperature 1.0 (given "
            f"{args.rollout.temperature:g}) and no --vllm.enable_sleep. Use --oppo.policy_logprobs policy there."
        )
    if oppo.overcommit != "auto" and "overcommit_rule" in given:
        raise OPPOConfigError(
            f"--oppo.overcommit_rule {oppo.overcommit_rule} moves Delta under --oppo.overcommit auto, but "
            f"--oppo.overcommit {oppo.overcommit} fixes it: use --oppo.overcommit auto or drop the rule."
        )
    if oppo.trace_dir is not None and os.path.exists(oppo.trace_dir) and not os.path.isdir(oppo.trace_dir):
        raise OPPOConfigError(f"--oppo.trace_dir {oppo.trace_dir} is a file: give a folder for the traces.")
    if oppo.profile_step and oppo.trace_dir is None:
        raise OPPOConfigError(
            f"--oppo.profile_step {oppo.profile_step} writes its profiles into --oppo.trace_dir: add --oppo.trace_dir."
        )


def streams(args) -> bool:
    """'auto' streams unless the engines sleep on the scoring models' GPUs (the hybrid engine): their share of
    the GPU is set for vLLM alone there, and the scorers' KV caches would have to fit beside it (the plan turns it
    on there where its memory plan says they fit)."""
    hybrid_engine = args.train.colocate_all and args.vllm.enable_sleep
    return args.oppo.intra_step == "on" or (args.oppo.intra_step == "auto" and not hybrid_engine)


def resolve_roles(args) -> None:
    """Which models stream, and where the frozen ones run (``--oppo.frozen_scorers_on auto``)."""
    oppo = args.oppo
    roles = []
    if streams(args):
        # Every model of the run; the policy's GPUs are idle during generation unless the engines live on them.
        roles = [role for role in topology.models(args) if role != "policy" or not args.train.colocate_all]
    oppo.streamed_roles = roles
    if oppo.frozen_scorers_on == "auto":
        oppo.frozen_scorers_on = "generation" if _frozen_beside_vllm_applies(args) else "models"
        if oppo.frozen_scorers_on == "models" and oppo.colocate_models:
            _check_on_the_actors_gpus(args, ("reward", "ref"))


def critic_catches_up_alone(args) -> bool:
    """'auto': the critic's catch-up of the next batch starts after its fit where it is the only prefill left after
    the sync (the engines score the policy's log-probs) and the models stay awake through training, as after_fit
    and next_batch need (the policy streams only apart from vLLM, not under --train.colocate_all)."""
    oppo = args.oppo
    return (
        oppo.inter_step
        and oppo.policy_logprobs == "vllm"
        and {"policy", "critic"} <= set(oppo.streamed_roles)
        and not args.ds.enable_sleep
    )


def _frozen_beside_vllm_applies(args) -> bool:
    """'auto': the frozen models go beside vLLM where they stream and the placement has room for them. Where
    vLLM's share of its GPUs leaves no room (OpenRLHF's default 0.95), the log says what would."""
    if not args.oppo.colocate_models or not {"reward", "reference"} & set(args.oppo.streamed_roles):
        return False
    try:
        _check_frozen_beside_vllm(args)
    except OPPOConfigError:
        share = args.vllm.gpu_memory_utilization
        if share > FROZEN_BESIDE_VLLM_MAX_UTILIZATION:
            print(
                "[openrlhf-oppo] --oppo.frozen_scorers_on auto keeps the reward and reference models on the models' "
                f"GPUs: --vllm.gpu_memory_utilization {share:g} leaves them no room beside vLLM (at most "
                f"{FROZEN_BESIDE_VLLM_MAX_UTILIZATION} would).",
                flush=True,
            )
        return False
    return True


def _unused(names, what: str, instead: str) -> OPPOConfigError:
    """The error for options given for a part of OPPO that this run does not use."""
    flags = ", ".join(f"--oppo.{name}" for name in names)
    verb, it = ("tunes", "it") if len(names) == 1 else ("tune", "them")
    return OPPOConfigError(f"{flags} {verb} {what}: drop {it}, or {instead}.")


# Options that tune intra-step streaming alone: giving one asks for streaming.
STREAMING_ONLY = (
    "chunk_size",
    "cache_budget_gb",
    "prefill_calls_in_flight",
    "flush_interval_ms",
    "max_prefill_tokens",
    "max_prefill_cached_tokens",
)


def check_streaming_plan(args, given) -> None:
    """Streaming settings that would quietly undo what was asked for."""
    oppo = args.oppo
    if "policy_logprobs" in given and "policy" not in oppo.streamed_roles:
        raise _unused(
            ["policy_logprobs"],
            "the streamed policy, and the policy does not stream here (intra-step streaming off, or vLLM on the "
            "models' GPUs: --train.colocate_all)",
            "stream the policy",
        )
    if not oppo.streamed_roles:
        if oppo.intra_step == "on":
            raise OPPOConfigError(
                "--oppo.intra_step on, but no model of this run can stream: the reward comes from "
                "--reward.remote_url or an agent, there is no critic (--algo.advantage.estimator is not gae), no "
                "reference (--algo.kl.init_coef 0), and the policy shares vLLM's GPUs (--train.colocate_all). "
                "Use --oppo.intra_step off."
            )
        unused = [name for name in STREAMING_ONLY if name in given]
        if unused:
            why = (
                "--oppo.intra_step off"
                if oppo.intra_step == "off"
                else "--oppo.intra_step auto under the hybrid engine"
            )
            raise _unused(
                unused, f"intra-step streaming, which is off in this run ({why})", "stream with --oppo.intra_step on"
            )
        return
    longest, flag = (args.rollout.max_new_tokens, "--rollout.max_new_tokens")
    if longest is None:
        longest, flag = args.data.max_len, "--data.max_len"
    if oppo.chunk_size != "auto" and oppo.chunk_size >= longest:
        raise OPPOConfigError(
            f"--oppo.chunk_size {oppo.chunk_size} is not below the longest response ({flag} {longest}): every "
            f"response would stream as one chunk, scored only when it ends. Use a chunk size below {longest}, or auto."
        )


# --oppo.stream_interval auto: a request's tokens reach the rollout actor this many at a time (vLLM's default is 1).
STREAM_INTERVAL = 16


def resolve_stream_interval(oppo) -> None:
    """Chunks are cut from the engine's outputs: an interval larger than the smallest chunk would grow it."""
    smallest_chunk = CHUNK_CANDIDATES[0] if oppo.chunk_size == "auto" else oppo.chunk_size
    if oppo.stream_interval == "auto":
        oppo.stream_interval = min(STREAM_INTERVAL, smallest_chunk)
    elif oppo.stream_interval > smallest_chunk:
        raise OPPOConfigError(
            f"--oppo.stream_interval {oppo.stream_interval} is larger than the smallest chunk (--oppo.chunk_size "
            f"{oppo.chunk_size}: {smallest_chunk} tokens): chunks are cut from the engine's outputs, and would grow "
            f"to {oppo.stream_interval} tokens. Use a stream interval of at most {smallest_chunk}, or auto."
        )


def check_overcommit_plan(args, given) -> None:
    """Inter-step settings that have no effect, undo the overlap, or put more groups in flight than make sense."""
    oppo = args.oppo
    auto_only = [name for name in ALL_OPTIONS if name.startswith("overcommit_") and name in given]
    if not oppo.inter_step:
        unused = auto_only + [
            name
            for name in ("max_defer_steps", "carry_kv", "top_up", "weight_sync", "critic_catch_up", "colocated_decode")
            if name in given
        ]
        if unused:
            raise _unused(
                unused,
                "inter-step overlap, which --oppo.overcommit 0 or --oppo.max_lag 0 turns off",
                "allow a lag with --oppo.max_lag N",
            )
        return
    if "weight_sync" in given and (args.train.colocate_all or args.vllm.enable_sleep):
        raise _unused(
            ["weight_sync"],
            "how engines that decode carried requests on GPUs of their own receive the new weights, and here they "
            "share the models' GPUs (--train.colocate_all) or sleep through the sync (--vllm.enable_sleep)",
            "place vLLM apart, awake",
        )
    if "critic_catch_up" in given and "critic" not in oppo.streamed_roles:
        raise _unused(
            ["critic_catch_up"],
            "the streamed critic's held chunks, and no critic streams here (intra-step streaming off, or no critic: "
            "--algo.advantage.estimator is not gae)",
            "stream the critic",
        )
    if oppo.overcommit != "auto" and auto_only:
        delta = oppo.overcommit
        raise _unused(
            auto_only, f"--oppo.overcommit auto, and --oppo.overcommit {delta} keeps Delta at {delta}", "use auto"
        )
    if oppo.overcommit == "auto" and oppo.overcommit_max == 0:
        raise OPPOConfigError(
            "--oppo.overcommit auto with --oppo.overcommit_max 0 keeps Delta at 0: turn inter-step overlap off with "
            "--oppo.overcommit 0, or allow an --oppo.overcommit_max of 1 or more."
        )
    # With B + Delta groups in flight and B trained a step, a group waits about Delta / B steps: past
    # max_defer_steps most groups are overdue and every step waits for them.
    batch = args.rollout.batch_size
    limit = oppo.max_defer_steps * batch
    for name in ("overcommit", "overcommit_min", "overcommit_max"):
        value = getattr(oppo, name)
        if value != "auto" and value > limit:
            raise OPPOConfigError(
                f"--oppo.{name} {value} is above --oppo.max_defer_steps x --rollout.batch_size "
                f"({oppo.max_defer_steps} x {batch} = {limit}): a group would wait about Delta / batch_size steps "
                f"to be trained, past max_defer_steps, and every step would wait for the overdue ones. Use at most "
                f"{limit}" + (", or --oppo.overcommit auto." if name == "overcommit" else ".")
            )
        if value != "auto" and name in given and batch + value > args.data.max_samples:
            raise OPPOConfigError(
                f"--oppo.{name} {value} with --rollout.batch_size {batch} puts more prompt groups in flight than "
                f"there are prompts (--data.max_samples {args.data.max_samples}): use at most "
                f"{max(args.data.max_samples - batch, 0)}."
            )
