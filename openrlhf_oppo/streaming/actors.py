"""Upstream's policy, critic, reward and reference actors, able to score streamed chunks.

Each subclass adds the scoring side of OPPO's protocol (``oppo_*``, called by the rollout actors and by
the trainer's ``StreamCoordinator``) on top of a ``ChunkScorer`` over the actor's own model; nothing else
changes: upstream's ``forward`` still serves whatever was not streamed. The critic and the policy train
every step, so their ``fit`` bumps the scorer's weight version: sequences still streaming re-prefill under
the new weights, and finished scores computed with old weights are recomputed before they are collected.
Under ZeRO-3 the critic's and the policy's scorers run on a full copy of the weights, gathered again after
each ``fit`` (``zero3.py``); the frozen reward and reference models load their weights unsharded instead.

Finished scores wait in ``oppo_finished`` until the trainer collects them, or discards those that training
will never ask for (``oppo_discard``).

A scorer whose prefill runs out of GPU memory stops streaming for the rest of the run (``_stream_off``). Its
KV caches and prefill activations are memory that OPPO adds to upstream's; a run upstream would finish should not
end there, and upstream's forward after generation already scores every sequence without a streamed score. The
memory would run out again on the same workload, so the scorer does not retry: it frees everything it held,
ignores later chunks, answers None for every sequence it is asked for, and says so in ``oppo_stats``.

The trainer's reads of counters, memory and traces (``oppo_stats``, ``oppo_resources``, ``oppo_drain_trace``)
run in a concurrency group of their own, on a thread of their own. In the actor's one thread they would wait
behind every prefill call queued before them, and the end of each step waits for them. They only read, and what they read is safe to
read while a prefill runs (``ChunkScorer.drain_calls``, ``cached_bytes``).

The run's plan (``plan.Plan``) reaches each actor as a constructor argument.
"""

import contextlib
import gc
import os
import time

import ray
import torch
from openrlhf.trainer.ray.launcher import ReferenceModelActor, RewardModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
from openrlhf.trainer.ray.ppo_critic import CriticModelActor

from openrlhf_oppo.plan import OFF, Plan
from openrlhf_oppo.protocol import Chunk, ResourceReading, ScorerSettings, ScorerStats, cuda_in_use
from openrlhf_oppo.streaming.scorer import ChunkScorer, unwrap_model
from openrlhf_oppo.streaming.zero3 import InferenceCopy, is_partitioned
from openrlhf_oppo.trace import Tracer, profiled
from openrlhf_oppo.weight_sync import WeightSyncPolicyMixin

# The trainer's reads run on a thread of their own (see the module's docstring).
REPORT = "oppo_report"
CONCURRENCY_GROUPS = {REPORT: 1}


