"""The policy's log-probs from the rollout engine itself (``--oppo.policy_logprobs vllm``).

A batch's policy log-probs must come from the weights it trains on. Where a batch decodes while the models
train, the policy's ranks can only prefill it after the weight sync, beside the critic; by then vLLM holds the
same weights and is idle. So the engine scores each finished sequence with vLLM's prompt log-probs (a one-token
request over prompt and response), moving the policy's prefill to the engines' GPUs.

Pitfalls: vLLM's kernels are not the training forward's, so in bf16 these match upstream's only to kernel noise
(``docs/design.md``, "Equal scores"); prompt log-probs come from raw logits, so the temperature must be 1 (the
plan checks it); vLLM refuses a prompt that fills ``max_model_len``, so a response cut at the length limit gets no
score here and the experience maker scores it with the policy's forward.

A sequence scored with older weights than the engine's when it is collected is scored again. Nothing is scored
while the policy's chunks are held (training); the trainer releases them once the weight sync ends.
"""

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.utils import random_uuid

from openrlhf_oppo.protocol import ScoredSequence, ScorerStats
from openrlhf_oppo.trace import Tracer


@dataclass
class _Finished:
    tokens: List[int]
    prompt_len: int
    first_version: int  # the weight version its sample started with
    task: Optional[asyncio.Task] = None
    version: int = -1  # the weight version ``task`` scores with


@dataclass
class EngineLogprobs:
    """The policy's log-probs of this engine's finished sequences, scored by ``llm`` (vLLM's ``AsyncLLM``)."""

    llm: object
    weight_version: Callable[[], int]  # the version of the weights the engine holds now
    salt_prompts: bool = False  # requests outlive weight updates: keep these off older weights' cache blocks
    tracer: Tracer = field(default_factory=lambda: Tracer(enabled=False, process="rollout"))
    held: bool = False
    finished: Dict[str, _Finished] = field(default_factory=dict)
    # Stretches with a request of ours in the engine, as (start, seconds, tokens), since the last ``stats``:
    # the requests run side by side, so their own durations would add up to more than the engine's time.
    calls: List[Tuple[float, float, int]] = field(default_factory=list)
    busy_s: float = 0.0
    _calls_lock: threading.Lock = field(default_factory=threading.Lock)
    scored_tokens: int = 0
    _running: int = 0
    _running_since: float = 0.0
    _running_tokens: int = 0
    max_model_len: int = field(init=False)  # the engine's: a longer prompt leaves no room for a decoded token

    def __post_init__(self):
        self.max_model_len = self.llm.model_config.max_model_len

    def add(self, uid: str, tokens: List[int], prompt_len: int, first_version: int) -> None:
        """A sample finished: score ``tokens`` (what training sees) now, unless held."""
        self.finished[uid] = _Finished(list(tokens), prompt_len, first_version)
        if not self.held:
            self._start(uid)

    def hold(self, held: bool) -> None:
        """Score nothing while ``held``; once released, score what finished meanwhile or went stale."""
        self.held = held
        if not held:
            self.refresh()

    def refresh(self) -> None:
        """Score again, with the current weights, every sequence scored with older ones, oldest samples first:
        the next step trains the groups carried longest first, and vLLM schedules requests as they arrive."""
        self.score(sorted(self.finished, key=lambda uid: self.finished[uid].first_version))  # stable: finish order

    def score(self, uids) -> None:
        """Score these finished sequences with the engine's current weights now, held or not (the next batch's,
        after a weight sync: the others are scored when they are collected or released)."""
        for uid in uids:
            if uid in self.finished:
                self._start(uid)

    async def collect(self, uids) -> Dict[str, Optional[ScoredSequence]]:
        """The scores of these sequences (None for one this engine did not finish), all with the current
        weights: a sequence not scored yet, or scored with older weights, is scored now."""
        self.score(uids)  # all at once: the engine batches them
        results = {}
        for uid in uids:
            entry = self.finished.get(uid)
            results[uid] = None if entry is None else await self._current(uid, entry)
            self.finished.pop(uid, None)
        return results

    async def _current(self, uid: str, entry: _Finished) -> ScoredSequence:
        """The sequence's score with the engine's current weights (a sync landing meanwhile scores it again)."""
        while True:
            self._start(uid)
            task = entry.task
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():  # replaced by a newer version's task
                    continue
                raise
            if result.version == self.weight_version():
                return result

    def discard(self, uids) -> None:
        for uid in uids:
            entry = self.finished.pop(uid, None)
            if entry is not None and entry.task is not None:
                entry.task.cancel()

    def stats(self) -> ScorerStats:
        with self._calls_lock:  # read on the rollout actor's control thread, appended on its event loop
            calls, self.calls = self.calls, []
        return ScorerStats(
            calls=calls,
            busy_s=self.busy_s,
            streamed_tokens=0,
            final_tokens=self.scored_tokens,
            forwards=0,
            evictions=0,
            cached_bytes=0,
            waiting=len(self.finished),
            tombstones=0,
        )

    def _start(self, uid: str) -> None:
        entry, version = self.finished[uid], self.weight_version()
        if entry.task is not None and entry.version == version:
            return
        if entry.task is not None:
            entry.task.cancel()
        entry.version = version
        entry.task = asyncio.get_running_loop().create_task(self._score(uid, entry, version))

    async def _score(self, uid: str, entry: _Finished, version: int) -> ScoredSequence:
        if len(entry.tokens) >= self.max_model_len:
            return ScoredSequence(
                uid=uid, output=None, length=len(entry.tokens), prompt_len=entry.prompt_len, version=version
            )
        prompt = TokensPrompt(prompt_token_ids=entry.tokens)
        if self.salt_prompts:
            prompt["cache_salt"] = f"oppo-w{version}"
        # One decoded token, and the log-prob of every prompt token under the engine's weights (0: none of
        # the other candidates). vLLM reads no cached blocks for such a request.
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        self._begin(len(entry.tokens))
        try:
            final = None
            async for output in self.llm.generate(prompt, params, request_id=f"oppo-logprobs-{random_uuid()}"):
                final = output
        finally:
            end = self._end()
        positions = range(entry.prompt_len, len(entry.tokens))
        logprobs = torch.tensor(
            [final.prompt_logprobs[i][entry.tokens[i]].logprob for i in positions], dtype=torch.float32
        )
        self.scored_tokens += len(entry.tokens)
        return ScoredSequence(
            uid=uid,
            output=logprobs,
            length=len(entry.tokens),
            prompt_len=entry.prompt_len,
            version=version,
            prefilled=[(end, len(entry.tokens))],
        )

    def _begin(self, tokens: int) -> None:
        if self._running == 0:
            self._running_since, self._running_tokens = time.time(), 0
        self._running += 1
        self._running_tokens += tokens

    def _end(self) -> float:
        self._running -= 1
        end = time.time()
        if self._running == 0:
            start = self._running_since
            with self._calls_lock:
                self.calls.append((start, end - start, self._running_tokens))
            self.busy_s += end - start
            self.tracer.add("policy_logprobs", start, end, track="engine")
        return end
