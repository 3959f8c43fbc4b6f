"""The rollout actor: upstream's ``RolloutRayActor`` that streams each response in chunks while it decodes.

A ``SampleStream`` per sample collects the engine's DELTA outputs and hands every ``chunk_size`` tokens to
``ChunkOutbox``, which batches them into one ``oppo_prefill`` call per scoring actor. Generation never waits
for the scorers: the experience maker flushes the outboxes and collects the scores.

The actor also keeps requests across weight updates (pause, resume, sleep without aborting) and salts prompts
with the weight version, so that no prefix-cache entry of old weights serves a new request. The trainer's
calls on its critical path run on a thread of their own (``CONTROL``): the event loop also runs vLLM's output
handler and every request's coroutine, and can fall far behind while a batch of requests goes in.
"""

import asyncio
import contextvars
import threading
import time
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import ray
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, SingleTurnAgentExecutor
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.utils import random_uuid

from openrlhf_oppo.protocol import Chunk, ResourceReading, ScorerStats, StreamInfo, StreamSettings
from openrlhf_oppo.streaming.engine_logprobs import EngineLogprobs
from openrlhf_oppo.streaming.reaper import end_children_with_this_process
from openrlhf_oppo.trace import Tracer
from openrlhf_oppo.weight_sync import WeightSyncRolloutMixin

# The sample that the running ``executor.execute`` task is generating (one task per sample).
_CURRENT_SAMPLE: contextvars.ContextVar[Optional["SampleStream"]] = contextvars.ContextVar(
    "sample_stream", default=None
)
# The trainer's calls on its critical path run on a thread of their own (see the module's docstring).
CONTROL = "control"
CONCURRENCY_GROUPS = {CONTROL: 1}


@dataclass
class RolloutConfig:
    """What the rollout actor needs to know when it is built (the rest arrives with ``oppo_connect``)."""

    stream_interval: int = 1  # --oppo.stream_interval: tokens per streamed output of a request
    # extension.set_sampling_params_hook: (sampling_params, label) -> the sampling params of that prompt's samples
    sampling_params_hook: Optional[Callable] = None
    # extension.set_engine_kwargs: vLLM engine arguments over upstream's (kv_cache_memory_bytes, say)
    engine_kwargs: Optional[dict] = None


