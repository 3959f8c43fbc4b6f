"""The ``--oppo.*`` options.

Every option is defined here with the sentence ``--help`` shows: ``OPTIONS`` are the ones a user sets, ``ADVANCED``
the mechanism switches whose ``auto`` the plan decides (``plan.resolve``). ``values`` reads them as a run has them;
the plan checks a combination of them (``plan_checks``).
"""

import argparse
import math
from collections import namedtuple

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
        dict(
            type=_int_or_auto("--oppo.overcommit_dec", 1),
            help="Groups Delta shrinks by where steps without a surplus wait for groups the lag bound made "
            "due; a step that starts with at least this many groups beyond B done has a surplus, and a window of "
            "them shrinks Delta by the smallest surplus (auto: an eighth of B).",
        ),
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


# Every option's value as the run has it, and the names of those the user gave (``values``).
Values = namedtuple("Values", ["enable", "given", *ALL_OPTIONS])


def values(oppo) -> Values:
    """The ``--oppo.*`` options as the user gave them, else their defaults: a read-only view of the parsed
    namespace, which stays as parsed."""
    parsed = {name: getattr(oppo, name, None) for name in ALL_OPTIONS}
    filled = {name: ALL_OPTIONS[name][1] if value is None else value for name, value in parsed.items()}
    return Values(enable=oppo.enable, given=frozenset(given_options(oppo)), **filled)


# Options that tune intra-step streaming alone: giving one asks for streaming.
STREAMING_ONLY = (
    "chunk_size",
    "cache_budget_gb",
    "prefill_calls_in_flight",
    "flush_interval_ms",
    "max_prefill_tokens",
    "max_prefill_cached_tokens",
)
