"""extension.install: which upstream classes are swapped, and that each swap is a subclass of upstream's."""

import pytest


@pytest.fixture
def upstream_globals(monkeypatch):
    """Upstream's module globals that install() may change, restored after the test."""
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher, ppo_actor, ppo_critic, vllm_engine

    slots = [
        (vllm_engine, "RolloutRayActor"),
        (launcher, "RewardModelActor"),
        (launcher, "ReferenceModelActor"),
        (ppo_critic, "CriticModelActor"),
        (ppo_actor, "PolicyModelActor"),
        (ppo_trainer, "PPOTrainer"),
    ]
    for module, name in slots:
        monkeypatch.setattr(module, name, getattr(module, name))
    return {name: (module, getattr(module, name)) for module, name in slots}


def swapped(upstream_globals):
    return {name for name, (module, original) in upstream_globals.items() if getattr(module, name) is not original}


def test_nothing_is_swapped_without_oppo(upstream_globals):
    from openrlhf_oppo import extension

    extension.install(enable=False)
    assert swapped(upstream_globals) == set()


def test_benchmark_lengths_swap_only_the_rollout_actor(upstream_globals):
    from openrlhf_oppo import extension

    extension.install(enable=False, lengths_from_label=True)
    assert swapped(upstream_globals) == {"RolloutRayActor"}


def test_oppo_swaps_subclasses_of_upstreams_classes(upstream_globals):
    from openrlhf_oppo import extension
    from openrlhf_oppo.streaming.rollout import OPPORolloutActor

    extension.install(enable=True)
    assert swapped(upstream_globals) == set(upstream_globals)
    for name, (module, original) in upstream_globals.items():
        replacement = getattr(module, name)
        if name == "RolloutRayActor":  # bound to its build-time config, see rollout.with_config
            assert issubclass(replacement.actor_class.__ray_actor_class__, original.__ray_actor_class__)
            assert replacement.actor_class.__ray_actor_class__ is OPPORolloutActor
            assert replacement.extra_kwargs["oppo_config"]["lengths_from_label"] is False
        else:
            assert issubclass(replacement.__ray_actor_class__, original.__ray_actor_class__)


@pytest.mark.parametrize("enable, interval", [(True, 16), (False, 1)])
def test_the_rollout_actor_is_built_with_the_parsed_stream_interval(upstream_globals, enable, interval):
    """install() swaps the rollout actor before the options are parsed; configure() binds them to it. Upstream's
    runs on it (the benchmark's response lengths) keep vLLM's interval."""
    from openrlhf.trainer.ray import vllm_engine

    from openrlhf_oppo import extension
    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    extension.install(enable=enable, lengths_from_label=True)
    flags = ["--actor.model_name_or_path", "m", "--reward.model_name_or_path", "m", "--vllm.num_engines", "1"]
    flags += ["--bench.lengths_from_label"]
    parse_args(flags + (["--oppo.enable"] if enable else []))
    config = vllm_engine.RolloutRayActor.extra_kwargs["oppo_config"]
    assert (config["stream_interval"], config["lengths_from_label"]) == (interval, True)
