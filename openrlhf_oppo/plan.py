"""The run's plan: every OPPO setting resolved once, before Ray starts, from the user's flags and the placement.

``resolve(args)`` reads the hierarchized namespace and returns a frozen ``Plan``; it never writes into ``args``.
What the user gives with ``--oppo.*`` always wins; every ``auto`` is decided here, each with its reason in
``Plan.choices``. The driver prints ``describe(plan)`` once, and the trainer and every model actor receive the
plan as a constructor argument (``extension.configure``), so no process derives it again.

The choices follow the placement:

* vLLM on GPUs of its own (``--oppo.colocate_models``, several engines or one): the engines decode through
  training and the weight sync, so new prompts start after the sync, Delta may reach twice the batch, the policy's
  old log-probs come from vLLM (temperature 1) and the critic scores the next batch right after its fit.
* vLLM on the models' GPUs (``--train.colocate_all``): the engines stay awake where the memory plan says they fit
  beside the models, with the smallest vLLM share that holds the requests in flight, DeepSpeed's states on the GPU
  where they fit too and else moved while the other model trains; carried requests decode beside training and
  the next step's prompts start before it. Where nothing fits awake, the user's sleep flags stay.

OpenRLHF flags that only trade speed for memory (``--vllm.enable_sleep``, ``--ds.enable_sleep``,
``--vllm.gpu_memory_utilization`` under ``--train.colocate_all``) are the plan's to change where the memory plan
says the faster setting fits (``--oppo.memory_flags as_given`` keeps them); ``apply_upstream_changes`` is the one
place that writes them, and the start-up line says what changed.
"""

import copy
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from openrlhf_oppo import config, memory, topology
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.memory import Layout
from openrlhf_oppo.topology import Topology

# A group of the split placement is carried about Delta / B steps: twice the batch in flight beyond it keeps the
# engines busy through training and the sync, and no measured Delta beyond it was faster (docs/results).
MAX_DELTA_BATCHES = 2
# vLLM's share under --train.colocate_all awake is never set below this: the engine's own buffers and CUDA graphs.
MIN_VLLM_SHARE = 0.10
# The memory plan keeps this share of each GPU free for what it does not model (fragmentation, NCCL, allocator).
HEADROOM = 0.02
# vLLM's activations and CUDA graphs inside its share, beside the weights and the KV cache.
VLLM_ACTIVATIONS_GIB = 2.0
CACHE_BUDGET_GB = 4.0


@dataclass(frozen=True)
class Choice:
    setting: str
    value: object
    reason: str


@dataclass(frozen=True)
class Change:
    """An OpenRLHF flag the plan changed (speed for memory)."""

    flag: str
    given: object
    planned: object


@dataclass(frozen=True)
class Overcommit:
    """Delta's bounds and its controller (``overcommit.controller``)."""

    initial: int = 0
    auto: bool = False
    rule: str = "throughput"
    window: int = 3
    inc: int = 1
    dec: int = 1
    minimum: int = 0
    maximum: int = 0


@dataclass(frozen=True)
class Carry:
    """Inter-step overlap: B + Delta prompt groups in flight, the unfinished ones carried into later steps within
    the lag bound."""

    max_lag: int = 0  # 0: no inter-step overlap
    overcommit: Overcommit = Overcommit()
    max_defer_steps: int = 0
    top_up: str = "step_start"  # when new prompts start: after the weight sync, or before training
    kv: str = "recompute"  # what carried requests do with their KV cache at a weight update (--oppo.carry_kv)
    colocated_decode: str = "pause"  # what awake engines on the models' GPUs do while the models work