class ChunkOutbox:
    """Per-destination queues of chunks, sent as one ``oppo_prefill`` call per scoring actor.

    Every chunk of a sequence goes to the rank ``assign`` gave it: the one pinned for this engine (a frozen
    scorer on its GPU), else the least loaded (tokens sent of its live sequences, plus one chunk each, since
    sequences start before any token is out). At most ``calls_in_flight`` calls go to one actor, so that chunks
    pile up and batch better when it falls behind. Chunks of ``held`` roles only queue: their GPUs are training
    and their weights about to change.
    """

    def __init__(
        self,
        scorers: Dict[str, List],
        pinned: Dict[str, int],
        calls_in_flight: int,
        flush_interval_s: float,
    ):
        self.scorers = scorers  # role -> actor handles of its ranks
        self.pinned = pinned
        self.calls_in_flight = calls_in_flight
        self.flush_interval_s = flush_interval_s
        self.held = set()  # roles whose chunks wait
        self._load = {role: [0] * len(ranks) for role, ranks in scorers.items()}  # per rank, see ``assign``
        self._queues: Dict[tuple, List[Chunk]] = {}
        self._in_flight: Dict[tuple, set] = {}
        # ``hold`` and ``flush`` run on the control thread, the rest on the event loop.
        self._lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._flusher = self._loop.create_task(self._flush_loop())

    def assign(self, chunk_size: int) -> Dict[str, int]:
        """The rank of each role that will score a new sequence (of chunks of ``chunk_size`` tokens)."""
        with self._lock:
            ranks = {
                role: self.pinned[role] if role in self.pinned else load.index(min(load))
                for role, load in self._load.items()
            }
            for role, rank in ranks.items():
                self._load[role][rank] += chunk_size
        return ranks

    def put(self, chunk: Chunk, ranks: Dict[str, int]) -> None:
        with self._lock:
            for role, rank in ranks.items():
                self._queues.setdefault((role, rank), []).append(chunk)
                self._load[role][rank] += len(chunk.tokens)
        self._wake.set()

    def finished(self, ranks: Dict[str, int], tokens: int, chunk_size: int) -> None:
        """A sequence of ``tokens`` tokens sent its last chunk: it no longer loads its ranks."""
        with self._lock:
            for role, rank in ranks.items():
                self._load[role][rank] -= tokens + chunk_size

    def hold(self, roles) -> None:
        """Queue the chunks of ``roles`` until they are released (an empty list releases them all). Once this
        returns, no call goes to a held role until ``flush`` sends one (from any thread)."""
        with self._lock:
            self.held = set(roles)
        self._loop.call_soon_threadsafe(self._wake.set)  # whatever waited goes now, if released

    def flush(self, uids=None, roles=None) -> List[Tuple[str, ray.ObjectRef]]:
        """Send the queued chunks of ``uids`` (all if None) for ``roles`` (all if None) now, held or not; return
        every call not yet done, with the scoring actor it went to (``"reward rank 1"``). Safe from any thread."""
        with self._lock:
            for key in list(self._queues):
                if roles is not None and key[0] not in roles:
                    continue
                if uids is None:
                    self._send(key)
                    continue
                now = [chunk for chunk in self._queues[key] if chunk.uid in uids]
                later = [chunk for chunk in self._queues[key] if chunk.uid not in uids]
                self._queues[key] = now
                self._send(key)
                if later:
                    self._queues[key] = later
            return [(f"{role} rank {rank}", ref) for (role, rank), refs in self._in_flight.items() for ref in refs]

    async def _flush_loop(self):
        while True:
            await self._wake.wait()
            self._wake.clear()
            # The chunks of one engine step arrive together: give the rest of them a moment.
            await asyncio.sleep(self.flush_interval_s)
            with self._lock:
                for key in list(self._queues):
                    if key[0] not in self.held and len(self._in_flight.get(key, ())) < self.calls_in_flight:
                        self._send(key)

    def _send(self, key) -> None:
        """One prefill call with the queued chunks of ``key`` (under the lock)."""
        chunks = self._queues.pop(key, None)
        if not chunks:
            return
        role, rank = key
        ref = self.scorers[role][rank].oppo_prefill.remote(chunks)
        self._in_flight.setdefault(key, set()).add(ref)
        asyncio.run_coroutine_threadsafe(self._landed(key, ref), self._loop)

    async def _landed(self, key, ref):
        try:
            await ref
        except Exception:  # noqa: BLE001 - the trainer sees the error when it waits on the call
            pass
        with self._lock:
            self._in_flight[key].discard(ref)
        self._wake.set()  # chunks that waited for this call go now

    def close(self):
        self._flusher.cancel()


@dataclass(eq=False)  # identity hash: streams live in a set
class SampleStream:
    """The tokens of one sample, cut into chunks as they arrive (none are sent without an ``outbox``)."""

    uid: str
    outbox: Optional[ChunkOutbox]
    chunk_size: int
    prompt_len: int = -1
    ranks: Dict[str, int] = field(default_factory=dict)  # role -> the rank that scores this sequence
    sent: List[int] = field(default_factory=list)  # tokens already handed to the outbox
    pending: List[int] = field(default_factory=list)
    first_version: Optional[int] = None
    last_version: Optional[int] = None
    last_token_time: float = 0.0
    replaced_uid: Optional[str] = None  # the stream closed by ``finish`` when the sample was edited
    engine_ranks: Dict[str, int] = field(default_factory=dict)  # role -> this engine, for roles it scores itself

    def __post_init__(self):
        if self.outbox is not None:
            self.ranks = self.outbox.assign(self.chunk_size)

    def begin_turn(self, prompt_token_ids: List[int], version: int) -> None:
        """A generate call starts: its prompt extends the sequence (multi-turn agents add feedback)."""
        if self.prompt_len < 0:
            self.prompt_len = len(prompt_token_ids)
            self.first_version = version
        known = len(self.sent) + len(self.pending)
        self.pending.extend(prompt_token_ids[known:])

    def extend(self, token_ids: List[int], version: int) -> None:
        self.pending.extend(token_ids)
        self.last_version = version
        self.last_token_time = time.time()
        if self.outbox is not None and len(self.pending) >= self.chunk_size:
            self._emit(final=False)

    def _emit(self, final: bool, last_of_sample: bool = True) -> None:
        self.outbox.put(Chunk(self.uid, len(self.sent), self.pending, self.prompt_len, final), self.ranks)
        self.sent.extend(self.pending)
        self.pending = []
        if final:
            # The sample's ranks keep the chunk reserved at ``assign`` while a replacement stream follows.
            self.outbox.finished(self.ranks, len(self.sent), self.chunk_size if last_of_sample else 0)

    def finish(self, final_tokens: List[int]) -> None:
        """Queue the last chunk: the sequence is exactly ``final_tokens`` (what training sees)."""
        if self.outbox is None:  # scored by the engine alone
            self.sent, self.pending = list(final_tokens), []
            return
        known = self.sent + self.pending
        if final_tokens[: len(known)] != known:
            # The sample was edited after generation (truncated, or an agent rewrote it). Close the
            # stream that no longer matches (freeing its caches) and score what training sees, in full.
            self._emit(final=True, last_of_sample=False)
            self.replaced_uid = self.uid
            self.uid, self.sent = f"{self.uid}-full", []
        self.pending = list(final_tokens[len(self.sent) :])
        self._emit(final=True)

    def info(self) -> StreamInfo:
        """What the trainer needs to know of the sample (after ``finish`` when streamed)."""
        return StreamInfo(
            uid=self.uid,
            prompt_len=self.prompt_len,
            first_version=self.first_version,
            last_version=self.last_version,
            last_token_time=self.last_token_time,
            length=len(self.sent),
            ranks={**self.ranks, **self.engine_ranks},
            replaced_uid=self.replaced_uid,
        )


