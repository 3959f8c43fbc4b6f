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


@pytest.fixture
def sampling_params_hook(monkeypatch):
    """The benchmark's hook registered, as its driver does before the CLI starts; unregistered after the test."""
    from openrlhf_oppo import extension
    from openrlhf_oppo.bench.fixed_lengths import fixed_length_params

    monkeypatch.setattr(extension, "_sampling_params_hook", None)
    extension.set_sampling_params_hook(fixed_length_params)
    return fixed_length_params


def swapped(upstream_globals):
    return {name for name, (module, original) in upstream_globals.items() if getattr(module, name) is not original}


def test_without_oppo_only_the_trainer_is_swapped_to_log_the_trained_lengths(upstream_globals):
    """Upstream's trainer, with the trained responses by length added to its rollout stats (lengths.py) and
    nothing else of its own."""
    from openrlhf_oppo import extension
    from openrlhf_oppo.lengths import LengthStats

    extension.install(enable=False)
    assert swapped(upstream_globals) == {"PPOTrainer"}
    module, original = upstream_globals["PPOTrainer"]
    replacement = module.PPOTrainer.__ray_actor_class__
    assert replacement.__mro__[1:] == (LengthStats,) + original.__ray_actor_class__.__mro__
    assert [name for name in vars(replacement) if not name.startswith("_")] == []  # no method of its own
    assert replacement.__init__.__code__.co_names == ("super", "__init__")  # upstream's, called as it is


def test_a_sampling_params_hook_swaps_the_rollout_actor(upstream_globals, sampling_params_hook):
    from openrlhf_oppo import extension

    extension.install(enable=False)
    assert swapped(upstream_globals) == {"RolloutRayActor", "PPOTrainer"}
    rollout = upstream_globals["RolloutRayActor"][0].RolloutRayActor
    assert rollout.extra_kwargs["oppo_config"]["sampling_params_hook"] is sampling_params_hook


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
            assert replacement.extra_kwargs["oppo_config"]["sampling_params_hook"] is None
        else:
            assert issubclass(replacement.__ray_actor_class__, original.__ray_actor_class__)


@pytest.mark.parametrize("enable, interval", [(True, 16), (False, 1)])
def test_the_rollout_actor_is_built_with_the_parsed_stream_interval(
    upstream_globals, sampling_params_hook, enable, interval
):
    """install() swaps the rollout actor before the options are parsed; configure() binds them to it. Upstream's
    runs on it (the benchmark's response lengths) keep vLLM's interval."""
    from openrlhf.trainer.ray import vllm_engine

    from openrlhf_oppo import extension
    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    extension.install(enable=enable)
    flags = ["--actor.model_name_or_path", "m", "--reward.model_name_or_path", "m", "--vllm.num_engines", "1"]
    parse_args(flags + (["--oppo.enable"] if enable else []))
    config = vllm_engine.RolloutRayActor.extra_kwargs["oppo_config"]
    assert (config["stream_interval"], config["sampling_params_hook"]) == (interval, sampling_params_hook)


def test_the_benchmarks_hook_fixes_each_responses_length():
    """``max_tokens`` is the label, the end of text is ignored, and upstream's params are left as they were."""
    from vllm import SamplingParams

    from openrlhf_oppo.bench.fixed_lengths import fixed_length_params

    upstream = SamplingParams(max_tokens=1024, min_tokens=1)
    params = fixed_length_params(upstream, "7")
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (7, 1, True)
    assert (upstream.max_tokens, upstream.ignore_eos) == (1024, False)
    assert fixed_length_params(SamplingParams(max_tokens=9, min_tokens=4), 2).min_tokens == 2
    with pytest.raises(ValueError, match="expects each prompt's label to be a response length"):
        fixed_length_params(upstream, "seven")
