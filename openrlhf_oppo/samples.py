"""Upstream's ``SamplesGenerator``, keeping what the OPPO rollout actor says about each sample.

The rollout actor returns, with every response, an ``oppo`` dict: the sequence id its scores are
filed under, the models that streamed it, the weight versions that generated it and when its last
token came out. ``Experience`` has no field for it, so it rides along as an attribute
until the experience maker reads it (before upstream concatenates samples into micro-batches).
The versions also go into ``info``, which the actor's training step logs. Evaluation samples are not
streamed: nobody would collect their scores.

Nor would anybody collect the scores of two kinds of streamed sequences, so the generator lists them
(``take_dropped``) for the trainer to discard: the samples of groups that dynamic filtering drops, and
the streams a rollout actor closed because training sees other tokens than it streamed (``replaced_uid``).
"""

import time

import ray
import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

from openrlhf_oppo.trace import Tracer


class OPPOSamplesGenerator(SamplesGenerator):
    def __init__(self, *args, tracer: Tracer = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracer = tracer or Tracer(enabled=False, process="samples")
        self.last_generation_s = 0.0
        self._engines_have_tokenizer = False
        self.dropped = []  # ``oppo`` infos of streamed sequences training will not see
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
            self.last_generation_s = time.time() - start
            self.tracer.add("generation", start, time.time(), track="trainer")

    def _generate_samples(self, **generate_kwargs):
        return super().generate_samples(**generate_kwargs)

    def generate_eval_samples(self, **generate_kwargs):
        # Nobody collects the scores of evaluation samples: don't stream them.
        batch_vllm_engine_call(self.vllm_engines, "oppo_set_streaming", False)
        try:
            return super().generate_eval_samples(**generate_kwargs)
        finally:
            batch_vllm_engine_call(self.vllm_engines, "oppo_set_streaming", True)

    def take_dropped(self) -> list:
        """The ``oppo`` infos (uid, streamed models) of the streamed sequences dropped since the last call."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def _drop(self, experiences) -> None:
        for experience in experiences:
            info = getattr(experience, "oppo", None)
            if info and info.get("streamed"):
                self.dropped.append(dict(uid=info["uid"], streamed=info["streamed"]))

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
        # Upstream passes the tokenizer with every generate_responses call: pickled here and unpickled
        # by the rollout actor before each call starts (2.4 MB and 0.12 s for a 150k vocabulary on a CPU
        # core), so a batch of calls reaches vLLM seconds apart (about 4 s a step on 2x H200,
        # docs/RESULTS.md). OPPO's rollout actors get it once and take None in its place. The flag is the
        # one patches/openrlhf/0005 adds upstream, so that a patched upstream does not send it again.
        if not self._engines_have_tokenizer:
            ray.get([engine.oppo_set_tokenizer.remote(self.tokenizer) for engine in self.vllm_engines])
            self._engines_have_tokenizer = True
        tokenizer, self.tokenizer = self.tokenizer, None
        try:
            return super()._dispatch_prompts_to_vllm(*args, **kwargs)
        finally:
            self.tokenizer = tokenizer

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        info = response.get("oppo")
        experience.oppo = info
        if self._made is not None:
            self._made.append(experience)
        if info is not None and info.get("replaced_uid"):
            self.dropped.append(dict(uid=info["replaced_uid"], streamed=info["streamed"]))
        if info is not None and info.get("first_version") is not None:
            experience.info["policy_version_first"] = torch.tensor([float(info["first_version"])])
            experience.info["policy_version_last"] = torch.tensor([float(info["last_version"])])
        return experience
