"""Upstream's ``SamplesGenerator``, keeping what the OPPO rollout actor says about each sample.

The rollout actor returns, with every response, an ``oppo`` dict: the sequence id its scores are
filed under, the ObjectRef of each streamed model's scores, the weight versions that generated it and
when its last token came out. ``Experience`` has no field for it, so it rides along as an attribute
until the experience maker reads it (before upstream concatenates samples into micro-batches).
The versions also go into ``info``, which the actor's training step logs.
"""

import time

import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_oppo.trace import Tracer


class OPPOSamplesGenerator(SamplesGenerator):
    def __init__(self, *args, tracer: Tracer = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracer = tracer or Tracer(enabled=False, process="samples")
        self.last_generation_s = 0.0

    def generate_samples(self, **generate_kwargs):
        start = time.time()
        try:
            return self._generate_samples(**generate_kwargs)
        finally:
            self.last_generation_s = time.time() - start
            self.tracer.add("generation", start, time.time(), track="trainer")

    def _generate_samples(self, **generate_kwargs):
        return super().generate_samples(**generate_kwargs)

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        info = response.get("oppo")
        experience.oppo = info
        if info is not None and info.get("first_version") is not None:
            experience.info["policy_version_first"] = torch.tensor([float(info["first_version"])])
            experience.info["policy_version_last"] = torch.tensor([float(info["last_version"])])
        return experience
