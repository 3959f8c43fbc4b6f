"""Upstream's ``SamplesGenerator``, keeping what the OPPO rollout actor says about each sample.

Each response comes with a ``StreamInfo`` (``response["stream_info"]``): where its scores are filed, and the
weight versions that generated it. ``Experience`` has no field for it, so it rides along as
``experience.stream`` until the experience maker reads it, before upstream concatenates samples into
micro-batches; the versions also go into ``info`` for the training log.

Streamed sequences nobody will collect are listed (``take_dropped``) for the trainer to discard: the groups that
dynamic filtering drops, and streams closed because training sees other tokens (``replaced_uid``). Evaluation
samples are not streamed at all.
"""

import dataclasses
import time
from typing import List, Optional

import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_oppo.coordinator import StreamCoordinator
from openrlhf_oppo.protocol import StreamInfo
from openrlhf_oppo.trace import Tracer


class OPPOSamplesGenerator(SamplesGenerator):
    def __init__(self, *args, coordinator: StreamCoordinator, tracer: Tracer = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator = coordinator
        self.tracer = tracer or Tracer(enabled=False, process="samples")
        self.dropped: List[StreamInfo] = []  # streamed sequences training will not see
        self._made = None  # the experiences made during ``_generate_vllm``
        # Episodes whose prompts have all been returned: the episode a checkpoint resumes in (OPPOTrainer).
        self.episodes_done = 0

    def generate_samples(self, **generate_kwargs):
        start = time.time()
        try:
            samples, filter_pass_rate, prompts_consumed, exhausted = self._generate_samples(**generate_kwargs)
            self.episodes_done += exhausted
            return samples, filter_pass_rate, prompts_consumed, exhausted
        finally:
            self.tracer.add("generation", start, time.time(), track="trainer")

    def _generate_samples(self, **generate_kwargs):
        return super().generate_samples(**generate_kwargs)

    def generate_eval_samples(self, **generate_kwargs):
        # Nobody collects the scores of evaluation samples: don't stream them.
        self.coordinator.set_streaming(False)
        try:
            return super().generate_eval_samples(**generate_kwargs)
        finally:
            self.coordinator.set_streaming(True)

    def next_batch_streams(self) -> Optional[List[StreamInfo]]:
        """The streams of the groups the next step will train, where they are known before it starts; without
        inter-step overlap the next step's prompts are not even drawn yet."""
        return None

    def take_dropped(self) -> List[StreamInfo]:
        """The streamed sequences dropped since the last call."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def _drop(self, experiences) -> None:
        self.dropped += [e.stream for e in experiences if getattr(e, "stream", None) and e.stream.ranks]

    def _generate_vllm(self, *args, **kwargs):
        # Upstream drops the groups that dynamic filtering rejects inside this call. Those made here and
        # not returned are the dropped ones (returned extras wait in upstream's ``_sample_buffer``).
        self._made = []
        try:
            accepted, prompts_consumed, exhausted = super()._generate_vllm(*args, **kwargs)
            kept = {id(experience) for experience in accepted}
            self._drop([experience for experience in self._made if id(experience) not in kept])
        finally:
            self._made = None
        return accepted, prompts_consumed, exhausted

    def _dispatch_prompts_to_vllm(self, *args, **kwargs):
        # Upstream sends the tokenizer with every generate_responses call, and unpickling it before each call
        # spreads a batch of calls out in time. OPPO's rollout actors get it once and take None in its place.
        # The flag is the one patches/openrlhf/0005 adds: a patched upstream then does not send it again.
        self.coordinator.send_tokenizer(self.tokenizer)
        self._engines_have_tokenizer = True
        tokenizer, self.tokenizer = self.tokenizer, None
        try:
            return super()._dispatch_prompts_to_vllm(*args, **kwargs)
        finally:
            self.tokenizer = tokenizer

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        stream: StreamInfo = response.get("stream_info")
        experience.stream = stream
        if self._made is not None:
            self._made.append(experience)
        if stream is None:
            return experience
        if stream.replaced_uid:
            self.dropped.append(dataclasses.replace(stream, uid=stream.replaced_uid))
        if stream.first_version is not None:
            experience.info["policy_version_first"] = torch.tensor([float(stream.first_version)])
            experience.info["policy_version_last"] = torch.tensor([float(stream.last_version)])
        return experience
