"""A training actor whose upstream init is left out: the threads PyTorch has when upstream would build the
optimizer (``tests/test_cpu_adam_threads.py``)."""

import os

import ray
import torch

from openrlhf_oppo.streaming import actors


class _UpstreamInit:
    """In place of upstream's init, which builds DeepSpeed's optimizer: the threads it would build it with."""

    def init_model_from_pretrained(self, strategy, pretrain, *args):
        self.threads_at_init = torch.get_num_threads()


@ray.remote(num_gpus=0, concurrency_groups=actors.CONCURRENCY_GROUPS)  # as the product's actors
class TrainingRank(actors._TrainableScorerMixin, _UpstreamInit):
    def threads(self) -> dict:
        return dict(
            started_with=os.environ.get("OMP_NUM_THREADS"), at_init=self.threads_at_init, now=torch.get_num_threads()
        )
