"""The one place that decides which upstream classes OPPO replaces.

Upstream's driver (``openrlhf/cli/train_ppo_ray.py``) reads its actor classes from module globals, and
``create_vllm_engines`` reads ``RolloutRayActor`` when it runs; ``install`` swaps those globals before
the driver imports them. Objects that upstream builds inside the trainer actor (the samples generator
and the experience maker) are replaced by ``OPPOTrainer.__init__``, not here.

| upstream                                   | replaced by                     | when                              |
|--------------------------------------------|---------------------------------|-----------------------------------|
| vllm_engine.RolloutRayActor                | streaming.rollout.OPPORolloutActor | --oppo.enable or --bench.lengths_from_label |
| launcher.RewardModelActor                  | streaming.actors.StreamingRewardModelActor    | --oppo.enable |
| launcher.ReferenceModelActor               | streaming.actors.StreamingReferenceModelActor | --oppo.enable |
| ppo_critic.CriticModelActor                | streaming.actors.StreamingCriticModelActor    | --oppo.enable |
| ppo_actor.PolicyModelActor                 | streaming.actors.StreamingPolicyModelActor    | --oppo.enable |
| ppo_trainer.PPOTrainer                     | trainer.OPPOTrainer             | --oppo.enable                     |
| train_ppo_ray.train (the placement)        | placement.train                 | --oppo.colocate_models (and --oppo.frozen_scorers_on) |
| deepspeed.DeepspeedStrategy (get_strategy) | bench.seeded_order.SeededOrderStrategy | --bench.seed_prompt_order  |
| (in OPPOTrainer) SamplesGenerator          | samples.OPPOSamplesGenerator / overcommit.sampler.OvercommitSamplesGenerator | --oppo.enable |
| (in OPPOTrainer) RemoteExperienceMaker     | experience.StreamingExperienceMaker | a role streams |

The subclasses do nothing new until the trainer configures them from ``args.oppo`` (resolved once by
``config.validate``), so swapping them in is safe whatever the rest of the options say.

With ``patches/openrlhf`` applied, upstream's own ``train_ppo_ray`` loads this module as an extension
(the ``openrlhf.extensions`` entry point): ``add_arguments`` and ``configure`` below, which sets
upstream's ``COMPONENTS`` instead of swapping globals.
"""

import sys

from openrlhf_oppo import config, preflight

add_arguments = config.add_arguments


def configure(args) -> None:
    """Upstream's extension hook (patches/openrlhf/0001): check the args and choose OPPO's classes."""
    config.validate(args)
    preflight.check(args)  # what the flags point at: datasets, folders, models, the cache budget
    if args.bench.seed_prompt_order:
        from openrlhf_oppo.bench import seeded_order

        seeded_order.install()
    if args.oppo.colocate_models:
        # Upstream's experience maker and trainer then treat the shared GPUs as colocated; a patched upstream's
        # train() places the models from these flags (patch 0002), the wrapper from placement.train.
        args.train.colocate_models = args.train.colocate_actor_ref = args.train.colocate_critic_reward = True
        args.train.frozen_models_with_vllm = args.oppo.frozen_scorers_on == "generation"
    if not (args.oppo.enable or args.bench.lengths_from_label):
        return
    from openrlhf_oppo.streaming.rollout import BoundActorClass, OPPORolloutRayActor, RolloutConfig, with_config

    rollout = RolloutConfig(
        lengths_from_label=args.bench.lengths_from_label, stream_interval=args.oppo.stream_interval
    )
    components = sys.modules["__main__"].__dict__.get("COMPONENTS")
    if components is None:
        # The unpatched driver: install() swapped the class before the options were parsed. Bind the options to
        # it now, before create_vllm_engines reads the global (a mere parse, without install, swaps nothing).
        from openrlhf.trainer.ray import vllm_engine

        if isinstance(vllm_engine.RolloutRayActor, BoundActorClass):
            vllm_engine.RolloutRayActor = with_config(OPPORolloutRayActor, rollout)
        return
    components.update(rollout=OPPORolloutRayActor, rollout_kwargs=dict(oppo_config=vars(rollout)))
    if args.oppo.enable:
        from openrlhf_oppo.streaming import actors
        from openrlhf_oppo.trainer import OPPOTrainerRayActor

        components.update(
            policy=actors.StreamingPolicyModelRayActor,
            critic=actors.StreamingCriticModelRayActor,
            reward=actors.StreamingRewardModelRayActor,
            reference=actors.StreamingReferenceModelRayActor,
            trainer=OPPOTrainerRayActor,
        )


def install(enable: bool, lengths_from_label: bool = False) -> None:
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher, ppo_actor, ppo_critic, vllm_engine

    from openrlhf_oppo.streaming.rollout import OPPORolloutRayActor, RolloutConfig, with_config

    if enable or lengths_from_label:
        config = RolloutConfig(lengths_from_label=lengths_from_label)
        vllm_engine.RolloutRayActor = with_config(OPPORolloutRayActor, config)
    if not enable:
        return

    from openrlhf_oppo.streaming import actors
    from openrlhf_oppo.trainer import OPPOTrainerRayActor

    launcher.RewardModelActor = actors.StreamingRewardModelRayActor
    launcher.ReferenceModelActor = actors.StreamingReferenceModelRayActor
    ppo_critic.CriticModelActor = actors.StreamingCriticModelRayActor
    ppo_actor.PolicyModelActor = actors.StreamingPolicyModelRayActor
    ppo_trainer.PPOTrainer = OPPOTrainerRayActor


def replace_placement(driver_globals: dict) -> None:
    """Run ``placement.train`` where the upstream driver calls ``train`` (``--oppo.colocate_models``)."""
    from openrlhf_oppo import placement

    driver_globals["train"] = placement.train