@dataclass(frozen=True)
class Stream:
    """Intra-step streaming: the models that score response chunks while vLLM decodes, and how."""

    roles: Tuple[str, ...] = ()
    chunk_size: Optional[int] = None  # None: chosen each step (streaming.chunking)
    interval: int = 1  # tokens a request decodes between two outputs (--oppo.stream_interval)
    cache_budget_gb: float = CACHE_BUDGET_GB
    prefill_calls_in_flight: int = 2
    flush_interval_ms: float = 5.0
    max_prefill_tokens: int = 16384
    max_prefill_cached_tokens: int = 65536
    policy_logprobs: str = "policy"  # who computes the policy's old log-probs: its ranks, or vLLM
    critic_catch_up: str = "next_step"
    frozen_scorers_on: str = "models"  # the reward and reference models' GPUs under --oppo.colocate_models

    @property
    def critic_catches_up_after_fit(self) -> bool:
        return self.critic_catch_up in ("after_fit", "next_batch")


@dataclass(frozen=True)
class Sync:
    """The weight sync, the DeepSpeed state moves around it, and the placement as the run has it (after
    ``apply_upstream_changes``)."""

    mode: str = "staged"  # --oppo.weight_sync
    bucket_mb: int = config.SYNC_BUCKET_MB
    state_moves: str = "serial"
    colocate_all: bool = False
    colocate_models: bool = False
    vllm_sleeps: bool = False


@dataclass(frozen=True)
class Observe:
    """What the run records, and how long the trainer waits for an actor."""

    trace_dir: Optional[str] = None
    profile_step: int = 0
    call_timeout_s: float = 900.0


@dataclass(frozen=True)
class MemoryPlan:
    """The run's memory layout (what the memory estimate reads) and, where the GPU and the models' shapes are known,
    OPPO's estimate of each GPU's peak with what the plan kept, OpenRLHF's own with the user's flags, and what was
    dropped to fit (``Choice``s, also in ``Plan.choices``)."""

    layout: Layout
    estimate: Optional[memory.Estimate] = None
    upstream: Optional[memory.Estimate] = None  # OpenRLHF's own run with the user's flags
    dropped: Tuple[Choice, ...] = ()
    strict: bool = False

    @property
    def estimated(self) -> bool:
        return self.estimate is not None

    @property
    def fits(self) -> bool:
        return not self.estimated or _fits(self.estimate, self.estimate.gpu_gib)

    def line(self) -> str:
        oppo, upstream = self.estimate.worst, self.upstream.worst
        where = f"GPU {oppo.label} in {oppo.phase}"
        head = (
            f"memory: OPPO {oppo.peak_gib:.1f}, OpenRLHF alone {upstream.peak_gib:.1f} of "
            f"{self.estimate.gpu_gib:.1f} GiB ({where}: {_top_parts(oppo)})"
        )
        if self.dropped:
            last = {c.setting: c.value for c in self.dropped}  # the budget's last halving says where it ended
            off = [c.value.split()[-1] for c in self.dropped if c.setting == "streaming"]
            shown = [f"{s} {_shown(v)}" for s, v in last.items() if s != "streaming"]
            head += "; dropped to fit: " + ", ".join(shown + ([f"streaming off for {', '.join(off)}"] if off else []))
        return head

    def warning(self) -> str:
        """One line where even the plan's leanest run is estimated not to fit, naming the flag to change."""
        if self.fits:
            return ""
        worst = self.estimate.worst
        whose = "OpenRLHF's own layout" if not _fits(self.upstream, self.upstream.gpu_gib) else "this run"
        return (
            f"{whose} is estimated at {worst.peak_gib:.1f} of {self.estimate.gpu_gib:.1f} GiB on GPU {worst.label} "
            f"in {worst.phase} ({_top_parts(worst)}); it runs as given: if it runs out of memory, change "
            f"{self.estimate.flag} (--oppo.strict_memory refuses such a run)"
        )


def _top_parts(peak) -> str:
    return ", ".join(f"{name} {gib:.1f}" for name, gib in peak.parts[:4])