def cpu_adam_threads(args) -> int:
    """CPU threads for each rank that trains with ``--ds.adam_offload``: the host's cores shared evenly among the
    policy's and the critic's ranks on it (the same as ``launcher.cpu_adam_threads`` of patch 0011)."""
    ranks = args.actor.num_gpus_per_node
    if args.critic.model_name_or_path:
        ranks += args.critic.num_gpus_per_node
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def _rank() -> int:
    """This actor's rank in its model's group."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class PhasePeaks:
    """The most GPU memory a process's PyTorch allocator held during each phase of a step, over the run.

    ``with peaks.phase("training"): ...`` resets the allocator's peak counters on entry and keeps the larger of
    the old and new peaks on exit. The phases of one actor run one at a time on its main thread (the reads run
    on another thread but only copy ``by_phase``), so the counters belong to the phase around them."""

    def __init__(self):
        self.by_phase: Dict[str, Tuple[int, int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        cuda = cuda_in_use()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            if cuda:
                allocated, reserved = self.by_phase.get(name, (0, 0))
                self.by_phase[name] = (
                    max(allocated, torch.cuda.max_memory_allocated()),
                    max(reserved, torch.cuda.max_memory_reserved()),
                )


class StreamingScorerMixin:
    """The ``oppo_*`` methods of a scoring actor. Subclasses say which module scores."""

    oppo_scorer: ChunkScorer = None
    oppo_copy: InferenceCopy = None  # the weights the scorer runs on, under ZeRO-3
    oppo_plan: Plan = OFF
    oppo_streaming_off = False  # a prefill ran out of GPU memory: nothing is streamed here any more

    def __init__(self, *args, plan: Plan = None, **kwargs):
        super().__init__(*args, **kwargs)
        # The run's plan (extension.configure binds it); a group built without one behaves as OPPO's defaults.
        self.oppo_plan = plan or OFF
        self.oppo_peaks = PhasePeaks()

    def forward(self, *args, **kwargs):
        """Upstream's make_experience forward of whatever was not streamed, its memory peak recorded."""
        with self.oppo_peaks.phase("make_experience"):
            return super().forward(*args, **kwargs)

    def oppo_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def oppo_setup(self, role: str, settings: ScorerSettings) -> None:
        """Build the scorer (after ``init_model_from_pretrained``)."""
        self.oppo_role = role
        model = unwrap_model(self.oppo_model())
        # Under ZeRO-3 one rank cannot run a forward alone: stream on a full copy of the weights.
        self.oppo_copy = InferenceCopy(model, role) if is_partitioned(model) else None
        self.oppo_scorer = ChunkScorer(
            model if self.oppo_copy is None else self.oppo_copy.module,
            role,
            cache_budget_bytes=settings.cache_budget_bytes,
            temperature=settings.temperature,
            max_tokens_per_forward=settings.max_tokens_per_forward,
            max_cached_tokens_per_forward=settings.max_cached_tokens_per_forward,
        )
        self.oppo_tracer = Tracer(enabled=settings.trace, process=f"{role} scorer")
        self.oppo_finished = {}  # uid -> ScoredSequence, until the trainer collects it
        self.oppo_discarded = set()  # uids discarded before their last chunk landed (tombstones)

    def oppo_prefill(self, chunks) -> int:
        """Prefill a batch of chunks (from one rollout actor); keep the scores of sequences that ended."""
        self._process(self._rescore_stale() + list(chunks))
        return len(chunks)

    def oppo_collect(self, uids) -> dict:
        """The scores of these finished sequences (None for one this actor has not finished), every one
        computed with the current weights."""
        self._process(self._rescore_stale())
        return {uid: self.oppo_finished.pop(uid, None) for uid in uids}

    def oppo_discard(self, uids) -> None:
        """Forget these sequences: training will never collect them (dropped by dynamic filtering, or
        replaced by a ``-full`` stream). Left in ``oppo_finished`` they would stay for the whole run and be
        re-scored after every weight update.

        A uid not finished here yet gets a tombstone: its last chunk may still be queued in a rollout
        actor (the discard can overtake it), and its result is dropped when it lands.
        """
        if self.oppo_streaming_off:
            return  # nothing is kept, and no chunk will land
        for uid in uids:
            if uid in self.oppo_finished:
                del self.oppo_finished[uid]
            else:
                self.oppo_discarded.add(uid)
        self.oppo_scorer.release(uids)

    def _rescore_stale(self) -> list:
        """Sequences that ended before the last weight update, to score again with the new weights.

        (A sample can end in one step and be trained in a later one: its group was carried over.)
        """
        version = self.oppo_scorer.version
        stale = [r for r in self.oppo_finished.values() if r is not None and r.version != version]
        return [Chunk(r.uid, 0, r.tokens, r.prompt_len, final=True) for r in stale]

    def _process(self, chunks) -> None:
        if not chunks or self.oppo_streaming_off:
            return
        try:
            results = self._score(chunks)
        except torch.OutOfMemoryError as error:
            results, reason = None, str(error).partition("\n")[0]
        if results is None:
            # After the except clause: until it ends, the error's traceback holds the failed forward's tensors.
            self._stream_off(chunks, reason)
            return
        for uid, result in results.items():
            if uid in self.oppo_discarded:
                self.oppo_discarded.discard(uid)
            else:
                self.oppo_finished[uid] = result

    def _score(self, chunks) -> dict:
        module = self.oppo_scorer.model
        was_training = module.training
        module.eval()
        try:
            with self.oppo_tracer.span("prefill", track=self.oppo_role, chunks=len(chunks)):
                with self.oppo_peaks.phase("generation"):
                    return self.oppo_scorer.process(chunks)
        finally:
            module.train(was_training)

    def _stream_off(self, chunks, reason: str) -> None:
        """No more streaming on this rank (the module's docstring says why): the scores and caches it held are
        dropped, so that the memory is there for upstream's forward and for training. Under ZeRO-3 the gathered
        copy goes too; its ``refresh`` after each fit still joins the other ranks' gathers."""
        self.oppo_streaming_off = True
        self.oppo_scorer.close()
        if self.oppo_copy is not None:
            self.oppo_copy.release()
        self.oppo_finished.clear()
        self.oppo_discarded.clear()
        gc.collect()
        if cuda_in_use():
            torch.cuda.empty_cache()
        role = f"{self.oppo_role} rank {_rank()}"
        sequences, tokens = len({chunk.uid for chunk in chunks}), sum(len(chunk.tokens) for chunk in chunks)
        print(
            f"[openrlhf-oppo] warning: {role} ran out of GPU memory prefilling {tokens} tokens of {sequences} "
            f"sequences ({reason}): streaming off for {role} for the rest of the run: its micro-batches are scored "
            "after generation",
            flush=True,
        )

    @ray.method(concurrency_group=REPORT)
    def oppo_stats(self) -> ScorerStats:
        """Counters since set-up, and the prefill calls since the last report."""
        scorer = self.oppo_scorer
        return ScorerStats(
            calls=scorer.drain_calls(),
            busy_s=scorer.stats["busy_s"],
            streamed_tokens=scorer.stats["streamed_tokens"],
            final_tokens=scorer.stats["final_tokens"],
            forwards=scorer.stats["forwards"],
            evictions=scorer.stats["evictions"],
            cached_bytes=scorer.cached_bytes(),
            waiting=len(self.oppo_finished),
            tombstones=len(self.oppo_discarded),
            streaming_off=self.oppo_streaming_off,
        )

    @ray.method(concurrency_group=REPORT)
    def oppo_resources(self) -> ResourceReading:
        return ResourceReading.of_this_process(self.oppo_peaks.by_phase)

    @ray.method(concurrency_group=REPORT)
    def oppo_drain_trace(self) -> list:
        return self.oppo_tracer.drain()


