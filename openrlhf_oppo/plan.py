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

import math
import os
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from openrlhf_oppo import config, memory, plan_checks, topology
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.memory import Layout
from openrlhf_oppo.streaming.chunking import CANDIDATES as CHUNK_CANDIDATES
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
# --oppo.stream_interval auto: a request's tokens reach the rollout actor this many at a time (vLLM's default is 1).
STREAM_INTERVAL = 16


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

    @property
    def inter_step(self) -> bool:
        return self.overcommit.auto or self.overcommit.initial > 0


@dataclass(frozen=True)
class Stream:
    """Intra-step streaming: the models that score response chunks while vLLM decodes, and how."""

    roles: Tuple[str, ...] = ()
    # --oppo.intra_step as the run has it: the user's, or the plan's own 'on' where the scorers' caches fit beside
    # sleeping engines (``Plan.streams``: whether that streams).
    intra_step: str = "off"
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
    """The weight sync, the DeepSpeed state moves around it, and the placement and OpenRLHF's speed-for-memory
    flags as the run has them (after ``apply_upstream_changes``)."""

    mode: str = "staged"  # --oppo.weight_sync
    bucket_mb: int = config.SYNC_BUCKET_MB
    state_moves: str = "serial"
    colocate_all: bool = False
    colocate_models: bool = False
    vllm_sleeps: bool = False  # --vllm.enable_sleep
    ds_sleeps: bool = False  # --ds.enable_sleep
    vllm_share: float = 0.9  # --vllm.gpu_memory_utilization

    @property
    def engines_decode_through_sync(self) -> bool:
        """vLLM on GPUs of its own and awake: carried requests decode while the weights are sent."""
        return not self.colocate_all and not self.vllm_sleeps


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
        return self.carry.inter_step

    @property
    def staged_sync(self) -> bool:
        return _stages_weights(self.carry, self.sync)

    @property
    def pauses_after_generation(self) -> bool:
        """Awake engines on the models' GPUs pause their carried requests while the step makes its experiences."""
        return self.sync.colocate_all and not self.sync.vllm_sleeps and self.carry.colocated_decode != "continue"

    @property
    def resumes_for_training(self) -> bool:
        return self.pauses_after_generation and self.carry.colocated_decode == "during_training"

    @property
    def streams(self) -> bool:
        """Intra-step streaming is on for the run, which it stays where no model's scorer fits (no ``stream.roles``)."""
        return _streams(self.stream.intra_step, self.sync)

    @property
    def top_up_while_paused(self) -> bool:
        """``--oppo.top_up step_end`` on engines that pause while the step makes its experiences and decode beside
        training: the engines pause first, then take the next step's prompts, which wait queued in them and start
        the moment training does. Added before the pause, the pause would wait behind them (the rollout actor's
        event loop takes a few hundred new requests in before it answers); added as training starts, they would
        start late and still be decoding at the weight sync, which then waits for the engines to stop."""
        return self.carry.top_up == "step_end" and self.resumes_for_training


def _stages_weights(carry: Carry, sync: Sync) -> bool:
    """Engines apart and awake receive the weights into a staging copy while carried requests decode; without
    inter-step overlap nothing decodes through the sync and no copy is made."""
    return sync.bucket_mb > 0 and carry.inter_step and sync.engines_decode_through_sync and sync.mode == "staged"


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
    """Each sub-plan from the parsed flags (read, never written) and the sub-plans it follows from; the checks of
    the combination run once on the result."""
    opts = config.values(args.oppo)
    plan_checks.check_options(args, opts)
    if not opts.enable:
        return Plan(
            topology=topology.of(args),
            sync=Sync(colocate_all=args.train.colocate_all, colocate_models=opts.colocate_models),
            memory=MemoryPlan(_user_layout(args)),
        )
    total = gpu_gib(opts)
    sync, cache_budget_gb, intra_step, placed, changes = _placement(args, opts, total)
    carry, carried = _carry(args, opts, sync)
    stream = _stream(args, opts, sync, intra_step, cache_budget_gb)
    # Before the scoring choices: those that follow from the streamed roles follow from the ones that fit.
    stream, sync, memory_plan = _fit_memory(args, opts, carry, stream, sync, total)
    stream, scored = _scoring(args, opts, carry, stream, sync)
    plan = Plan(
        enabled=True,
        topology=topology.of(args, stream.frozen_scorers_on == "generation"),
        carry=carry,
        stream=stream,
        sync=sync,
        memory=memory_plan,
        observe=Observe(trace_dir=opts.trace_dir, profile_step=opts.profile_step, call_timeout_s=opts.call_timeout_s),
        choices=tuple(placed + list(memory_plan.dropped) + carried + scored),
        upstream_changes=tuple(changes),
    )
    plan_checks.check_plan(args, opts, plan)
    return plan