@dataclass(frozen=True)
class Plan:
    """The run's plan: its sub-plans, each resolved once from the user's flags, and the choices that set them."""

    enabled: bool = False
    topology: Topology = Topology((), ())  # which models the run has and on which GPUs
    carry: Carry = Carry()
    stream: Stream = Stream()
    sync: Sync = Sync()
    memory: MemoryPlan = field(default=MemoryPlan(Layout(vllm_awake=True, ds_sleep=False)), compare=False)
    observe: Observe = Observe()
    choices: Tuple[Choice, ...] = ()
    upstream_changes: Tuple[Change, ...] = ()

    @property
    def inter_step(self) -> bool:
        return self.carry.overcommit.auto or self.carry.overcommit.initial > 0

    @property
    def engines_decode_through_sync(self) -> bool:
        """vLLM on GPUs of its own and awake: carried requests decode while the weights are sent."""
        return not self.sync.colocate_all and not self.sync.vllm_sleeps

    @property
    def staged_sync(self) -> bool:
        return (
            self.sync.bucket_mb > 0
            and self.inter_step
            and self.engines_decode_through_sync
            and self.sync.mode == "staged"
        )

    @property
    def pauses_after_generation(self) -> bool:
        """Awake engines on the models' GPUs pause their carried requests while the step makes its experiences."""
        return self.sync.colocate_all and not self.sync.vllm_sleeps and self.carry.colocated_decode != "continue"

    @property
    def resumes_for_training(self) -> bool:
        return self.pauses_after_generation and self.carry.colocated_decode == "during_training"


OFF = Plan()

_resolved = {}  # id(args) -> (args, plan): the wrapper and upstream's extension hook both resolve


def resolve(args) -> Plan:
    """The plan for ``args`` (hierarchized); raises ``OPPOConfigError`` for a run OPPO cannot make."""
    cached = _resolved.get(id(args))
    if cached is not None and cached[0] is args:
        return cached[1]
    plan = _resolve(args)
    _resolved[id(args)] = (args, plan)
    return plan


def _resolve(args) -> Plan:
    work = copy.deepcopy(args)  # the checks and choices run on a copy: the user's namespace stays as parsed
    oppo = work.oppo
    given = config.given_options(oppo)
    config.check_given(oppo, given)
    config.fill_defaults(oppo)
    config.check_placement(work)
    if not oppo.enable:
        return Plan(
            topology=topology.of(work),
            sync=Sync(colocate_all=work.train.colocate_all, colocate_models=oppo.colocate_models),
            memory=MemoryPlan(_user_layout(work)),
        )
    if oppo.cache_budget_gb is None:
        oppo.cache_budget_gb = CACHE_BUDGET_GB
    choices, changes = [], []
    total = gpu_gib(oppo)
    if work.train.colocate_all and oppo.memory_flags == "plan" and total is not None:
        _plan_colocated_memory(work, total, given, choices, changes)
    config.resolve_roles(work)
    # Before the mechanisms: those that follow from the streamed roles follow from the ones that fit.
    memory_plan = _fit_memory(work, args, given, total, choices)
    _resolve_lag(work, given, choices)
    _resolve_mechanisms(work, given, choices)
    config.check_oppo(work, given)
    config.check_streaming_plan(work, given)
    config.check_overcommit_plan(work, given)
    config.resolve_stream_interval(oppo)
    return _plan_from(work, choices, changes, memory_plan)


# -- the lag bound -------------------------------------------------------------------------------------------