class _TrainableScorerMixin(StreamingScorerMixin):
    oppo_trained_role: str = None  # "critic" or "policy"
    oppo_fits = 0  # training steps this actor has run

    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        # --- OPPO change (patch 0011 makes it in upstream's _setup_distributed): Ray starts an actor whose CPU
        # share is below one core with OMP_NUM_THREADS=1, and PyTorch, whose OpenMP runtime DeepSpeed's CPU Adam
        # shares, takes one thread from it. Set before the optimizer exists, for every call after this one. ---
        if strategy.args.ds.adam_offload:
            torch.set_num_threads(cpu_adam_threads(strategy.args))
        super().init_model_from_pretrained(strategy, *args, **kwargs)

    def fit(self, *args, **kwargs):
        started = time.time()
        self.oppo_fits += 1
        with self._oppo_profiler(), self.oppo_peaks.phase("training"):
            status = super().fit(*args, **kwargs)
        return self._after_fit(status, started)

    def _oppo_profiler(self):
        """``--oppo.profile_step N``: torch.profiler around this rank's N-th fit."""
        oppo = self.oppo_plan
        if not oppo.observe.profile_step or oppo.observe.profile_step != self.oppo_fits:
            return contextlib.nullcontext()
        name = f"profile_{self.oppo_trained_role}_rank{_rank()}_step{self.oppo_fits:05d}.json"
        return profiled(os.path.join(oppo.observe.trace_dir, name))

    def _after_fit(self, status: dict, started: float) -> dict:
        """The scorer moves to the new weights. The step's timing/ppo_train spans both models training side
        by side and the trainer's calls; oppo/<role>_fit_s is this model's own training, to tell which one
        sets the phase and what is overhead."""
        if self.oppo_scorer is not None:
            if self.oppo_copy is not None:
                self.oppo_copy.refresh()  # fit runs on every rank of the model: the gathers line up
            self.oppo_scorer.bump_version()
            self.oppo_tracer.add("fit", started, time.time(), track=self.oppo_role)
        status[f"oppo/{self.oppo_trained_role}_fit_s"] = time.time() - started
        return status


class _FrozenScorerMixin(StreamingScorerMixin):
    oppo_frozen_role: str = None  # "reward" or "reference"

    def init_model_from_pretrained(self, strategy, pretrain):
        # --- OPPO change: upstream shards a frozen model under ZeRO-3, and every forward all-gathers each layer
        # from all its ranks. A streaming rank scores alone, on the full weights (an InferenceCopy, kept beside the
        # shard). Frozen weights never need gathering again, so a streamed frozen model loads them whole, as
        # upstream does under ZeRO-1/2 (DeepSpeed stage 0 for inference): one copy a rank, no collectives. ---
        if strategy.stage == 3 and self.oppo_frozen_role in self.oppo_plan.stream.roles:
            strategy.stage = 0  # this actor's own strategy: the other models keep ZeRO-3
        super().init_model_from_pretrained(strategy, pretrain)

    def oppo_model(self):
        return self.model


class StreamingRewardModelActor(_FrozenScorerMixin, RewardModelActor.__ray_actor_class__):
    oppo_frozen_role = "reward"


class StreamingReferenceModelActor(_FrozenScorerMixin, ReferenceModelActor.__ray_actor_class__):
    oppo_frozen_role = "reference"


class StreamingCriticModelActor(_TrainableScorerMixin, CriticModelActor.__ray_actor_class__):
    oppo_trained_role = "critic"

    def oppo_model(self):
        return self.critic


class StreamingPolicyModelActor(WeightSyncPolicyMixin, _TrainableScorerMixin, PolicyModelActor.__ray_actor_class__):
    oppo_trained_role = "policy"

    def oppo_model(self):
        return self.actor

    def broadcast_to_vllm(self):
        with self.oppo_peaks.phase("weight_sync"):
            return super().broadcast_to_vllm()


# Upstream declares these with @ray.remote(num_gpus=1); RayActorGroup overrides the GPUs per placement.
_remote = ray.remote(num_gpus=1, concurrency_groups=CONCURRENCY_GROUPS)
StreamingRewardModelRayActor = _remote(StreamingRewardModelActor)
StreamingReferenceModelRayActor = _remote(StreamingReferenceModelActor)
StreamingCriticModelRayActor = _remote(StreamingCriticModelActor)
StreamingPolicyModelRayActor = _remote(StreamingPolicyModelActor)
