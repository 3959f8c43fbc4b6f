"""The one place that decides which upstream classes OPPO replaces.

Upstream's driver (``openrlhf/cli/train_ppo_ray.py``) reads its actor classes from module globals, and
``create_vllm_engines`` reads ``RolloutRayActor`` when it runs; ``install`` swaps those globals before
the driver imports them. Objects that upstream builds inside the trainer actor (the samples generator
and the experience maker) are replaced by ``OPPOTrainer.__init__``, not here.

| upstream                                   | replaced by                     | when                              |
|--------------------------------------------|---------------------------------|-----------------------------------|
| vllm_engine.RolloutRayActor                | streaming.rollout.OPPORolloutActor | --oppo.enable, or a tool's hook or engine arguments |
| launcher.RewardModelActor                  | streaming.actors.StreamingRewardModelActor    | --oppo.enable |
| launcher.ReferenceModelActor               | streaming.actors.StreamingReferenceModelActor | --oppo.enable |
| ppo_critic.CriticModelActor                | streaming.actors.StreamingCriticModelActor    | --oppo.enable |
| ppo_actor.PolicyModelActor                 | streaming.actors.StreamingPolicyModelActor    | --oppo.enable |
| ppo_trainer.PPOTrainer                     | trainer.OPPOTrainer             | --oppo.enable                     |
| ppo_trainer.PPOTrainer                     | upstream_trainer.UpstreamPPOTrainer (upstream's, logging the trained lengths) | OPPO off |
| train_ppo_ray.train (the placement)        | placement.train                 | --oppo.colocate_models (and --oppo.frozen_scorers_on) |
| (in OPPOTrainer) SamplesGenerator          | samples.OPPOSamplesGenerator / overcommit.sampler.OvercommitSamplesGenerator | --oppo.enable |
| (in OPPOTrainer) RemoteExperienceMaker     | experience.StreamingExperienceMaker | a role streams |

Each class is bound to the run's plan (``plan.resolve``, once, before Ray starts): the trainer and every model actor
receive it as a constructor argument, so no process derives it again from ``args``.

With ``patches/openrlhf`` applied, upstream's own ``train_ppo_ray`` loads this module as an extension
(the ``openrlhf.extensions`` entry point): ``add_arguments`` and ``configure`` below, which sets
upstream's ``COMPONENTS`` instead of swapping globals.

Tools that run OPPO's CLI in a driver of their own change what the rollout actors sample through one extension
point, ``set_sampling_params_hook`` (and ``set_engine_kwargs`` for vLLM's own arguments), called before the CLI
starts; the runtime itself registers no hook and imports no tool. The benchmark's driver (``python -m
openrlhf_oppo.bench.driver``) registers its fixed-length workload there, and seeds upstream's prompt shuffle by
swapping upstream's strategy class itself.
"""

import importlib
import sys

from openrlhf_oppo import config, plan, preflight

add_arguments = config.add_arguments

_configured = {}  # id(args) -> args: the wrapper and a patched upstream's extension hook both call configure
_sampling_params_hook = None  # set_sampling_params_hook
_engine_kwargs = {}  # set_engine_kwargs


def set_sampling_params_hook(hook) -> None:
    """Have every rollout actor of the runs this process starts call ``hook(sampling_params, label)`` on each
    prompt's sampling params, and sample that prompt's responses with what it returns (a copy: upstream passes the
    same params for every prompt). ``label`` is the prompt's ``--data.label_key`` value. ``None`` removes the hook.

    The hook reaches the actors pickled, so it must be a module-level function of an importable module. With a
    hook, OPPO's rollout actor takes the place of upstream's even with OPPO off (it streams nothing then). Call
    this before the CLI starts (``cli.train_ppo_ray.main``), which swaps the classes before upstream imports them.
    """
    global _sampling_params_hook
    _sampling_params_hook = hook


def set_engine_kwargs(**kwargs) -> None:
    """Start every vLLM engine of the runs this process starts with ``kwargs`` over upstream's engine arguments:
    ``kv_cache_memory_bytes``, say, a KV cache of that size instead of the one vLLM sizes from the GPU memory free
    while it starts (which other processes on the GPU change). As with a sampling params hook, OPPO's rollout actor
    then takes the place of upstream's even with OPPO off. No arguments: upstream's again. Call this before the CLI
    starts."""
    global _engine_kwargs
    _engine_kwargs = dict(kwargs)


def _tool_settings() -> bool:
    """Whether a tool set what the rollout actors do (``set_sampling_params_hook``, ``set_engine_kwargs``)."""
    return _sampling_params_hook is not None or bool(_engine_kwargs)


def _rollout_config(stream_interval: int = 1):
    from openrlhf_oppo.streaming.rollout import RolloutConfig

    return RolloutConfig(
        stream_interval=stream_interval, sampling_params_hook=_sampling_params_hook, engine_kwargs=_engine_kwargs
    )