def _resolve_lag(work, given, choices) -> None:
    """Delta, the deferral limit and the top-up from ``--oppo.max_lag``.

    A group dispatched after a step's weight sync and carried d steps trains d versions behind; one dispatched
    before the sync (``top_up step_end``) one more. So the deferral limit D is the lag bound, or one less with the
    top-up at the step's end. Delta up to (D - 1) batches keeps every group within D (the sampler takes the
    groups by deadline); at most ``MAX_DELTA_BATCHES`` batches."""
    oppo, batch = work.oppo, work.rollout.batch_size
    lag = oppo.max_lag
    if lag == 0 or oppo.overcommit == 0:
        if "overcommit" in given and oppo.overcommit != 0 and lag == 0:
            raise OPPOConfigError(
                f"--oppo.overcommit {oppo.overcommit} carries groups into later steps, but --oppo.max_lag 0 trains "
                "every sample on the weights that generated it: drop one of them."
            )
        oppo.overcommit, oppo.max_defer_steps, oppo.inter_step = 0, 0, False
        for name in ("top_up", "colocated_decode"):
            if getattr(oppo, name) == "auto":
                setattr(oppo, name, "step_start" if name == "top_up" else "pause")
        for name in ("overcommit_max", "overcommit_inc", "overcommit_dec"):
            if getattr(oppo, name) == "auto":
                setattr(oppo, name, 0 if name == "overcommit_max" else 1)
        return
    oppo.inter_step = True
    awake_colocated = work.train.colocate_all and not work.vllm.enable_sleep
    if oppo.colocated_decode == "auto":
        oppo.colocated_decode = "during_training" if awake_colocated else "pause"
        if awake_colocated:
            choices.append(Choice("colocated_decode", "during_training", "awake engines decode beside training"))
    if oppo.top_up == "auto":
        decodes_through_training = not work.train.colocate_all or oppo.colocated_decode != "pause"
        early = work.train.colocate_all and decodes_through_training and lag >= 2
        oppo.top_up = "step_end" if early else "step_start"
        if early:
            choices.append(Choice("top_up", "step_end", "new prompts decode beside training"))
    extra = 1 if oppo.top_up == "step_end" else 0
    if oppo.max_defer_steps == "auto":
        if lag - extra < 1:
            raise OPPOConfigError(
                f"--oppo.top_up step_end starts prompts a weight version early, so --oppo.max_lag {lag} leaves them "
                "no step to be carried: use --oppo.max_lag 2 or more, or --oppo.top_up step_start."
            )
        oppo.max_defer_steps = lag - extra
    elif "max_lag" not in given:
        oppo.max_lag = max(lag, oppo.max_defer_steps + extra)  # the deferral limit given sets the bound
    elif oppo.max_defer_steps + extra > lag:
        raise OPPOConfigError(
            f"--oppo.max_defer_steps {oppo.max_defer_steps} lets a group train {oppo.max_defer_steps + extra} weight "
            f"versions behind, above --oppo.max_lag {lag}: raise --oppo.max_lag or drop --oppo.max_defer_steps."
        )
    defer = oppo.max_defer_steps
    prompts_left = max(work.data.max_samples - batch, 0) if work.data.max_samples else math.inf
    if oppo.overcommit_max == "auto":
        oppo.overcommit_max = int(min(_delta_max(batch, defer), prompts_left))
        oppo.overcommit_max = max(oppo.overcommit_max, oppo.overcommit_min)
    if oppo.overcommit_inc == "auto":
        oppo.overcommit_inc = max(1, batch // 4)
    if oppo.overcommit_dec == "auto":
        oppo.overcommit_dec = max(1, batch // 8)
    if oppo.overcommit == "auto":
        oppo.overcommit_initial = min(oppo.overcommit_max, max(oppo.overcommit_min, batch))
        choices.append(
            Choice(
                "overcommit",
                f"{oppo.overcommit_initial}..{oppo.overcommit_max}",
                f"max lag {lag}: groups carried up to {defer} steps",
            )
        )
    else:
        oppo.overcommit_initial = oppo.overcommit
    if oppo.overcommit_min > oppo.overcommit_max:
        raise OPPOConfigError(
            f"--oppo.overcommit_min ({oppo.overcommit_min}) is above --oppo.overcommit_max ({oppo.overcommit_max})."
        )


# -- the mechanisms --------------------------------------------------------------------------------------------


def _resolve_mechanisms(work, given, choices) -> None:
    oppo = work.oppo
    policy_streams = "policy" in oppo.streamed_roles
    if oppo.policy_logprobs == "auto":
        engines_can = work.rollout.temperature == 1.0 and not work.vllm.enable_sleep
        oppo.policy_logprobs = "vllm" if policy_streams and oppo.inter_step and engines_can else "policy"
        if oppo.policy_logprobs == "vllm":
            choices.append(Choice("policy_logprobs", "vllm", "the engines score them after the sync, beside decoding"))
    if oppo.state_moves == "auto":
        oppo.state_moves = "serial"  # overlapped moves hold two models' states: only where the memory plan fits them
    if oppo.critic_catch_up == "auto":
        alone = config.critic_catches_up_alone(work)
        oppo.critic_catch_up = "next_batch" if alone else "next_step"
        if alone:
            choices.append(Choice("critic_catch_up", "next_batch", "the only prefill left after the sync"))
    if oppo.frozen_scorers_on == "generation" and "frozen_scorers_on" not in given:
        choices.append(Choice("frozen_scorers_on", "generation", "the frozen scorers prefill beside decoding"))


# -- memory ------------------------------------------------------------------------------------------------------


def gpu_gib(oppo) -> Optional[float]:
    """One GPU's memory: ``--oppo.gpu_memory_gb``, else NVML's reading of the first visible GPU (without a CUDA
    context: the driver must hold no GPU memory), else None (no GPU here: the plan keeps the user's flags)."""
    if oppo.gpu_memory_gb:
        return oppo.gpu_memory_gb
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        return pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
    except Exception:  # noqa: BLE001 - no NVML, no GPU: nothing to plan against
        return None


def _layout(work) -> memory.Layout:
    """What the memory plan needs of ``work``'s choices (its roles resolved on a copy where they are not yet): the
    one derivation of a run's memory layout, during the plan's choices and for the resolved plan."""
    oppo = work.oppo
    if not hasattr(oppo, "streamed_roles"):
        probe = copy.deepcopy(work)
        config.resolve_roles(probe)
        oppo = probe.oppo
    return memory.Layout(
        vllm_awake=not work.vllm.enable_sleep,
        ds_sleep=work.ds.enable_sleep,
        state_moves="overlap" if work.ds.enable_sleep and oppo.state_moves == "overlap" else "serial",
        vllm_share=work.vllm.gpu_memory_utilization,
        streamed_roles=tuple(oppo.streamed_roles),
        cache_budget_gb=oppo.cache_budget_gb,
        frozen_beside_vllm=oppo.frozen_scorers_on == "generation",
        colocated_decode=work.train.colocate_all and not work.vllm.enable_sleep,
        staged_weights=_stages_weights(work),
    )


def _stages_weights(work) -> bool:
    """Engines apart and awake receive the weights into a staging copy while carried requests decode
    (``Plan.staged_sync``); without inter-step overlap nothing decodes through the sync and no copy is made."""
    oppo = work.oppo
    inter_step = oppo.max_lag > 0 and oppo.overcommit != 0
    apart_awake = not work.train.colocate_all and not work.vllm.enable_sleep
    buckets = getattr(work.vllm, "sync_bucket_mb", config.SYNC_BUCKET_MB) > 0
    return inter_step and apart_awake and buckets and oppo.weight_sync == "staged"


# A streamed scorer keeps at least this much KV cache; below it, streaming goes before the cache does.
MIN_CACHE_BUDGET_GB = 0.5
# Which streamed role goes first where the scorers do not fit: the log-prob roles hold float32 logit rows in each
# prefill besides their cache, and the policy's log-probs are also upstream's forward after generation.
STREAM_DROP_ORDER = ("policy", "reference", "critic", "reward")


def _fit_memory(work, args, given, total, choices) -> Optional[MemoryPlan]:
    """OPPO's additions to each GPU's memory where they fit. Where the estimate is over the GPU they go one at a time,
    cheapest loss first (``_drop_extras``), down to the run OpenRLHF itself makes with these flags, which OPPO runs
    whatever the estimate says: an estimate can be wrong, and OpenRLHF would run it. ``--oppo.strict_memory``
    refuses it instead. None where the GPU or a model's shape is unknown (the user's flags then stay)."""
    estimate = _estimate(work, total)
    upstream = _upstream_estimate(args, total)
    if estimate is None or upstream is None:
        return None
    dropped = []
    drops = _drop_extras(work, given)
    while not _fits(estimate, total):
        choice = next(drops, None)
        if choice is None:
            break
        dropped.append(choice)
        estimate = _estimate(work, total)
    choices.extend(dropped)
    memory_plan = MemoryPlan(_layout(work), estimate, upstream, tuple(dropped), strict=work.oppo.strict_memory)
    if memory_plan.strict and not memory_plan.fits:
        raise OPPOConfigError(f"this run does not fit the GPU's {total:.1f} GiB: {memory_plan.warning()}")
    return memory_plan


def _drop_extras(work, given):
    """OPPO's additions to a step's memory, taken back one at a time, cheapest loss first; each yields the
    ``Choice`` that says what went and why. What the user gave stays. vLLM awake beside the models is no addition
    here: ``_plan_colocated_memory`` takes it only where it fits."""
    oppo = work.oppo
    if "cache_budget_gb" not in given:
        while oppo.streamed_roles and oppo.cache_budget_gb > MIN_CACHE_BUDGET_GB:
            oppo.cache_budget_gb /= 2
            yield Choice("cache_budget_gb", oppo.cache_budget_gb, "the scorers' caches fit beside the rest")
    if _stages_weights(work) and "weight_sync" not in given:
        oppo.weight_sync = "paused"
        yield Choice("weight_sync", "paused", "no room for a staging copy of the weights beside vLLM")
    asked = "intra_step" in given and oppo.intra_step == "on"  # not the plan's own "on" for sleeping engines
    if asked or set(config.STREAMING_ONLY) & set(given):
        return  # the user asked for streaming, or tuned it
    for role in STREAM_DROP_ORDER:
        if role in oppo.streamed_roles:
            oppo.streamed_roles = [r for r in oppo.streamed_roles if r != role]
            yield Choice("streaming", f"off for {role}", "its scorer's cache and prefill do not fit")


def _user_layout(args) -> memory.Layout:
    """OpenRLHF's own run with the user's flags, without OPPO's parts."""
    return memory.Layout(
        vllm_awake=not args.vllm.enable_sleep,
        ds_sleep=args.ds.enable_sleep,
        vllm_share=args.vllm.gpu_memory_utilization,
    )


def _upstream_estimate(args, total_gib):
    """The estimate of OpenRLHF's own run with the user's flags, or None where the GPU or a shape is unknown."""
    if total_gib is None:
        return None
    try:
        return memory.estimate(args, _user_layout(args), total_gib)
    except LookupError:
        return None


def _estimate(work, total_gib):
    """The memory plan's estimate of ``work``'s peak per GPU, or None where the models' shapes are unknown."""
    if total_gib is None:
        return None
    try:
        return memory.estimate(work, _layout(work), total_gib)
    except LookupError:  # a model's config cannot be read here (a hub name not in the cache)
        return None


def _plan_colocated_memory(work, total, given, choices, changes) -> None:
    """Under ``--train.colocate_all``: vLLM awake beside the models where it fits, with the DeepSpeed states on the
    GPU where they fit too, else (where the user's flags move them anyway) moved while the other model trains; a
    smaller scorer cache budget (unless given) before a slower layout. Where nothing awake fits, the user's flags stay, streaming where its caches fit.
    """
    oppo = work.oppo
    user = (work.vllm.enable_sleep, work.ds.enable_sleep, work.vllm.gpu_memory_utilization)
    share = _vllm_share_needed(work, total)
    budgets = [oppo.cache_budget_gb] if "cache_budget_gb" in given else [CACHE_BUDGET_GB, 2.0, 1.0]
    # Moving the states off the GPU where the user keeps them there is slower than upstream's own layout in every
    # paired run (docs/results): only a run that already moves them (the hybrid engine) moves them overlapped.
    overlap = work.ds.enable_sleep and oppo.state_moves in ("auto", "overlap")
    overlap = overlap and work.algo.advantage.estimator == "gae"
    candidates = [(False, "vLLM awake, DeepSpeed states on the GPU")]
    if overlap:
        candidates.append((True, "vLLM awake, DeepSpeed states moved while the other model trains"))
    for ds_sleep, what in candidates:
        for budget in budgets:
            probe = copy.deepcopy(work)
            probe.vllm.enable_sleep, probe.ds.enable_sleep, probe.vllm.gpu_memory_utilization = False, ds_sleep, share
            probe.oppo.cache_budget_gb = budget
            probe.oppo.state_moves = "overlap" if ds_sleep else probe.oppo.state_moves
            estimate = _estimate(probe, total)
            if estimate is None:
                return  # the shapes are unknown: the user's flags stay
            if _fits(estimate, total):
                _set(work, changes, "--vllm.enable_sleep", user[0], False)
                _set(work, changes, "--ds.enable_sleep", user[1], ds_sleep)
                _set(work, changes, "--vllm.gpu_memory_utilization", user[2], share)
                oppo.cache_budget_gb = budget
                if ds_sleep and oppo.state_moves == "auto":
                    oppo.state_moves = "overlap"
                choices.append(Choice("placement", what, f"{estimate.worst.peak_gib:.0f} of {total:.0f} GiB"))
                return
    choices.append(Choice("placement", "as given", "vLLM awake does not fit beside the models"))
    if work.vllm.enable_sleep and oppo.intra_step == "auto":
        for budget in budgets:
            probe = copy.deepcopy(work)
            probe.oppo.intra_step, probe.oppo.cache_budget_gb = "on", budget
            estimate = _estimate(probe, total)
            if estimate is not None and _fits(estimate, total):
                oppo.intra_step, oppo.cache_budget_gb = "on", budget
                choices.append(Choice("intra_step", "on", "the scorers' caches fit beside the sleeping engines"))
                return


def _fits(estimate, total: float) -> bool:
    return estimate.worst.peak_gib <= total * (1 - HEADROOM)


def _set(work, changes, flag, given, planned) -> None:
    if given != planned:
        group, name = flag[2:].split(".", 1)
        setattr(getattr(work, group), name, planned)
        changes.append(Change(flag, given, planned))


def _vllm_share_needed(work, total_gib: float) -> float:
    """The smallest vLLM share that holds the policy's weights, its activations and the KV cache of every request
    in flight at the longest length (B + Delta's bound), never above what the user gave."""
    shape = memory.model_shape(work.actor.model_name_or_path)
    given = work.vllm.gpu_memory_utilization
    if shape is None:
        return given
    groups = work.rollout.batch_size + _delta_max(work.rollout.batch_size, _colocated_defer_limit(work.oppo.max_lag))
    sequences = groups * work.rollout.n_samples_per_prompt
    need = 2 * shape.params + sequences * work.data.max_len * shape.kv_bytes_per_token + VLLM_ACTIVATIONS_GIB * 2**30
    share = math.ceil(need / 2**30 / total_gib * 100) / 100
    return min(given, max(MIN_VLLM_SHARE, share))


def _colocated_defer_limit(lag: int) -> int:
    """Awake engines on the models' GPUs start new prompts before training, a version early, where the bound
    leaves them a step to be carried (``_resolve_lag``)."""
    return lag - 1 if lag >= 2 else lag


def _delta_max(batch: int, defer: int) -> int:
    return max(1, min(MAX_DELTA_BATCHES, defer - 1)) * batch


# -- the plan object and its line ------------------------------------------------------------------------------


def _plan_from(work, choices, changes, memory_plan) -> Plan:
    oppo = work.oppo
    inter_step = oppo.inter_step
    return Plan(
        enabled=True,
        topology=topology.of(work, oppo.frozen_scorers_on == "generation"),
        carry=Carry(
            max_lag=oppo.max_lag if inter_step else 0,
            overcommit=Overcommit(
                initial=oppo.overcommit_initial if inter_step else 0,
                auto=oppo.overcommit == "auto",
                rule=oppo.overcommit_rule,
                window=oppo.overcommit_window,
                inc=oppo.overcommit_inc,
                dec=oppo.overcommit_dec,
                minimum=oppo.overcommit_min,
                maximum=oppo.overcommit_max if oppo.overcommit == "auto" else oppo.overcommit,
            ),
            max_defer_steps=oppo.max_defer_steps,
            top_up=oppo.top_up,
            kv=oppo.carry_kv,
            colocated_decode=oppo.colocated_decode,
        ),
        stream=Stream(
            roles=tuple(oppo.streamed_roles),
            chunk_size=None if oppo.chunk_size == "auto" else oppo.chunk_size,
            interval=oppo.stream_interval,
            cache_budget_gb=oppo.cache_budget_gb,
            prefill_calls_in_flight=oppo.prefill_calls_in_flight,
            flush_interval_ms=oppo.flush_interval_ms,
            max_prefill_tokens=oppo.max_prefill_tokens,
            max_prefill_cached_tokens=oppo.max_prefill_cached_tokens,
            policy_logprobs=oppo.policy_logprobs,
            critic_catch_up=oppo.critic_catch_up,
            frozen_scorers_on=oppo.frozen_scorers_on,
        ),
        sync=Sync(
            mode=oppo.weight_sync,
            bucket_mb=getattr(work.vllm, "sync_bucket_mb", config.SYNC_BUCKET_MB),
            state_moves=oppo.state_moves,
            colocate_all=work.train.colocate_all,
            colocate_models=oppo.colocate_models,
            vllm_sleeps=work.vllm.enable_sleep,
        ),
        memory=memory_plan or MemoryPlan(_layout(work)),
        observe=Observe(trace_dir=oppo.trace_dir, profile_step=oppo.profile_step, call_timeout_s=oppo.call_timeout_s),
        choices=tuple(choices),
        upstream_changes=tuple(changes),
    )


def apply_upstream_changes(args, plan: Plan) -> None:
    """The one place that writes the plan into OpenRLHF's own flags: the speed-for-memory ones it changed."""
    for change in plan.upstream_changes:
        group, name = change.flag[2:].split(".", 1)
        setattr(getattr(args, group), name, change.planned)


def describe(plan: Plan) -> str:
    """One line for the log: what OPPO does in this run, and why where the plan chose."""
    stream, carry, sync = plan.stream, plan.carry, plan.sync
    if not plan.enabled:
        return "OPPO off" + (" (models colocated, vLLM apart)" if sync.colocate_models else "")
    parts = [
        (
            f"intra-step streaming to {', '.join(stream.roles)} ({stream.cache_budget_gb:g} GiB of cache each)"
            if stream.roles
            else "no streaming"
        )
    ]
    if sync.colocate_models:
        parts.append(
            f"reward and reference on the {'engines' if stream.frozen_scorers_on == 'generation' else 'models'}' GPUs"
        )
    if plan.inter_step:
        delta = carry.overcommit
        span = f"{delta.initial}..{delta.maximum}" if delta.auto else str(delta.initial)
        parts.append(
            f"max lag {carry.max_lag}: Delta {span}, carried up to {carry.max_defer_steps} steps, carry_kv "
            f"{carry.kv}, top-up at {carry.top_up.replace('_', ' ')}"
            + {
                "after_fit": ", the critic's catch-up after its fit",
                "next_batch": ", the critic's catch-up of the next batch after its fit",
            }.get(stream.critic_catch_up, "")
            + (", decoding beside training" if sync.colocate_all and carry.colocated_decode != "pause" else "")
            + (" (not beside making experiences)" if plan.resumes_for_training else "")
        )
    else:
        parts.append("no inter-step overlap")
    if stream.policy_logprobs == "vllm" and "policy" in stream.roles:
        parts.append("the policy's log-probs from vLLM")
    if sync.state_moves == "overlap":
        parts.append("state moves overlapped")
    if plan.upstream_changes:
        parts.append(
            "changed " + ", ".join(f"{c.flag} {_shown(c.given)} -> {_shown(c.planned)}" for c in plan.upstream_changes)
        )
    if plan.memory.estimated:
        parts.append(plan.memory.line())
    return "OPPO on: " + "; ".join(parts)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)