class OPPORolloutActor(WeightSyncRolloutMixin, RolloutRayActor.__ray_actor_class__):
    """``RolloutRayActor`` with chunk streaming, weight versions, keep-alive pause/sleep and bucketed weight
    sync (``weight_sync``)."""

    async def __init__(self, *args, oppo_config: Optional[dict] = None, **kwargs):
        self.loop = asyncio.get_running_loop()  # the actor's event loop (the control calls run on another)
        self.oppo_config = RolloutConfig(**(oppo_config or {}))
        # An output every ``stream_interval`` tokens (vLLM's --stream-interval) spares this process one output per
        # token and request; config keeps it at most the smallest chunk.
        kwargs.update(self.oppo_config.engine_kwargs or {})
        await super().__init__(*args, stream_interval=self.oppo_config.stream_interval, **kwargs)
        end_children_with_this_process()  # the engine core, should this actor die without a shutdown
        self.tracer = Tracer(enabled=False, process="rollout")  # on with oppo_connect(trace=True)
        self.chunk_size = 64
        self.weight_version = 0
        self.outbox: Optional[ChunkOutbox] = None
        self.streaming = True  # off while evaluating: nobody collects the scores of evaluation samples
        self.salt_prompts = False  # set by oppo_connect when requests outlive weight updates
        self.active_requests, self.active_since = 0, 0.0
        self.streams = set()  # samples being generated
        self.hf_tokenizer = None  # sent once (oppo_set_tokenizer) rather than with every call
        self.engine_index = 0
        self.policy_logprobs: Optional[EngineLogprobs] = None  # --oppo.policy_logprobs vllm

    # -- set-up from the trainer ---------------------------------------------------------------

    async def oppo_connect(
        self,
        scorers: Dict[str, List],
        pinned: Dict[str, int],
        settings: StreamSettings,
        engine_index: int = 0,
        score_policy: bool = False,
    ) -> None:
        """Stream to ``scorers`` (role -> actor handle per rank) from now on, as ``settings`` say; ``pinned``:
        role -> the rank that scores every sequence of this engine. ``score_policy``: this engine,
        ``engine_index`` among them, scores the policy's log-probs itself. With ``settings.trace`` it records
        spans for ``oppo_drain_trace`` (``--oppo.trace_dir``)."""
        await self.oppo_disconnect()
        self.tracer.enabled = settings.trace
        if scorers:
            self.outbox = ChunkOutbox(scorers, pinned, settings.calls_in_flight, settings.flush_interval_s)
        self.chunk_size = settings.chunk_size
        self.salt_prompts = settings.salt_prompts
        self.engine_index = engine_index
        if score_policy:
            self.policy_logprobs = EngineLogprobs(
                self.llm, lambda: self.weight_version, settings.salt_prompts, self.tracer
            )

    async def oppo_disconnect(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
        self.outbox = None
        if self.policy_logprobs is not None:
            self.policy_logprobs.discard(list(self.policy_logprobs.finished))
        self.policy_logprobs = None

    def oppo_set_tokenizer(self, hf_tokenizer) -> None:
        self.hf_tokenizer = hf_tokenizer

    def oppo_set_streaming(self, enabled: bool) -> None:
        """Stream the samples started from now on (``True``) or not. Samples in flight keep their setting."""
        self.streaming = enabled

    def oppo_set_chunk_size(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    @ray.method(concurrency_group=CONTROL)
    def oppo_hold(self, roles) -> None:
        """Keep the chunks of ``roles`` queued; send the others' as they come (``[]`` releases all)."""
        if self.outbox is not None:
            self.outbox.hold(roles)
        if self.policy_logprobs is not None:
            # Its scoring tasks live on the event loop; a score started meanwhile is redone if the weights change.
            self.loop.call_soon_threadsafe(self.policy_logprobs.hold, "policy" in roles)

    # -- the policy's log-probs, where this engine scores them (the policy role's "rank" is the engine) --

    async def oppo_collect(self, uids) -> dict:
        return await self.policy_logprobs.collect(uids)

    def oppo_discard(self, uids) -> None:
        self.policy_logprobs.discard(uids)

    @ray.method(concurrency_group=CONTROL)
    def oppo_stats(self) -> ScorerStats:
        return self.policy_logprobs.stats()

    @ray.method(concurrency_group=CONTROL)
    def oppo_flush(self, uids=None, roles=None) -> List[Tuple[str, ray.ObjectRef]]:
        """Send the queued chunks of ``uids`` (all if None) for ``roles`` (all if None) now; return the prefill
        calls still running, each with the scoring actor it went to (wait on them before collecting scores).
        Where this engine scores the policy, its finished sequences among ``uids`` are scored now too, held or
        not (``collect`` waits for them)."""
        if self.policy_logprobs is not None and uids is not None and (roles is None or "policy" in roles):
            self.loop.call_soon_threadsafe(self.policy_logprobs.score, list(uids))
        if self.outbox is None:
            return []
        return self.outbox.flush(set(uids) if uids is not None else None, set(roles) if roles is not None else None)

    @ray.method(concurrency_group=CONTROL)
    def oppo_drain_trace(self) -> list:
        return self.tracer.drain()

    @ray.method(concurrency_group=CONTROL)
    def oppo_resources(self) -> ResourceReading:
        return ResourceReading.of_this_process()

    def oppo_in_flight(self) -> Dict[str, int]:
        """Tokens generated so far by each sample still running here (streamed samples only)."""
        return {stream.uid: len(stream.sent) + len(stream.pending) - stream.prompt_len for stream in self.streams}

    # -- weight updates with requests in flight ------------------------------------------------

    async def oppo_pause(self, clear_cache: bool) -> None:
        """Freeze every request; ``clear_cache`` drops their KV so they re-prefill on resume."""
        await self.llm.pause_generation(mode="keep", clear_cache=clear_cache)

    async def oppo_unpause(self) -> None:
        """Restart the requests ``oppo_pause`` froze, with the weights they have (no weight sync in between)."""
        await self.llm.resume_generation()

    async def oppo_resume(self, weight_version: int, resume: bool = True) -> None:
        self.weight_version = weight_version
        if resume:
            await self.llm.resume_generation()
        if self.policy_logprobs is not None and not self.policy_logprobs.held:
            self.policy_logprobs.refresh()

    async def sleep(self, level=1):
        # Upstream sleeps with vLLM's default mode "abort", which would end carried requests. "keep"
        # freezes them; their KV is dropped with the rest and re-prefilled on wake-up.
        await self.llm.sleep(level=level, mode="keep")

    # -- generation ------------------------------------------------------------------------------

    async def generate_responses(
        self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1, images=None
    ):
        hf_tokenizer = hf_tokenizer if hf_tokenizer is not None else self.hf_tokenizer
        if hf_tokenizer is None:
            raise ValueError("generate_responses needs hf_tokenizer, or oppo_set_tokenizer first")
        if self.oppo_config.sampling_params_hook is not None:
            sampling_params = self.oppo_config.sampling_params_hook(sampling_params, label)
        samples = [
            self._generate_sample(prompt, label, sampling_params, max_length, hf_tokenizer, images)
            for _ in range(num_samples)
        ]
        return await asyncio.gather(*samples)

    async def _generate_sample(self, prompt, label, sampling_params, max_length, hf_tokenizer, images):
        stream = SampleStream(random_uuid(), self.outbox if self.streaming else None, self.chunk_size)
        if self.streaming and self.policy_logprobs is not None:
            stream.engine_ranks["policy"] = self.engine_index
        _CURRENT_SAMPLE.set(stream)  # this coroutine runs as its own task: the value stays in it
        self.streams.add(stream)
        try:
            response = await self.executor.execute(
                prompt=prompt,
                label=label,
                sampling_params=sampling_params,
                max_length=max_length,
                hf_tokenizer=hf_tokenizer,
                llm_engine=self,
                images=images,
            )
        finally:
            self.streams.discard(stream)
        if stream.outbox is not None or stream.engine_ranks:
            # The samples generator truncates to max_length; score exactly what training sees.
            stream.finish(response["observation_tokens"][:max_length])
        if stream.engine_ranks and self.policy_logprobs is not None:
            self.policy_logprobs.add(stream.uid, stream.sent, stream.prompt_len, stream.first_version)
        response["stream_info"] = stream.info()
        return response

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        stream = _CURRENT_SAMPLE.get()
        self._track_activity(+1)
        try:
            if stream is not None and (stream.outbox is not None or self.salt_prompts or stream.engine_ranks):
                return await self._generate_streamed(stream, prompt_token_ids, sampling_params, multi_modal_data)
            result = await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
            if stream is not None:
                stream.first_version = stream.last_version = self.weight_version
                stream.last_token_time = time.time()
            return result
        finally:
            self._track_activity(-1)

    def _track_activity(self, change: int) -> None:
        """Trace one 'generate' span per stretch of time with requests in this engine."""
        if change > 0 and self.active_requests == 0:
            self.active_since = time.time()
        self.active_requests += change
        if self.active_requests == 0:
            self.tracer.add("generate", self.active_since, time.time(), track="engine")

    async def _generate_streamed(self, stream, prompt_token_ids, sampling_params, multi_modal_data):
        """Upstream's ``generate`` with DELTA outputs fed to ``stream``; returns the same final output."""
        if multi_modal_data and self._mm_pad_token_ids:
            from openrlhf.utils.vlm_utils import dedup_media_tokens

            prompt_token_ids = dedup_media_tokens(prompt_token_ids, self._mm_pad_token_ids)
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        if self.salt_prompts:
            prompt["cache_salt"] = f"oppo-w{self.weight_version}"
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        params = deepcopy(sampling_params)
        params.output_kind = RequestOutputKind.DELTA
        if type(self.executor) is SingleTurnAgentExecutor and not params.stop:
            # vLLM detokenizes in this process, on the event loop that answers the trainer. The single-turn executor
            # reads token ids only (patches/openrlhf/0012 skips it upstream too); stop strings and multi-turn agents
            # need the text.
            params.detokenize = False

        stream.begin_turn(prompt_token_ids, self.weight_version)
        token_ids, logprobs, text = [], [], []
        final_output = None
        async for output in self.llm.generate(prompt, params, request_id=random_uuid()):
            delta = output.outputs[0]
            token_ids.extend(delta.token_ids)
            text.append(delta.text)
            if delta.logprobs is not None:
                logprobs.extend(delta.logprobs)
            stream.extend(list(delta.token_ids), self.weight_version)
            final_output = output

        # Rebuild the cumulative output upstream's executors read.
        completion = final_output.outputs[0]
        completion.token_ids = token_ids
        completion.text = "".join(text)
        completion.logprobs = logprobs if sampling_params.logprobs is not None else None
        return final_output


def with_config(actor_class, config: RolloutConfig):
    """``actor_class`` as upstream's ``create_vllm_engines`` uses it, with ``config`` bound into the build."""
    return BoundActorClass(actor_class, dict(oppo_config=vars(config)))


class BoundActorClass:
    """Stands in for a Ray actor class in ``create_vllm_engines``: ``.options(...).remote(**kwargs)`` gets
    our extra keyword arguments. Upstream has no hook to pass them (patches/openrlhf adds one)."""

    def __init__(self, actor_class, extra_kwargs):
        self.actor_class = actor_class
        self.extra_kwargs = extra_kwargs

    def options(self, **options):
        return BoundActorClass(self.actor_class.options(**options), self.extra_kwargs)

    def remote(self, *args, **kwargs):
        return self.actor_class.remote(*args, **kwargs, **self.extra_kwargs)

    @property
    def __ray_metadata__(self):
        # Read where a Ray actor class is expected: the actors' class name, for the line naming a failed actor.
        return self.actor_class.__ray_metadata__


OPPORolloutRayActor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(OPPORolloutActor)
