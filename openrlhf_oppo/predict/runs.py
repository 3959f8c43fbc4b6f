"""What a prediction reads: a run's steps (a harness run folder or a tensorboard folder), its placement and
plan (from its ``train_ppo_ray`` flags, parsed and resolved as the trainer would), and its responses' lengths."""

import contextlib
import copy
import functools
import io
import os
import re
from dataclasses import dataclass, replace
from typing import List, Optional

from openrlhf_oppo import tiny, topology
from openrlhf_oppo.bench import report
from openrlhf_oppo.plan import Plan
from openrlhf_oppo.predict.simulate import Setup

SHAPE_IN_NAME = re.compile(r"(?<![\d.])(0\.5|1\.5|3|7)b", re.IGNORECASE)


@dataclass
class Run:
    """One system's logged steps with what the prediction needs around them."""

    name: str
    flags: list
    steps: list  # one dict a step, as report.read_steps gives them
    warmup: int
    measured: int
    shape: Optional[str] = None
    lengths: Optional[List[int]] = None  # every response's length in dispatch order, where the workload is known
    prompt_tokens: Optional[int] = None
    gpu_samples: Optional[list] = None
    patched: bool = False  # OpenRLHF with patches/openrlhf applied (the harness's --upstream_patches)
    card: Optional[str] = None  # the GPU it ran on (costs.CARDS), where the run recorded it

    @property
    def measured_steps(self) -> list:
        return self.steps[self.warmup : self.warmup + self.measured]


def parse_flags(flags: list):
    """The namespace upstream's ``train`` would get (its plan: ``plan.resolve``). Flags this OpenRLHF does not know
    (a patched upstream's) are left out; a stored run's folders point at stand-ins the preflight accepts."""
    # A validation parses the same few command lines hundreds of times, each a run of upstream's CLI module.
    return copy.deepcopy(_parse_flags(tuple(flags)))


@functools.lru_cache(maxsize=None)
def _parse_flags(flags: tuple):
    from openrlhf_oppo.bench.memory_check import on_this_machine
    from openrlhf_oppo.cli import train_ppo_ray

    flags = [on_this_machine(flag, "tiny") for flag in flags]
    for _ in range(8):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                return train_ppo_ray.parse_args(flags)
        except SystemExit:
            unknown = re.search(r"unrecognized arguments: (.*)", out.getvalue())
            if not unknown:
                raise ValueError(f"these flags do not parse: {out.getvalue().strip()[-300:]}")
            flags = _without(flags, unknown.group(1).split())
    raise ValueError("these flags do not parse")


def _without(flags: list, words: list) -> list:
    kept, skip = [], set(words)
    for word in flags:
        if word in skip:
            skip.discard(word)
            continue
        kept.append(word)
    return kept


def system_of(args) -> str:
    if args.train.async_enable:
        return "async"
    return "oppo" if args.oppo.enable else "sync"


def setup_of(args, prompt_tokens: int) -> Setup:
    """The placement, batch and models of the run (``topology.models``: the models upstream's ``train`` creates)."""
    roles = topology.models(args)
    return Setup(
        engines=args.vllm.num_engines,
        model_gpus=args.actor.num_nodes * args.actor.num_gpus_per_node,
        colocated=args.train.colocate_all and not args.train.async_enable,
        vllm_sleep=args.vllm.enable_sleep,
        batch=args.rollout.batch_size,
        n_samples=args.rollout.n_samples_per_prompt,
        prompt_tokens=prompt_tokens,
        rollout_micro_batch=args.rollout.micro_batch_size,
        train_micro_batch=args.train.micro_batch_size,
        roles=roles,
        trained=tuple(role for role in roles if role in ("policy", "critic")),
    )


def plan_of(args) -> Plan:
    """The run's own plan (``plan.resolve``): the simulation reads it as the trainer does."""
    from openrlhf_oppo.plan import resolve

    return resolve(args)


def workload_lengths(results: dict) -> Optional[List[int]]:
    """The harness's responses' lengths in the order every system dispatches them: the workload's lengths
    (``tiny.response_lengths``) in the prompt order ``--bench.seed_prompt_order`` fixes (a seeded
    ``RandomSampler``)."""
    workload, settings = results.get("workload") or {}, results.get("settings") or {}
    if "params" not in workload or "seed" not in settings:
        return None
    import torch

    lengths = tiny.response_lengths(
        workload["prompts"], workload["distribution"], workload["seed"], **workload["params"]
    )
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(settings["seed"])).tolist()
    return [lengths[i] for i in order]


