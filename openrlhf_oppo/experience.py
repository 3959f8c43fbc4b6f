"""Upstream's experience maker, fed by the streamed scores.

``RemoteExperienceMaker.make_experience`` asks each model group for its outputs with ``_dispatch_forward``
and reads them back with ``_flatten_results``. For a streamed role we answer that call from the scores its
actors computed while the sequences were generated: the coordinator flushes the chunks still queued in the
rollout actors, waits for those prefill calls and collects each sequence's scores from the rank that holds
it, and we lay them out in the tensors upstream's ``forward`` would have returned for the same micro-batch.
Only micro-batches with a sequence that could not be streamed go to the model the upstream way. KL, reward
shaping, GAE and whitening stay upstream's.

Upstream hands the rollout samples to ``make_experience_batch`` and only their micro-batches to
``make_experience``; the streamed scores of one batch live in a ``StreamedBatch``, collected before the
first (``collect_scores``, which the trainer's step calls as a phase of its own), and ``_dispatch_forward``
reads it.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import ray
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_oppo.coordinator import StreamCoordinator
from openrlhf_oppo.protocol import ScoredSequence, StreamInfo
from openrlhf_oppo.trace import Tracer


@dataclass
class StreamedBatch:
    """One batch's streamed scores: per role, per rollout sample, the scores or None (score it upstream's way)."""

    infos: List[Optional[StreamInfo]]
    scores: Dict[str, List[Optional[ScoredSequence]]] = field(default_factory=dict)
    flushed_at: float = 0.0  # when make_experience started waiting for the last chunks
    collected_at: float = 0.0
    micro_batches: List[Experience] = field(default_factory=list)  # as upstream's make_experience gets them
    forwarded: Set[str] = field(default_factory=set)  # roles whose model ran a forward for missing scores
    hidden_tokens: int = 0  # streamed tokens prefilled before ``flushed_at``
    streamed_tokens: int = 0
    fallback_batches: int = 0

    def collect(self, coordinator: StreamCoordinator, tracer: Tracer) -> None:
        self.flushed_at = time.time()
        with tracer.span("flush", track="make_experience"):
            coordinator.flush([info for info in self.infos if info is not None])
        with tracer.span("collect", track="make_experience"):
            collected = coordinator.collect(self.infos)
        self.collected_at = time.time()
        for role, by_uid in collected.items():
            self.scores[role] = [self._usable(role, info, by_uid) for info in self.infos]

    @property
    def collected(self) -> bool:
        return bool(self.collected_at)

    def _usable(self, role: str, info: Optional[StreamInfo], by_uid) -> Optional[ScoredSequence]:
        if info is None or role not in info.ranks:
            return None
        self.streamed_tokens += info.length
        result = by_uid.get(info.uid)
        if result is None or result.output is None:
            return None
        self.hidden_tokens += min(result.tokens_prefilled_before(self.flushed_at), info.length)
        return result

    def metrics(self) -> Dict[str, float]:
        metrics = {
            "oppo/prefill_hidden_fraction": self.hidden_tokens / max(self.streamed_tokens, 1),
            "oppo/fallback_micro_batches": float(self.fallback_batches),
        }
        last_tokens = [info.last_token_time for info in self.infos if info is not None and info.last_token_time]
        if last_tokens:
            metrics["oppo/last_token_to_experience_s"] = time.time() - max(last_tokens)
        return metrics


class StreamingExperienceMaker(RemoteExperienceMaker):
    def __init__(self, *args, coordinator: StreamCoordinator, tracer: Tracer = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator = coordinator
        self.tracer = tracer or Tracer(enabled=False, process="experience")
        self.metrics: Dict[str, float] = {}
        self._batch: Optional[StreamedBatch] = None  # between make_experience_batch and _dispatch_forward

    def collect_scores(self, rollout_samples: List[Experience]) -> StreamedBatch:
        """Flush and collect: the queued chunks of the samples' sequences go out, every prefill call is awaited,
        and the scores come from the rank that holds each (nothing to collect if no sample was streamed)."""
        batch = StreamedBatch([getattr(sample, "stream", None) for sample in rollout_samples])
        if any(info and info.ranks for info in batch.infos):
            batch.collect(self.coordinator, self.tracer)
        return batch

    def make_experience_batch(
        self, rollout_samples: List[Experience], streamed: Optional[StreamedBatch] = None
    ) -> List[Experience]:
        """``streamed``: the samples' scores from ``collect_scores``, collected here if not given."""
        self._batch = streamed if streamed is not None else self.collect_scores(rollout_samples)
        try:
            experiences = super().make_experience_batch(rollout_samples)
            # After the scores arrived: upstream's KL, reward shaping and advantages.
            self.tracer.add(
                "kl_advantages", self._batch.collected_at or time.time(), time.time(), track="make_experience"
            )
            self.metrics = self._batch.metrics()
            return experiences
        finally:
            self._batch = None

    def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
        # Its own span inside kl_advantages: upstream's loops over the tokens run on the host.
        with self.tracer.span("advantages", track="make_experience"):
            return super().compute_advantages_and_returns(experiences)

    def make_experience(self, samples_list: List[Experience]) -> List[Experience]:
        batch = self._batch
        if batch is not None:
            batch.micro_batches = samples_list
            with self._reward_cache_emptied_only_after_a_forward(batch):
                return super().make_experience(samples_list)
        return super().make_experience(samples_list)

    @contextmanager
    def _reward_cache_emptied_only_after_a_forward(self, batch: StreamedBatch):
        """Upstream's make_experience has the reward model empty its CUDA cache after its forward, before the
        critic's on the same GPU (``--train.colocate_critic_reward``, which ``--oppo.colocate_models`` sets). A
        streamed reward ran no forward, and the call would wait behind every prefill call queued on the reward
        scorer, which keeps scoring the carried sequences: it is not made then. Upstream has no hook there, so
        its make_experience sees the reward group through ``_RewardGroupView`` until it returns."""
        group = self.reward_model_group
        if group is None or "reward" not in batch.scores:
            yield
            return
        self.reward_model_group = _RewardGroupView(group, batch)
        try:
            yield
        finally:
            self.reward_model_group = group

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        role = self._role(group)
        scored = self._batch.scores.get(role) if self._batch is not None else None
        if scored is None:
            return super()._dispatch_forward(group, sync_condition, **kwargs)

        outputs = [_assemble(role, samples, scored) for samples in self._batch.micro_batches]
        missing = [index for index, output in enumerate(outputs) if output is None]
        if missing:
            # Score those micro-batches as upstream does, then slot them in.
            self._batch.fallback_batches += len(missing)
            self._batch.forwarded.add(role)
            refs = self.coordinator.forward(
                role, {key: [values[i] for i in missing] for key, values in kwargs.items()}
            )
            if sync_condition:
                ray.get(refs)
                ray.get(group.async_run_method(method_name="empty_cache"))
            for index, output in zip(missing, self._flatten_results(refs, 1)):
                outputs[index] = output
        return [ray.put(outputs)]

    def _role(self, group) -> Optional[str]:
        group = group.group if isinstance(group, _RewardGroupView) else group
        return next((role for role, g in self.coordinator.groups.items() if g is group), None)


