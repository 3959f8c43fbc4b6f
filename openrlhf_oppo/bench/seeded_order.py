"""``--bench.seed_prompt_order``: the same prompt order in every run of the same ``--train.seed``.

Upstream's trainer actor is not a ``torch.distributed`` rank, so ``strategy.setup_dataloader`` shuffles with the
process's randomly seeded default generator: a step's prompts differ between two runs of one command, and so
between the systems a benchmark compares. This strategy seeds that sampler from ``--train.seed``. It reaches
every trainer, sync or async, with the pickled strategy.
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