# -- the placement as the run has it ------------------------------------------------------------------------------


def _placement(args, opts, total):
    """The sync sub-plan with OpenRLHF's speed-for-memory flags as the run will have them, and the scorers' cache
    budget and ``--oppo.intra_step`` that go with them: the user's, or under ``--train.colocate_all`` what the
    memory plan fits (``_colocated_memory``). Returns (sync, cache budget, intra_step, choices, changes)."""
    sync = Sync(
        mode=opts.weight_sync,
        bucket_mb=getattr(args.vllm, "sync_bucket_mb", config.SYNC_BUCKET_MB),
        state_moves="serial" if opts.state_moves == "auto" else opts.state_moves,
        colocate_all=args.train.colocate_all,
        colocate_models=opts.colocate_models,
        vllm_sleeps=args.vllm.enable_sleep,
        ds_sleeps=args.ds.enable_sleep,
        vllm_share=args.vllm.gpu_memory_utilization,
    )
    budget = CACHE_BUDGET_GB if opts.cache_budget_gb is None else opts.cache_budget_gb
    if not (args.train.colocate_all and opts.memory_flags == "plan" and total is not None):
        return sync, budget, opts.intra_step, [], []
    return _colocated_memory(args, opts, sync, budget, total)


def _colocated_memory(args, opts, sync, budget, total):
    """Under ``--train.colocate_all``: vLLM awake beside the models where it fits, with the DeepSpeed states on the
    GPU where they fit too, else (where the user's flags move them anyway) moved while the other model trains; a
    smaller scorer cache budget (unless given) before a slower layout. Where nothing awake fits, the user's flags
    stay, streaming where its caches fit."""
    share = _vllm_share_needed(args, opts, total)
    budgets = [budget] if "cache_budget_gb" in opts.given else [CACHE_BUDGET_GB, 2.0, 1.0]
    # Moving the states off the GPU where the user keeps them there is slower than upstream's own layout in every
    # paired run (docs/results): only a run that already moves them (the hybrid engine) moves them overlapped.
    overlap = sync.ds_sleeps and opts.state_moves in ("auto", "overlap")
    overlap = overlap and args.algo.advantage.estimator == "gae"
    candidates = [(False, "vLLM awake, DeepSpeed states on the GPU")]
    if overlap:
        candidates.append((True, "vLLM awake, DeepSpeed states moved while the other model trains"))
    for ds_sleeps, what in candidates:
        state_moves = "overlap" if ds_sleeps else sync.state_moves
        awake = replace(sync, vllm_sleeps=False, ds_sleeps=ds_sleeps, vllm_share=share, state_moves=state_moves)
        for candidate_budget in budgets:
            estimate = _estimate(args, _candidate_layout(args, opts.intra_step, awake, candidate_budget), total)
            if estimate is None:
                return sync, budget, opts.intra_step, [], []  # the shapes are unknown: the user's flags stay
            if _fits(estimate, total):
                choice = Choice("placement", what, f"{estimate.worst.peak_gib:.0f} of {total:.0f} GiB")
                return awake, candidate_budget, opts.intra_step, [choice], _changes(sync, awake)
    choices = [Choice("placement", "as given", "vLLM awake does not fit beside the models")]
    # Streaming beside the sleeping engines, where a model of the run can stream at all.
    if sync.vllm_sleeps and opts.intra_step == "auto" and _streamed_roles(args, "on", sync):
        for candidate_budget in budgets:
            estimate = _estimate(args, _candidate_layout(args, "on", sync, candidate_budget), total)
            if estimate is not None and _fits(estimate, total):
                choices.append(Choice("intra_step", "on", "the scorers' caches fit beside the sleeping engines"))
                return sync, candidate_budget, "on", choices, []
    return sync, budget, opts.intra_step, choices, []