class _RewardGroupView:
    """The reward model group, less the ``empty_cache`` call after a forward that ``batch`` did not run."""

    def __init__(self, group, batch: StreamedBatch):
        self.group, self.batch = group, batch

    def __getattr__(self, name):
        return getattr(self.group, name)

    def async_run_method(self, method_name, *args, **kwargs):
        if method_name == "empty_cache" and "reward" not in self.batch.forwarded:
            return []
        return self.group.async_run_method(method_name, *args, **kwargs)


def _assemble(role: str, samples: Experience, scored: List[Optional[ScoredSequence]]) -> Optional[torch.Tensor]:
    """The tensor upstream's forward returns for this micro-batch, from the streamed scores (None if any
    sequence of it has none)."""
    results = [scored[i] for i in samples.index]
    lengths = samples.attention_mask.sum(dim=1).tolist()
    if any(r is None or r.length != length for r, length in zip(results, lengths)):
        return None
    if role == "reward":
        return torch.stack([r.output for r in results])
    first = [int(mask.nonzero()[0]) if mask.any() else -1 for mask in samples.action_mask]
    if any(f != r.prompt_len - 1 for f, r in zip(first, results)):
        return None  # the action span does not start after the prompt the stream saw
    dense = torch.zeros(samples.action_mask.shape, dtype=results[0].output.dtype)
    for row, r in enumerate(results):
        dense[row, r.prompt_len - 1 : r.length - 1] = r.output
    # As upstream: outputs outside the action span are zeroed by the float mask.
    return dense * samples.action_mask.float()