def lengths_from_means(steps: list, per_step: int, sigma: float, high: int, extra_steps: int = 4) -> List[int]:
    """Responses for a run whose logs give only each step's mean length: per step, lognormal lengths (``sigma``
    of the underlying normal, clipped to ``high``) scaled to that step's mean; then ``extra_steps`` more at the
    run's mean, for the groups a system keeps in flight beyond the logged steps."""
    means = [m for m in (_mean_length(s) for s in steps) if m is not None]
    if not means:
        raise ValueError("the logs hold no response lengths (rollout/response_length_mean)")
    means += [sum(means) / len(means)] * extra_steps
    lengths = []
    for index, mean in enumerate(means):
        drawn = tiny.response_lengths(per_step, "lognormal", seed=index, mean=mean, sigma=sigma, low=1, high=high)
        scale = mean / (sum(drawn) / len(drawn))
        lengths += [max(1, min(high, round(x * scale))) for x in drawn]
    return lengths


def _mean_length(step: dict):
    return step.get("rollout/response_length_mean", step.get("response_length"))


def shape_of(text: str) -> Optional[str]:
    """A Qwen2.5 shape named in a folder name or model path (``qwen2.5-1.5b``), if any."""
    if text in tiny.SHAPES:
        return text
    match = SHAPE_IN_NAME.search(text or "")
    return f"qwen2.5-{match.group(1)}b" if match else None


def harness_runs(folder: str) -> dict:
    """Every system of a harness run folder (``results.json``), by name, read through ``report.run_results``."""
    results = report.run_results(folder)
    if not results or "systems" not in results or "task" in results:
        return {}
    settings = results["settings"]
    lengths = workload_lengths(results)
    runs = {}
    for name, result in results["systems"].items():
        if not (result.get("summary") or {}).get("steps"):
            continue
        # Without --bench.seed_prompt_order each system drew its prompts in an order of its own.
        seeded = "--bench.seed_prompt_order" in result["flags"]
        runs[name] = Run(
            name=name,
            flags=result["flags"],
            steps=result["steps"],
            warmup=settings["warmup"],
            measured=settings["steps"],
            shape=settings.get("shape"),
            lengths=lengths if seeded else None,
            prompt_tokens=settings.get("prompt_tokens"),
            gpu_samples=result.get("gpu_samples"),
            patched=bool(results.get("upstream_patches")),
            card=card_of((results.get("machine") or {}).get("gpus") or []),
        )
    return runs


def card_of(gpu_names: list) -> Optional[str]:
    """The card of a run's GPUs, as ``results.json`` records their names ("NVIDIA H100 80GB HBM3"): "h100",
    "h200", or None for another card or none."""
    for card in ("h100", "h200"):
        if gpu_names and card in gpu_names[0].lower():
            return card
    return None


def tensorboard_run(folder: str, flags: list, sigma: float = 1.0, warmup: int = 1, shape: Optional[str] = None) -> Run:
    """An OpenRLHF run's own tensorboard logs (``--logger.tensorboard_dir``) with the flags it ran with."""
    steps = report.read_steps(folder)
    if not steps:
        raise ValueError(f"no tensorboard steps under {folder}")
    shape = shape or shape_of(parse_flags(flags).actor.model_name_or_path or "")
    if shape is None:
        raise ValueError("name the model's shape (--shape): its path names none of " + ", ".join(tiny.SHAPES))
    prompts = [
        s["total_length"] - s["response_length"] for s in steps if "total_length" in s and "response_length" in s
    ]
    if not prompts:
        raise ValueError("the logs hold no prompt lengths (total_length and response_length)")
    warmup = min(warmup, len(steps) - 1)
    run = Run(
        name=os.path.basename(os.path.normpath(folder)),
        flags=flags,
        steps=steps,
        warmup=warmup,
        measured=len(steps) - warmup,
        shape=shape,
        prompt_tokens=round(sum(prompts) / len(prompts)),
    )
    return with_lengths_from_means(run, sigma)


def with_lengths_from_means(run: Run, sigma: float) -> Run:
    """``run`` as its logs alone tell its lengths: each step's mean (``lengths_from_means``)."""
    args = parse_flags(run.flags)
    per_step = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    high = args.rollout.max_new_tokens or args.data.max_len
    return replace(run, lengths=lengths_from_means(run.steps, per_step, sigma, high))