def _candidate_layout(args, intra_step: str, sync: Sync, cache_budget_gb: float) -> Layout:
    """The layout of a candidate placement on the models' GPUs, every model that would stream streaming (no weights
    are staged there, whatever the lag)."""
    stream = Stream(roles=_streamed_roles(args, intra_step, sync), cache_budget_gb=cache_budget_gb)
    return _layout(Carry(), stream, sync)


def _changes(given: Sync, planned: Sync) -> list:
    """The OpenRLHF flags the plan changed from what the user gave."""
    pairs = [
        ("--vllm.enable_sleep", given.vllm_sleeps, planned.vllm_sleeps),
        ("--ds.enable_sleep", given.ds_sleeps, planned.ds_sleeps),
        ("--vllm.gpu_memory_utilization", given.vllm_share, planned.vllm_share),
    ]
    return [Change(flag, before, after) for flag, before, after in pairs if before != after]


# -- the lag bound -------------------------------------------------------------------------------------------


def _carry(args, opts, sync: Sync):
    """Delta, the deferral limit and the top-up from ``--oppo.max_lag``. Returns (carry, choices).

    A group dispatched after a step's weight sync and carried d steps trains d versions behind; one dispatched
    before the sync (``top_up step_end``) one more. So the deferral limit D is the lag bound, or one less with the
    top-up at the step's end. Delta up to (D - 1) batches keeps every group within D (the sampler takes the
    groups by deadline); at most ``MAX_DELTA_BATCHES`` batches. A bound the other options leave no room in is
    refused by the checks (``plan_checks``)."""
    lag, batch = opts.max_lag, args.rollout.batch_size
    if lag == 0 or opts.overcommit == 0:
        off = Overcommit(
            rule=opts.overcommit_rule,
            window=opts.overcommit_window,
            inc=1 if opts.overcommit_inc == "auto" else opts.overcommit_inc,
            dec=1 if opts.overcommit_dec == "auto" else opts.overcommit_dec,
            minimum=opts.overcommit_min,
        )
        top_up = "step_start" if opts.top_up == "auto" else opts.top_up
        decode = "pause" if opts.colocated_decode == "auto" else opts.colocated_decode
        return Carry(overcommit=off, top_up=top_up, kv=opts.carry_kv, colocated_decode=decode), []
    choices = []
    awake_colocated = sync.colocate_all and not sync.vllm_sleeps
    decode = opts.colocated_decode
    if decode == "auto":
        decode = "during_training" if awake_colocated else "pause"
        if awake_colocated:
            choices.append(Choice("colocated_decode", "during_training", "awake engines decode beside training"))
    top_up = opts.top_up
    if top_up == "auto":
        decodes_through_training = not sync.colocate_all or decode != "pause"
        early = sync.colocate_all and decodes_through_training and lag >= 2
        top_up = "step_end" if early else "step_start"
        if early:
            choices.append(Choice("top_up", "step_end", "new prompts decode beside training"))
    extra = 1 if top_up == "step_end" else 0
    defer = opts.max_defer_steps
    if defer == "auto":
        defer = lag - extra
    elif "max_lag" not in opts.given:
        lag = max(lag, defer + extra)  # the deferral limit given sets the bound
    prompts_left = max(args.data.max_samples - batch, 0) if args.data.max_samples else math.inf
    maximum = opts.overcommit_max
    if maximum == "auto":
        maximum = max(int(min(_delta_max(batch, defer), prompts_left)), opts.overcommit_min)
    if opts.overcommit == "auto":
        initial = min(maximum, max(opts.overcommit_min, batch))
        choices.append(
            Choice("overcommit", f"{initial}..{maximum}", f"max lag {lag}: groups carried up to {_steps(defer)}")
        )
    else:
        initial = maximum = opts.overcommit
    overcommit = Overcommit(
        initial=initial,
        auto=opts.overcommit == "auto",
        rule=opts.overcommit_rule,
        window=opts.overcommit_window,
        inc=max(1, batch // 4) if opts.overcommit_inc == "auto" else opts.overcommit_inc,
        dec=max(1, batch // 8) if opts.overcommit_dec == "auto" else opts.overcommit_dec,
        minimum=opts.overcommit_min,
        maximum=maximum,
    )
    return Carry(lag, overcommit, defer, top_up, opts.carry_kv, decode), choices


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _delta_max(batch: int, defer: int) -> int:
    return max(1, min(MAX_DELTA_BATCHES, defer - 1)) * batch


# -- streaming -----------------------------------------------------------------------------------------------------


def _streams(intra_step: str, sync: Sync) -> bool:
    """'auto' streams unless the engines sleep on the scoring models' GPUs (the hybrid engine): their share of the
    GPU is set for vLLM alone there, and the scorers' KV caches would have to fit beside it (``_colocated_memory``
    turns it on there where they fit)."""
    hybrid_engine = sync.colocate_all and sync.vllm_sleeps
    return intra_step == "on" or intra_step == "auto" and not hybrid_engine


def _streamed_roles(args, intra_step: str, sync: Sync) -> Tuple[str, ...]:
    """Every model of the run (``topology.models``) where streaming is on, the policy only where its GPUs are idle
    during generation (the engines apart)."""
    if not _streams(intra_step, sync):
        return ()
    return tuple(role for role in topology.models(args) if role != "policy" or not sync.colocate_all)


def _stream(args, opts, sync: Sync, intra_step: str, cache_budget_gb: float) -> Stream:
    """The streamed roles, where the frozen ones run, and the streaming's tuning; who scores the policy's log-probs
    and when the critic catches up follow once the memory plan has kept the roles that fit (``_scoring``)."""
    roles = _streamed_roles(args, intra_step, sync)
    frozen = opts.frozen_scorers_on
    if frozen == "auto":
        frozen = "generation" if _frozen_beside_vllm_applies(args, opts, roles) else "models"
    # Chunks are cut from the engine's outputs: an interval larger than the smallest chunk would grow it.
    smallest_chunk = CHUNK_CANDIDATES[0] if opts.chunk_size == "auto" else opts.chunk_size
    return Stream(
        roles=roles,
        intra_step=intra_step,
        chunk_size=None if opts.chunk_size == "auto" else opts.chunk_size,
        interval=min(STREAM_INTERVAL, smallest_chunk) if opts.stream_interval == "auto" else opts.stream_interval,
        cache_budget_gb=cache_budget_gb,
        prefill_calls_in_flight=opts.prefill_calls_in_flight,
        flush_interval_ms=opts.flush_interval_ms,
        max_prefill_tokens=opts.max_prefill_tokens,
        max_prefill_cached_tokens=opts.max_prefill_cached_tokens,
        frozen_scorers_on=frozen,
    )


def _frozen_beside_vllm_applies(args, opts, roles) -> bool:
    """'auto': the frozen models go beside vLLM where they stream and the placement has room for them. Where
    vLLM's share of its GPUs leaves no room (OpenRLHF's default 0.95), the log says what would."""
    if not opts.colocate_models or not {"reward", "reference"} & set(roles):
        return False
    try:
        plan_checks.check_frozen_beside_vllm(args, opts)
    except OPPOConfigError:
        share = args.vllm.gpu_memory_utilization
        if share > plan_checks.FROZEN_BESIDE_VLLM_MAX_UTILIZATION:
            print(
                "[openrlhf-oppo] --oppo.frozen_scorers_on auto keeps the reward and reference models on the models' "
                f"GPUs: --vllm.gpu_memory_utilization {share:g} leaves them no room beside vLLM (at most "
                f"{plan_checks.FROZEN_BESIDE_VLLM_MAX_UTILIZATION} would).",
                flush=True,
            )
        return False
    return True


def _scoring(args, opts, carry: Carry, stream: Stream, sync: Sync):
    """Who scores the policy's log-probs, when the critic catches up, and the frozen scorers' place as a choice.
    Returns (stream, choices)."""
    inter_step = carry.inter_step
    choices = []
    policy_logprobs = opts.policy_logprobs
    if policy_logprobs == "auto":
        engines_can = args.rollout.temperature == 1.0 and not sync.vllm_sleeps
        policy_logprobs = "vllm" if "policy" in stream.roles and inter_step and engines_can else "policy"
        if policy_logprobs == "vllm":
            choices.append(Choice("policy_logprobs", "vllm", "the engines score them after the sync, beside decoding"))
    critic_catch_up = opts.critic_catch_up
    if critic_catch_up == "auto":
        # The critic's catch-up of the next batch starts after its fit where it is the only prefill left after the
        # sync (the engines score the policy's log-probs) and the models stay awake through training, as after_fit
        # and next_batch need (the policy streams only apart from vLLM, not under --train.colocate_all).
        alone = inter_step and policy_logprobs == "vllm" and {"policy", "critic"} <= set(stream.roles)
        alone = alone and not sync.ds_sleeps
        critic_catch_up = "next_batch" if alone else "next_step"
        if alone:
            choices.append(Choice("critic_catch_up", "next_batch", "the only prefill left after the sync"))
    if stream.frozen_scorers_on == "generation" and "frozen_scorers_on" not in opts.given:
        choices.append(Choice("frozen_scorers_on", "generation", "the frozen scorers prefill beside decoding"))
    return replace(stream, policy_logprobs=policy_logprobs, critic_catch_up=critic_catch_up), choices


# -- memory ------------------------------------------------------------------------------------------------------


def gpu_gib(opts) -> Optional[float]:
    """One GPU's memory: ``--oppo.gpu_memory_gb``, else NVML's reading of the first visible GPU (without a CUDA
    context: the driver must hold no GPU memory), else None (no GPU here: the plan keeps the user's flags)."""
    if opts.gpu_memory_gb:
        return opts.gpu_memory_gb
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        return pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
    except Exception:  # noqa: BLE001 - no NVML, no GPU: nothing to plan against
        return None


def _layout(carry: Carry, stream: Stream, sync: Sync) -> Layout:
    """What the memory estimate needs of a run's sub-plans: the one derivation of its memory layout, for the plan's
    candidates and for the resolved plan."""
    return Layout(
        vllm_awake=not sync.vllm_sleeps,
        ds_sleep=sync.ds_sleeps,
        state_moves="overlap" if sync.ds_sleeps and sync.state_moves == "overlap" else "serial",
        vllm_share=sync.vllm_share,
        streamed_roles=stream.roles,
        cache_budget_gb=stream.cache_budget_gb,
        frozen_beside_vllm=stream.frozen_scorers_on == "generation",
        colocated_decode=sync.colocate_all and not sync.vllm_sleeps,
        staged_weights=_stages_weights(carry, sync),
    )


# A streamed scorer keeps at least this much KV cache; below it, streaming goes before the cache does.
MIN_CACHE_BUDGET_GB = 0.5
# Which streamed role goes first where the scorers do not fit: the log-prob roles hold float32 logit rows in each
# prefill besides their cache, and the policy's log-probs are also upstream's forward after generation.
STREAM_DROP_ORDER = ("policy", "reference", "critic", "reward")


def _fit_memory(args, opts, carry: Carry, stream: Stream, sync: Sync, total):
    """OPPO's additions to each GPU's memory where they fit. Where the estimate is over the GPU they go one at a time,
    cheapest loss first (``_leaner``), down to the run OpenRLHF itself makes with these flags, which OPPO runs
    whatever the estimate says: an estimate can be wrong, and OpenRLHF would run it (``--oppo.strict_memory``
    refuses it instead, in ``plan_checks``). Where the GPU or a model's shape is unknown the plan has no estimate,
    and keeps what it has. Returns (stream, sync, memory plan)."""
    layout = _layout(carry, stream, sync)
    estimate = _estimate(args, layout, total)
    upstream = _estimate(args, _user_layout(args), total)  # OpenRLHF's own run with the user's flags
    if estimate is None or upstream is None:
        return stream, sync, MemoryPlan(layout)
    dropped = []
    for leaner_stream, leaner_sync, choice in _leaner(opts, carry, stream, sync):
        if _fits(estimate, total):
            break
        stream, sync = leaner_stream, leaner_sync
        dropped.append(choice)
        layout = _layout(carry, stream, sync)
        estimate = _estimate(args, layout, total)
    return stream, sync, MemoryPlan(layout, estimate, upstream, tuple(dropped), strict=opts.strict_memory)


def _leaner(opts, carry: Carry, stream: Stream, sync: Sync):
    """OPPO's additions to a step's memory, taken back one at a time, cheapest loss first: each yields the leaner
    (stream, sync) and the ``Choice`` that says what went and why. What the user gave stays. vLLM awake beside the
    models is no addition here: ``_colocated_memory`` takes it only where it fits."""
    if "cache_budget_gb" not in opts.given:
        while stream.roles and stream.cache_budget_gb > MIN_CACHE_BUDGET_GB:
            stream = replace(stream, cache_budget_gb=stream.cache_budget_gb / 2)
            yield stream, sync, Choice(
                "cache_budget_gb", stream.cache_budget_gb, "the scorers' caches fit beside the rest"
            )
    if _stages_weights(carry, sync) and "weight_sync" not in opts.given:
        sync = replace(sync, mode="paused")
        yield stream, sync, Choice("weight_sync", "paused", "no room for a staging copy of the weights beside vLLM")
    asked = "intra_step" in opts.given and opts.intra_step == "on"  # not the plan's own "on" for sleeping engines
    if asked or set(config.STREAMING_ONLY) & opts.given:
        return  # the user asked for streaming, or tuned it
    for role in STREAM_DROP_ORDER:
        if role in stream.roles:
            stream = replace(stream, roles=tuple(r for r in stream.roles if r != role))
            yield stream, sync, Choice("streaming", f"off for {role}", "its scorer's cache and prefill do not fit")


def _user_layout(args) -> Layout:
    """OpenRLHF's own run with the user's flags, without OPPO's parts."""
    return Layout(
        vllm_awake=not args.vllm.enable_sleep,
        ds_sleep=args.ds.enable_sleep,
        vllm_share=args.vllm.gpu_memory_utilization,
    )


def _estimate(args, layout: Layout, total_gib):
    """The memory estimate of ``layout``'s peak per GPU, or None where the GPU or the models' shapes are unknown."""
    if total_gib is None:
        return None
    try:
        return memory.estimate(args, layout, total_gib)
    except LookupError:  # a model's config cannot be read here (a hub name not in the cache)
        return None


def _fits(estimate, total: float) -> bool:
    return estimate.worst.peak_gib <= total * (1 - HEADROOM)


def _vllm_share_needed(args, opts, total_gib: float) -> float:
    """The smallest vLLM share that holds the policy's weights, its activations and the KV cache of every request
    in flight at the longest length (B + Delta's bound), never above what the user gave."""
    shape = memory.model_shape(args.actor.model_name_or_path)
    given = args.vllm.gpu_memory_utilization
    if shape is None:
        return given
    batch = args.rollout.batch_size
    groups = batch + _delta_max(batch, _colocated_defer_limit(opts.max_lag))
    sequences = groups * args.rollout.n_samples_per_prompt
    need = 2 * shape.params + sequences * args.data.max_len * shape.kv_bytes_per_token + VLLM_ACTIVATIONS_GIB * 2**30
    share = math.ceil(need / 2**30 / total_gib * 100) / 100
    return min(given, max(MIN_VLLM_SHARE, share))


def _colocated_defer_limit(lag: int) -> int:
    """Awake engines on the models' GPUs start new prompts before training, a version early, where the bound
    leaves them a step to be carried (``_carry``)."""
    return lag - 1 if lag >= 2 else lag


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
            f"max lag {carry.max_lag}: Delta {span}, carried up to {_steps(carry.max_defer_steps)}, carry_kv "
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
