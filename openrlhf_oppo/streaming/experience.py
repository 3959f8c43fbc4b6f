"""Upstream's experience maker, fed by the streamed scores.

``RemoteExperienceMaker.make_experience`` asks each model group for its outputs with
``_dispatch_forward`` and reads them back with ``_flatten_results``. For a streamed model we answer
that call from the scores its actors computed while the sequences were generated: we flush the chunks
still queued in the rollout actors, wait for those prefill calls, collect each sequence's scores from
the rank that holds it, and lay them out in the tensors upstream's ``forward`` would have returned for
the same micro-batch. Only micro-batches with a sequence that could not be streamed (or was scored by
an older critic/policy) go to the model the upstream way. KL, reward shaping, GAE and whitening stay
upstream's. Scores that no batch will collect are discarded (``discard``).
"""

import time
from typing import Dict, List, Optional

import ray
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_oppo.streaming.rollout import route
from openrlhf_oppo.streaming.scorer import ScoredSequence
from openrlhf_oppo.trace import Tracer


class StreamingExperienceMaker(RemoteExperienceMaker):
    def __init__(self, *args, streamed_models=(), vllm_engines=(), tracer: Tracer = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.streamed_models = set(streamed_models)
        self.vllm_engines = list(vllm_engines)
        self.tracer = tracer or Tracer(enabled=False, process="experience")
        self.metrics: Dict[str, float] = {}

    def make_experience_batch(self, rollout_samples: List[Experience]) -> List[Experience]:
        self._streams = [getattr(sample, "oppo", None) for sample in rollout_samples]
        self._scored: Dict[str, List[Optional[ScoredSequence]]] = {}
        self._counts = dict(streamed=0, total=0, fallback_batches=0)
        self._flushed_at = self._collected_at = None
        experiences = super().make_experience_batch(rollout_samples)
        # After the scores arrived: upstream's KL, reward shaping and advantages (and any micro-batch
        # scored the upstream way).
        self.tracer.add("kl_advantages", self._collected_at or time.time(), time.time(), track="make_experience")

        last_tokens = [s["last_token_time"] for s in self._streams if s and s.get("last_token_time")]
        self.metrics = {
            "oppo/prefill_hidden_fraction": self._counts["streamed"] / max(self._counts["total"], 1),
            "oppo/fallback_micro_batches": float(self._counts["fallback_batches"]),
        }
        if last_tokens:
            self.metrics["oppo/last_token_to_experience_s"] = time.time() - max(last_tokens)
        return experiences

    def make_experience(self, samples_list: List[Experience]) -> List[Experience]:
        self._samples_list = samples_list
        return super().make_experience(samples_list)

    def discard(self, infos) -> None:
        """Drop the scores of streamed sequences that training will not use (``oppo`` infos, as
        ``OPPOSamplesGenerator.take_dropped`` lists them) from the scoring actors that hold them."""
        calls = []
        for model, group in self._groups().items():
            if model in self.streamed_models:
                handlers = group._actor_handlers  # noqa: SLF001 - RayActorGroup exposes no accessor
                uids_by_rank = _uids_by_rank(model, infos, len(handlers))
                calls += [handlers[rank].oppo_discard.remote(uids) for rank, uids in uids_by_rank.items()]
        ray.get(calls)

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        model = self._model_name(group)
        if model not in self.streamed_models or not any(s and model in s.get("streamed", ()) for s in self._streams):
            return super()._dispatch_forward(group, sync_condition, **kwargs)

        scored = self._fetch(model)
        outputs, missing = [], []
        for index, samples in enumerate(self._samples_list):
            output = self._assemble(model, samples, scored)
            outputs.append(output)
            if output is None:
                missing.append(index)
        if missing:
            # Score those micro-batches as upstream does, then slot them in.
            self._counts["fallback_batches"] += len(missing)
            subset = {key: [values[i] for i in missing] for key, values in kwargs.items()}
            refs = _run_forward(group, subset)
            if sync_condition:
                ray.get(refs)
                ray.get(group.async_run_method(method_name="empty_cache"))
            for index, output in zip(missing, self._flatten_results(refs, 1)):
                outputs[index] = output
        return [ray.put(outputs)]

    def _groups(self) -> Dict[str, object]:
        groups = {
            "reward": self.reward_model_group,
            "critic": self.critic_model_group,
            "ref": self.initial_model_group,
            "actor": self.actor_model_group,
        }
        return {name: group for name, group in groups.items() if group is not None}

    def _model_name(self, group) -> Optional[str]:
        return next((name for name, g in self._groups().items() if g is group), None)

    def _flush(self) -> None:
        """Once per batch: send the chunks still queued in the rollout actors and wait for every prefill."""
        if self._flushed_at is None:
            self._flushed_at = time.time()
            uids = [stream["uid"] for stream in self._streams if stream and stream.get("streamed")]
            with self.tracer.span("flush", track="make_experience"):
                calls = ray.get([engine.oppo_flush.remote(uids) for engine in self.vllm_engines])
                ray.get([call for engine_calls in calls for call in engine_calls])

    def _fetch(self, model: str) -> List[Optional[ScoredSequence]]:
        """This model's scores for every rollout sample, or None where it has none valid now."""
        if model not in self._scored:
            self._collect_streamed()
        return self._scored[model]

    def _collect_streamed(self) -> None:
        """Once per batch, after the flush: every streamed model's scores, asked of all actors at once."""
        self._flush()
        calls = {}
        for model, group in self._groups().items():
            if model not in self.streamed_models:
                continue
            handlers = group._actor_handlers  # noqa: SLF001 - RayActorGroup exposes no accessor
            uids_by_rank = _uids_by_rank(model, self._streams, len(handlers))
            collects = [handlers[rank].oppo_collect.remote(uids) for rank, uids in uids_by_rank.items()]
            calls[model] = (collects, handlers[0].oppo_version.remote())
        with self.tracer.span("collect", track="make_experience"):
            for model, (collects, version) in calls.items():
                collected = {}
                for part in ray.get(collects):
                    collected.update(part)
                self._scored[model] = self._valid_scores(model, collected, ray.get(version))
        self._collected_at = time.time()

    def _valid_scores(self, model: str, collected: dict, version: int) -> List[Optional[ScoredSequence]]:
        """Per rollout sample: its scores, if computed with the model's current weights (trainable models
        bump their version in fit), else None."""
        scored = []
        for stream in self._streams:
            result = None
            if stream and model in stream.get("streamed", ()):
                result = collected.get(stream["uid"])
                self._counts["total"] += stream["length"]
                if result is not None and result.output is not None and result.version == version:
                    hidden = result.tokens_prefilled_before(self._flushed_at)
                    self._counts["streamed"] += min(hidden, stream["length"])
                else:
                    result = None
            scored.append(result)
        return scored

    def _assemble(self, model: str, samples: Experience, scored) -> Optional[torch.Tensor]:
        """The tensor upstream's forward returns for this micro-batch, from the streamed scores."""
        results = [scored[i] for i in samples.index]
        lengths = samples.attention_mask.sum(dim=1).tolist()
        if any(r is None or r.length != length for r, length in zip(results, lengths)):
            return None
        if model == "reward":
            return torch.stack([r.output for r in results])
        first = [int(mask.nonzero()[0]) if mask.any() else -1 for mask in samples.action_mask]
        if any(f != r.prompt_len - 1 for f, r in zip(first, results)):
            return None  # the action span does not start after the prompt the stream saw
        dtype = results[0].output.dtype
        dense = torch.zeros(samples.action_mask.shape, dtype=dtype)
        for row, r in enumerate(results):
            dense[row, r.prompt_len - 1 : r.length - 1] = r.output
        # As upstream: outputs outside the action span are zeroed by the float mask.
        return dense * samples.action_mask.float()


def _uids_by_rank(model: str, infos, ranks: int) -> Dict[int, List[str]]:
    """The uids of the sequences streamed to ``model``, by the rank of its group that holds their scores."""
    uids_by_rank = {}
    for info in infos:
        if info and model in info.get("streamed", ()):
            uids_by_rank.setdefault(route(info["uid"], ranks), []).append(info["uid"])
    return uids_by_rank


def _run_forward(group, kwargs) -> List[ray.ObjectRef]:
    """``forward`` over these micro-batches, spread over the group's ranks even if fewer than the ranks."""
    count = len(next(iter(kwargs.values())))
    handlers = group._actor_handlers  # noqa: SLF001 - RayActorGroup exposes no accessor
    if count >= len(handlers):
        return group.async_run_method_batch(method_name="forward", **kwargs)
    return [
        handlers[i].execute_batch.remote("forward", ray.put({k: v[i : i + 1] for k, v in kwargs.items()}), 0, 1)
        for i in range(count)
    ]
