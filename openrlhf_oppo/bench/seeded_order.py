"""``--bench.seed_prompt_order``: the same prompt order in every run of the same ``--train.seed``.

Upstream's trainer actor builds its prompt dataloader with ``strategy.setup_dataloader``, which shuffles
with the process's default generator where no distributed sampler is set up (the trainer is not a
``torch.distributed`` rank), and torch seeds that generator at random in each process. So a step's
prompts differ between two runs of one command, and so between the systems a benchmark compares. This
strategy seeds that sampler from ``--train.seed``; everything else is upstream's. It travels to the
actors with the pickled strategy (by reference to this module), so it reaches every trainer, sync or async.
"""

import torch
from openrlhf.utils import deepspeed
from torchdata.stateful_dataloader.sampler import RandomSampler

UpstreamStrategy = deepspeed.DeepspeedStrategy


class SeededOrderStrategy(UpstreamStrategy):
    def setup_dataloader(self, *args, **kwargs):
        loader = super().setup_dataloader(*args, **kwargs)
        if isinstance(loader.sampler, RandomSampler):  # upstream's loaders are torchdata's StatefulDataLoader
            loader.sampler.generator = torch.Generator().manual_seed(self.seed)
        return loader


def install() -> None:
    """Make ``openrlhf.utils.get_strategy`` (which looks the class up when called) build this strategy."""
    deepspeed.DeepspeedStrategy = SeededOrderStrategy
