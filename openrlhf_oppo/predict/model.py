"""Predictions: each system's flags from a sync run's, their simulated steps, and what to print of them."""

import random
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from openrlhf_oppo import config
from openrlhf_oppo.predict import costs as costs_
from openrlhf_oppo.predict import runs as runs_
from openrlhf_oppo.predict import simulate
from openrlhf_oppo.predict.simulate import Costs, Step

ASYNC_FLAGS = ["--train.async_enable", "--train.partial_rollout_enable"]


@dataclass
class Prediction:
    """One system's simulated steps over the measured window, or why it cannot run."""

    name: str
    kind: str = ""  # sync, async or oppo
    steps: List[Step] = field(default_factory=list)
    plan: str = ""  # what the system does (OPPO: its resolved plan)
    lag_bound: Optional[int] = None
    refused: str = ""  # why the placement cannot run it

    def mean(self, key: str) -> float:
        return statistics.mean(getattr(s, key) for s in self.steps)

    @property
    def step_s(self) -> float:
        return self.mean("wall_s")

    @property
    def bound_s(self) -> float:
        return self.mean("bound_s")

    @property
    def set_by(self) -> str:
        """What the bound is: the engines' decoding, or the largest phase on the models' GPUs."""
        if self.mean("engines_busy_s") >= self.mean("models_busy_s"):
            return "generation"
        phases = {"training": "train_s", "weight sync": "sync_s", "make_experience": "experience_s"}
        return max(phases, key=lambda p: self.mean(phases[p]))


def simulate_system(kind: str, costs: Costs, setup, plan, lengths: List[int], steps: int) -> List[Step]:
    if kind == "sync":
        return simulate.simulate_sync(costs, setup, lengths, steps)
    if kind == "async":
        return simulate.simulate_async(costs, setup, lengths, steps)
    return simulate.simulate_oppo(costs, setup, plan, lengths, steps)


def async_flags(sync_flags: list):
    """Upstream's async trainer with partial rollout in the sync run's placement, or the reason it has none:
    ``--oppo.colocate_models`` becomes ``--train.colocate_all``, which in async mode places only the models."""
    flags = [f for f in sync_flags if f not in ASYNC_FLAGS]
    if "--train.colocate_all" in flags:
        return "upstream's async trainer needs GPUs of its own for vLLM (this run shares them with the models)"
    if "--oppo.colocate_models" in flags:
        flags[flags.index("--oppo.colocate_models")] = "--train.colocate_all"
    return flags + ASYNC_FLAGS


def oppo_flags(sync_flags: list, extra: list = ()) -> list:
    """OPPO on the sync run's placement: ``--oppo.enable`` and the user's ``--oppo.*`` flags, the rest as it ran."""
    return [f for f in sync_flags if f != "--oppo.enable"] + ["--oppo.enable"] + list(extra)


def predict_systems(
    costs: Costs, lengths: List[int], prompt_tokens: int, flags: Dict[str, object], warmup: int, measured: int
) -> Dict[str, Prediction]:
    """Each system's steps ``warmup`` to ``warmup + measured`` (``flags``: a system's flags, or the reason it
    cannot run)."""
    out = {}
    for name, system_flags in flags.items():
        if isinstance(system_flags, str):
            out[name] = Prediction(name, refused=system_flags)
            continue
        try:
            args = runs_.parse_flags(system_flags)
        except (ValueError, config.OPPOConfigError) as error:
            out[name] = Prediction(name, refused=str(error))
            continue
        kind, setup, plan = runs_.system_of(args), runs_.setup_of(args, prompt_tokens), runs_.plan_of(args)
        if plan.carry.overcommit.auto and plan.carry.overcommit.rule == "throughput":
            plan = simulate.with_delta(plan, settled_delta(costs, setup, plan, lengths))
        steps = simulate_system(kind, costs, setup, plan, lengths, warmup + measured)[warmup:]
        if not steps:
            out[name] = Prediction(name, kind=kind, refused="the workload's prompts run out before the measured steps")
            continue
        out[name] = Prediction(
            name, kind=kind, steps=steps, plan=_plan(kind, args, plan), lag_bound=_lag_bound(kind, plan)
        )
    return out


def _lag_bound(kind: str, plan) -> int:
    """The most weight updates between a trained group's dispatch and its training: async's next batch starts
    one version behind; OPPO's carried groups are waited for once carried ``max_defer_steps`` times, a step
    later where they started before training (``--oppo.top_up step_end``)."""
    if kind == "oppo" and plan.carry.overcommit.initial:
        return plan.carry.max_defer_steps + (plan.carry.top_up == "step_end")
    return 1 if kind == "async" else 0


def settled_delta(costs: Costs, setup, plan, lengths: List[int], steps: int = 12) -> int:
    """The Delta ``--oppo.overcommit auto`` holds under its throughput rule, which moves Delta up while most steps
    of a window wait for their B-th group: the smallest Delta within the rule's bounds at which most of the last
    window's steps of a short simulation do not (by bisection; a wait falls as Delta grows). The workload repeats
    in new orders where it is shorter, as further episodes would draw it."""
    per_step = setup.batch * setup.n_samples
    longer, rng = list(lengths), random.Random(0)
    while len(longer) < (steps + 4) * per_step:
        more = list(lengths)
        rng.shuffle(more)
        longer += more

    def waits(delta: int) -> bool:
        sim = simulate.OPPOSim(costs, setup, simulate.with_delta(plan, delta), longer)
        for _ in range(steps):
            if sim.step() is None:
                break
        verdicts = sim.controller.verdicts  # the rule's own verdict of each step of its window
        return verdicts.count("waited") * 2 > len(verdicts)

    low, high = plan.carry.overcommit.minimum, max(plan.carry.overcommit.minimum, plan.carry.overcommit.maximum)
    if waits(high):
        return high
    while low < high:
        middle = (low + high) // 2
        if waits(middle):
            low = middle + 1
        else:
            high = middle
    return low


def _plan(kind: str, args, plan) -> str:
    if kind != "oppo":
        return {"sync": "upstream's sync trainer", "async": "upstream's async trainer, partial rollout"}[kind]
    from openrlhf_oppo.plan import describe, resolve

    text = describe(resolve(args)).removeprefix("OPPO on: ")
    if resolve(args).carry.overcommit.auto:
        delta = plan.carry.overcommit
        at_bound = " (its bound, --oppo.overcommit_max)" if delta.initial == delta.maximum else ""
        text += f"; the throughput rule holds Delta at {delta.initial}{at_bound}"
    return text


def costs_of_sync_run(run, calibration: dict):
    """A sync run's own costs, with the setup it ran."""
    args = runs_.parse_flags(run.flags)
    if runs_.system_of(args) != "sync":
        raise ValueError(f"{run.name} is not upstream's sync trainer: predict from a sync run's logs")
    setup = runs_.setup_of(args, run.prompt_tokens)
    placement = "colocated" if setup.colocated else "split"
    defaults = calibration["intercepts"].get(placement) or next(iter(calibration["intercepts"].values()))
    return costs_.from_sync_run(run, setup, costs_.shape_slopes(calibration, run.shape), defaults), setup


def from_sync_run(run, calibration: dict, systems: Dict[str, object]) -> Dict[str, Prediction]:
    """Predict ``systems`` (name: flags) from the sync ``run``'s logs and workload."""
    costs, _ = costs_of_sync_run(run, calibration)
    return predict_systems(costs, run.lengths, run.prompt_tokens, systems, run.warmup, run.measured)
