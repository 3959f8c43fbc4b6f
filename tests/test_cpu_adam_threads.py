"""With ``--ds.adam_offload``, OPPO's policy and critic actors give PyTorch (whose OpenMP runtime DeepSpeed's CPU
Adam runs in) the host's cores shared among the training ranks, before upstream's init builds the optimizer.
Ray starts a model actor placed as OpenRLHF places it (a fraction of a CPU) with one thread. Checked in real Ray
actors; ``test_patches.py`` checks the same in a patched upstream, and
``examples/scripts/cpu_adam_threads_cpu.py`` measures what it changes."""

import os
from types import SimpleNamespace

import pytest
import ray

from openrlhf_oppo.streaming import actors
from openrlhf_oppo.testing.cpu_threads import TrainingRank


def ppo_args(adam_offload: bool, critic: str = None):
    return SimpleNamespace(
        ds=SimpleNamespace(adam_offload=adam_offload),
        actor=SimpleNamespace(num_gpus_per_node=1),
        critic=SimpleNamespace(model_name_or_path=critic, num_gpus_per_node=1),
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to share")
@pytest.mark.parametrize("adam_offload", [True, False])
def test_training_rank_takes_its_share_of_the_cores_before_the_optimizer_exists(ray_session, adam_offload):
    args = ppo_args(adam_offload)
    rank = TrainingRank.options(num_cpus=0.2).remote()
    try:
        ray.get(rank.init_model_from_pretrained.remote(SimpleNamespace(args=args), "model"))
        threads = ray.get(rank.threads.remote())
    finally:
        ray.kill(rank)
    assert threads["started_with"] == "1"  # what Ray gives an actor with less than one CPU
    expected = len(os.sched_getaffinity(0)) if adam_offload else 1
    assert threads["at_init"] == threads["now"] == expected


def test_the_cores_are_shared_among_the_policys_and_the_critics_ranks():
    cores = len(os.sched_getaffinity(0))
    assert actors.cpu_adam_threads(ppo_args(True)) == cores
    with_critic = ppo_args(True, critic="critic")
    with_critic.actor.num_gpus_per_node, with_critic.critic.num_gpus_per_node = 2, 2
    assert actors.cpu_adam_threads(with_critic) == max(1, cores // 4)
    with_critic.actor.num_gpus_per_node = 8 * cores  # more ranks than cores: one thread each
    assert actors.cpu_adam_threads(with_critic) == 1
