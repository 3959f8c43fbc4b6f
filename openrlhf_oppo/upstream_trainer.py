"""Upstream's synchronous trainer as the CLI runs it with OPPO off: OpenRLHF's ``PPOTrainer``, logging the trained
responses by length too (``lengths.py``), so that a run with OPPO and one without log the same metrics. Nothing
else of it changes (``extension.install`` swaps it in)."""

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer

from openrlhf_oppo.lengths import LengthStats


class _UpstreamPPOTrainer(LengthStats, PPOTrainer.__ray_actor_class__):
    def __init__(self, *args, **kwargs):
        # Ray ships an actor class's inherited __init__ by value where it cannot import it by name (upstream's module
        # names the Ray actor, not the class), and the copy's super() then names a copy of upstream's class. This
        # one it imports by name.
        super().__init__(*args, **kwargs)


UpstreamPPOTrainer = ray.remote(_UpstreamPPOTrainer)
