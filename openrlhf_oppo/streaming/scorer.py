"""Chunked prefill with a KV cache per sequence, for the models that score a rollout.

The rollout actor streams every response in chunks while it decodes. A ``ChunkScorer`` prefills each
chunk into its sequence's own KV cache as soon as it arrives, so that when the sequence ends only its
last chunk is left to score. Chunks of many sequences share one padded forward pass.

The outputs are the ones upstream's full forward computes (``RewardModel.forward``,
``CriticModel.forward``, ``Actor.forward``), position by position, by role:

* ``reward``: the value head at the last token (normalised as upstream does in eval mode);
* ``critic``: the value head at positions ``prompt_len - 1 .. length - 2``;
* ``policy`` and ``reference``: the log-probability of token ``j + 1`` from the logits at ``j``, same
  positions. The first token of a chunk is scored from the previous chunk's last hidden state.
"""

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch
from transformers import DynamicCache

from openrlhf_oppo.protocol import ROLES, Chunk, ScoredSequence


@dataclass
class _Sequence:
    prompt_len: int
    admitted: int  # admission order, used to pick eviction victims
    version: int
    tokens: List[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys/values are in ``keys``/``values``
    keys: Optional[torch.Tensor] = None  # (layers, kv_heads, capacity, head_dim)
    values: Optional[torch.Tensor] = None
    last_hidden: Optional[torch.Tensor] = None  # hidden state at position ``cached - 1``
    outputs: List[torch.Tensor] = field(default_factory=list)
    evicted: bool = False  # the cache was dropped: score the whole sequence when it ends
    broken: bool = False  # a chunk went missing: leave the sequence to the upstream path
    prefilled: List[tuple] = field(default_factory=list)  # (time, tokens) of each call that ran it

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass
class _Work:
    seq: _Sequence
    uid: str
    tokens: List[int]  # tokens to run now, starting at position ``seq.cached``
    final: bool


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face module inside an OpenRLHF ``Actor`` and/or a DeepSpeed engine."""
    from openrlhf.models import Actor

    if isinstance(model, Actor):
        model = model.model
    return getattr(model, "module", model)


class ChunkScorer:
    """Scores streamed sequences for one model.

    Args:
        model: the Hugging Face module: a ``RewardModel``/``CriticModel`` built by
            ``get_llm_for_sequence_regression`` or a causal LM (the policy or the reference).
        role: ``policy``, ``critic``, ``reward`` or ``reference`` (what it outputs follows from it).
        cache_budget_bytes: keys and values held for all sequences together. Past it, the most
            recently started sequences lose their cache and are scored in full when they end.
        temperature: the sampling temperature, which ``Actor`` divides the logits by.
        max_tokens_per_forward: new tokens (padded) per forward pass; larger batches are split. Bounds the
            activations of one pass, and how long one pass holds the GPU.
        max_cached_tokens_per_forward: padded cache tokens gathered for one forward pass (the gathered
            keys and values are a copy of that size).
        max_logit_rows: positions whose float32 logits (policy, reference) exist at once.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        role: str,
        cache_budget_bytes: int,
        temperature: float = 1.0,
        max_tokens_per_forward: int = 16384,
        max_cached_tokens_per_forward: int = 65536,
        max_logit_rows: int = 2048,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.model = model
        self.role = role
        self.log_probs = role in ("policy", "reference")
        self.base = getattr(model, model.base_model_prefix)
        if self.log_probs:
            self.head = model.get_output_embeddings()
        else:
            self.head = getattr(model, model.value_head_prefix)
        self.temperature = temperature
        self.cache_budget_bytes = cache_budget_bytes
        self.max_tokens_per_forward = max_tokens_per_forward
        self.max_cached_tokens_per_forward = max_cached_tokens_per_forward
        self.max_logit_rows = max_logit_rows
        self.version = 0  # bumped whenever the model's weights change
        self._sequences: Dict[str, _Sequence] = {}
        self._admissions = itertools.count()
        self.stats = dict(streamed_tokens=0, final_tokens=0, forwards=0, evictions=0, busy_s=0.0)
        self.calls: List[tuple] = []
        self._calls_lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def cached_bytes(self) -> int:
        # A copy first: the trainer reads this on another thread while ``process`` adds and drops sequences.
        return sum(_nbytes(s.keys) + _nbytes(s.values) for s in list(self._sequences.values()))

    def bump_version(self) -> None:
        """Call after the weights change: caches built before are re-prefilled on their next chunk."""
        self.version += 1

    def release(self, uids: Iterable[str]) -> None:
        for uid in uids:
            self._sequences.pop(uid, None)

    def close(self) -> None:
        """Drop every sequence and the model: this scorer prefills nothing more. Its counters stay for the
        reports; the model stays alive only where its owner keeps it."""
        self._sequences = {}
        self.model = self.base = self.head = None

    @torch.no_grad()
    def process(self, chunks: List[Chunk]) -> Dict[str, ScoredSequence]:
        """Prefill ``chunks`` and return the scores of the sequences that ended with them."""
        started_at, started = time.time(), time.perf_counter()
        work = [self._plan(chunk) for chunk in _merge_consecutive(chunks)]
        self._enforce_budget([w for w in work if not w.seq.broken])

        runnable = [w for w in work if w.tokens and not w.seq.broken]
        for batch in self._batches(runnable):
            self._forward(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the time below is the GPU's, not the launch queue's
        now = time.time()
        for w in runnable:
            w.seq.prefilled.append((now, len(w.tokens)))
        results = {w.uid: self._finish(w) for w in work if w.final}
        seconds = time.perf_counter() - started
        self.stats["busy_s"] += seconds
        with self._calls_lock:
            self.calls.append((started_at, seconds, sum(len(w.tokens) for w in runnable)))
        return results

    def drain_calls(self) -> List[tuple]:
        """(wall-clock start, seconds, new tokens) of each ``process`` call since the last drain."""
        with self._calls_lock:  # the trainer drains on another thread than the one ``process`` runs on
            calls, self.calls = self.calls, []
        return calls

    # -- planning -------------------------------------------------------------------------------

    def _plan(self, chunk: Chunk) -> _Work:
        seq = self._sequences.get(chunk.uid)
        if seq is None:
            seq = _Sequence(prompt_len=chunk.prompt_len, admitted=next(self._admissions), version=self.version)
            self._sequences[chunk.uid] = seq
        if chunk.start != len(seq.tokens):
            seq.broken = True  # a chunk is missing; nothing later can be trusted
        if seq.broken:
            return _Work(seq, chunk.uid, [], chunk.final)

        seq.tokens.extend(chunk.tokens)
        if seq.evicted:
            # Scored in one go from its token history when it ends.
            return _Work(seq, chunk.uid, seq.tokens if chunk.final else [], chunk.final)
        if seq.version != self.version:
            # The weights changed under this cache (a trainable model after its update): start over
            # from the token history with the new weights.
            self._drop_cache(seq)
            seq.version = self.version
        return _Work(seq, chunk.uid, seq.tokens[seq.cached :], chunk.final)

    def _enforce_budget(self, work: List[_Work]) -> None:
        """Evict the most recently started sequences until the caches after this call fit the budget."""
        extra = {id(w.seq): len(w.tokens) for w in work if not w.final}  # a finished sequence frees its cache
        per_token = self._bytes_per_token()
        if per_token is None:
            return

        def needed() -> int:
            return sum((s.cached + extra.get(id(s), 0)) * per_token for s in self._sequences.values() if not s.evicted)

        victims = sorted((s for s in self._sequences.values() if not s.evicted), key=lambda s: -s.admitted)
        for victim in victims:
            if needed() <= self.cache_budget_bytes:
                break
            victim.evicted = True
            self._drop_cache(victim)
            self.stats["evictions"] += 1
        for w in work:
            if w.seq.evicted:
                w.tokens = w.seq.tokens if w.final else []

    def _bytes_per_token(self) -> Optional[int]:
        for seq in self._sequences.values():
            if seq.keys is not None:
                return 2 * seq.keys[:, :, 0].numel() * seq.keys.element_size()
        config = self.base.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * next(self.model.parameters()).element_size()

    def _batches(self, work: List[_Work]):
        """Group by cached length (less padding), within the per-forward token limits."""
        work = sorted(work, key=lambda w: (w.seq.cached, len(w.tokens)))
        batch: List[_Work] = []
        for w in work:
            candidate = batch + [w]
            new_tokens = len(candidate) * max(len(x.tokens) for x in candidate)
            cached_tokens = len(candidate) * max(x.seq.cached for x in candidate)
            if batch and (
                new_tokens > self.max_tokens_per_forward or cached_tokens > self.max_cached_tokens_per_forward
            ):
                yield batch
                candidate = [w]
            batch = candidate
        if batch:
            yield batch

    # -- the forward pass -------------------------------------------------------------------------

    def _forward(self, batch: List[_Work]) -> None:
        """One padded forward: caches left-padded to a common length, new tokens right-padded."""
        device = self.device
        past = max(w.seq.cached for w in batch)
        width = max(len(w.tokens) for w in batch)
        n = len(batch)

        input_ids = torch.zeros(n, width, dtype=torch.long, device=device)
        attention_mask = torch.zeros(n, past + width, dtype=torch.long, device=device)
        position_ids = torch.zeros(n, width, dtype=torch.long, device=device)
        for i, w in enumerate(batch):
            count, cached = len(w.tokens), w.seq.cached
            input_ids[i, :count] = torch.tensor(w.tokens, dtype=torch.long)
            attention_mask[i, past - cached : past + count] = 1
            position_ids[i] = torch.arange(cached, cached + width)

        cache = DynamicCache()
        if past:
            sample = next(w.seq.keys for w in batch if w.seq.cached)
            layers, kv_heads, _, head_dim = sample.shape
            dtype = sample.dtype
            keys = torch.zeros(layers, n, kv_heads, past, head_dim, dtype=dtype, device=device)
            values = torch.zeros_like(keys)
            for i, w in enumerate(batch):
                if w.seq.cached:
                    keys[:, i, :, past - w.seq.cached :] = w.seq.keys[:, :, : w.seq.cached]
                    values[:, i, :, past - w.seq.cached :] = w.seq.values[:, :, : w.seq.cached]
            cache = DynamicCache(ddp_cache_data=list(zip(keys, values)))

        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state
        new_keys = torch.stack([layer.keys[:, :, past:] for layer in out.past_key_values.layers])
        new_values = torch.stack([layer.values[:, :, past:] for layer in out.past_key_values.layers])
        self.stats["forwards"] += 1

        for i, w in enumerate(batch):
            count = len(w.tokens)
            self._score_positions(w, hidden[i, :count])
            self.stats["final_tokens" if w.final else "streamed_tokens"] += count
            if not w.final:  # a finished sequence needs no cache
                self._append_cache(w.seq, new_keys[:, i, :, :count], new_values[:, i, :, :count])
            w.seq.cached += count
            w.seq.last_hidden = hidden[i, count - 1]

    def _score_positions(self, w: _Work, hidden: torch.Tensor) -> None:
        """Outputs for the positions this forward makes available, from ``prompt_len - 1`` on."""
        seq, start = w.seq, w.seq.cached
        first = seq.prompt_len - 1
        if self.role == "critic":
            begin = max(first - start, 0)
            if begin < hidden.shape[0]:
                seq.outputs.append(self.head(hidden[begin:]).squeeze(-1))
        elif self.log_probs:
            # The logits at position j score token j + 1: positions start - 1 .. start + count - 2.
            states = hidden[:-1] if seq.last_hidden is None else torch.cat([seq.last_hidden[None], hidden[:-1]])
            positions_from = start if seq.last_hidden is None else start - 1
            begin = max(first - positions_from, 0)
            labels = torch.tensor(seq.tokens[positions_from + 1 + begin : start + len(w.tokens)], device=hidden.device)
            if len(labels):
                seq.outputs.append(self._log_probs(states[begin:], labels))

    def _log_probs(self, states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from openrlhf.models.utils import log_probs_from_logits

        # As Actor.forward: float32 logits over the temperature, then upstream's log-softmax. A slice of positions
        # at a time: a long sequence's full logits (8k positions x 152k vocabulary in float32: 5 GB) would set the
        # scorer's peak memory.
        parts = []
        for start in range(0, len(labels), self.max_logit_rows):
            rows = slice(start, start + self.max_logit_rows)
            logits = self.head(states[rows]).to(torch.float32)
            if self.temperature != 1.0:
                logits.div_(self.temperature)
            parts.append(log_probs_from_logits(logits[None], labels[rows][None])[0])
        return torch.cat(parts)

    def _append_cache(self, seq: _Sequence, keys: torch.Tensor, values: torch.Tensor) -> None:
        needed = seq.cached + keys.shape[2]
        if needed > seq.capacity:
            capacity = max(needed, 2 * seq.capacity, 64)
            shape = (keys.shape[0], keys.shape[1], capacity, keys.shape[3])
            grown_keys = keys.new_empty(shape)
            grown_values = values.new_empty(shape)
            if seq.cached:
                grown_keys[:, :, : seq.cached] = seq.keys[:, :, : seq.cached]
                grown_values[:, :, : seq.cached] = seq.values[:, :, : seq.cached]
            seq.keys, seq.values = grown_keys, grown_values
        seq.keys[:, :, seq.cached : needed] = keys
        seq.values[:, :, seq.cached : needed] = values

    def _drop_cache(self, seq: _Sequence) -> None:
        seq.keys = seq.values = seq.last_hidden = None
        seq.cached = 0
        seq.outputs, seq.prefilled = [], []  # the work done so far is lost

    # -- results --------------------------------------------------------------------------------

    def _finish(self, w: _Work) -> ScoredSequence:
        seq = w.seq
        self._sequences.pop(w.uid, None)
        length = len(seq.tokens)
        output = None
        if not seq.broken and seq.cached == length and length >= seq.prompt_len:
            output = self._final_output(seq)
        return ScoredSequence(
            uid=w.uid,
            output=output,
            length=length,
            prompt_len=seq.prompt_len,
            version=seq.version,
            prefilled=seq.prefilled,
            tokens=seq.tokens,
        )

    def _final_output(self, seq: _Sequence) -> torch.Tensor:
        model = self.model
        if self.role == "reward":
            reward = self.head(seq.last_hidden[None]).squeeze(-1)[0]
            if not model.training and model.normalize_reward:
                reward = (reward - model.mean[0]) / model.std[0]
            return reward.cpu()
        positions = len(seq.tokens) - seq.prompt_len
        output = torch.cat(seq.outputs)[:positions] if seq.outputs else torch.zeros(0)
        if self.role == "critic" and model.normalize_reward:
            output = (output - model.mean) / model.std
        return output.cpu()


def _merge_consecutive(chunks: List[Chunk]) -> List[Chunk]:
    """One chunk per sequence per call: a flush may carry several chunks of the same sequence."""
    merged: Dict[str, Chunk] = {}
    order: List[Chunk] = []
    for chunk in chunks:
        prev = merged.get(chunk.uid)
        if prev is not None and prev.start + len(prev.tokens) == chunk.start and not prev.final:
            prev.tokens = prev.tokens + chunk.tokens
            prev.final = chunk.final
            continue
        copy = Chunk(chunk.uid, chunk.start, list(chunk.tokens), chunk.prompt_len, chunk.final)
        if prev is not None:
            order.append(copy)  # not contiguous: processed as its own work item, which marks it broken
        else:
            merged[chunk.uid] = copy
            order.append(copy)
    return order


def _nbytes(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