def configure(args) -> None:
    """Upstream's extension hook (patches/openrlhf/0001): resolve the plan, apply it, and choose OPPO's classes,
    each given the plan."""
    if _configured.get(id(args)) is args:
        return
    _configured[id(args)] = args
    train_batch_given = args.train.batch_size is not None  # config.add_arguments left upstream's default out
    if not train_batch_given:
        args.train.batch_size = config.UPSTREAM_TRAIN_BATCH_SIZE
    preflight.check_flags(args, train_batch_given)  # the batch and lengths the plan builds on
    run_plan = plan.resolve(args)
    plan.apply_upstream_changes(args, run_plan)
    print(f"[openrlhf-oppo] {plan.describe(run_plan)}", flush=True)
    if run_plan.memory.warning():
        print(f"[openrlhf-oppo] warning: {run_plan.memory.warning()}", flush=True)
    preflight.warn_of_the_first_tokens_log_prob(args)
    preflight.check(args, run_plan)  # what the flags point at: datasets, folders, models, the cache budget
    if args.oppo.colocate_models:
        # Upstream's experience maker and trainer then treat the shared GPUs as colocated. A patched upstream's
        # train() places the models from these flags (patch 0002), which is why the plan's topology is written
        # into its namespace; OPPO's own code (placement.train, the preflight) reads the plan.
        args.train.colocate_models = args.train.colocate_actor_ref = args.train.colocate_critic_reward = True
        args.train.frozen_models_with_vllm = bool(run_plan.topology.frozen_beside_engines)
    if not (run_plan.enabled or _tool_settings()):
        return
    from openrlhf_oppo.streaming.rollout import BoundActorClass, OPPORolloutRayActor, with_config

    rollout = _rollout_config(run_plan.stream.interval)
    components = sys.modules["__main__"].__dict__.get("COMPONENTS")
    if components is None:
        # The unpatched driver: install() swapped the classes before the options were parsed. Bind the plan to
        # them now, before train() reads them (a mere parse, without install, swaps nothing).
        from openrlhf.trainer.ray import vllm_engine

        if isinstance(vllm_engine.RolloutRayActor, BoundActorClass):
            vllm_engine.RolloutRayActor = with_config(OPPORolloutRayActor, rollout)
            if run_plan.enabled:
                _bind_swapped_classes(run_plan)
        return
    components.update(rollout=OPPORolloutRayActor, rollout_kwargs=dict(oppo_config=vars(rollout)))
    if run_plan.enabled:
        components.update({role: BoundActorClass(cls, dict(plan=run_plan)) for role, cls in _oppo_classes().items()})


def _oppo_classes() -> dict:
    from openrlhf_oppo.streaming import actors
    from openrlhf_oppo.trainer import OPPOTrainerRayActor

    return dict(
        policy=actors.StreamingPolicyModelRayActor,
        critic=actors.StreamingCriticModelRayActor,
        reward=actors.StreamingRewardModelRayActor,
        reference=actors.StreamingReferenceModelRayActor,
        trainer=OPPOTrainerRayActor,
    )


# Where the unpatched driver (and placement.train) reads each class: (module, global name), by role.
_UPSTREAM_NAMES = dict(
    policy=("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor"),
    critic=("openrlhf.trainer.ray.ppo_critic", "CriticModelActor"),
    reward=("openrlhf.trainer.ray.launcher", "RewardModelActor"),
    reference=("openrlhf.trainer.ray.launcher", "ReferenceModelActor"),
    trainer=("openrlhf.trainer.ppo_trainer", "PPOTrainer"),
)


def _bind_swapped_classes(run_plan) -> None:
    """The unpatched driver imported the model actor classes into its globals when it started, and reads the
    trainer from its module when train() runs: bind the plan in both places."""
    from openrlhf_oppo.streaming.rollout import BoundActorClass

    driver = sys.modules["__main__"].__dict__
    for role, cls in _oppo_classes().items():
        module, name = _UPSTREAM_NAMES[role]
        bound = BoundActorClass(cls, dict(plan=run_plan))
        setattr(importlib.import_module(module), name, bound)
        if driver.get(name) is cls:
            driver[name] = bound


def install(enable: bool) -> None:
    from openrlhf.trainer.ray import vllm_engine

    from openrlhf_oppo.streaming.rollout import OPPORolloutRayActor, with_config

    if enable or _tool_settings():
        vllm_engine.RolloutRayActor = with_config(OPPORolloutRayActor, _rollout_config())
    if not enable:
        # The trained responses by length (lengths.py), logged with OPPO on and off alike: the one change to
        # upstream's synchronous trainer, which trains as before.
        from openrlhf.trainer import ppo_trainer

        from openrlhf_oppo.upstream_trainer import UpstreamPPOTrainer

        ppo_trainer.PPOTrainer = UpstreamPPOTrainer
        return
    for role, cls in _oppo_classes().items():
        module, name = _UPSTREAM_NAMES[role]
        setattr(importlib.import_module(module), name, cls)


def replace_placement(driver_globals: dict) -> None:
    """Run ``placement.train`` where the upstream driver calls ``train`` (``--oppo.colocate_models``)."""
    from openrlhf_oppo import placement

    driver_globals["train"] = placement.train
