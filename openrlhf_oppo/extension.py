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
| train_ppo_ray.train (the placement)        | placement.train                 | --oppo.colocate_models            |
| (in OPPOTrainer) SamplesGenerator          | samples.OPPOSamplesGenerator / overcommit.sampler.OvercommitSamplesGenerator | --oppo.enable |
| (in OPPOTrainer) RemoteExperienceMaker     | streaming.experience.StreamingExperienceMaker | a model streams |

The subclasses do nothing new until the trainer configures them from ``args.oppo`` (resolved once by
``config.validate``), so swapping them in is safe whatever the rest of the options say.
"""


def install(enable: bool, lengths_from_label: bool = False, trace: bool = False) -> None:
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher, ppo_actor, ppo_critic, vllm_engine

    from openrlhf_oppo.streaming.rollout import OPPORolloutRayActor, RolloutConfig, with_config

    if enable or lengths_from_label:
        config = RolloutConfig(lengths_from_label=lengths_from_label, trace=trace)
        vllm_engine.RolloutRayActor = with_config(OPPORolloutRayActor, config)
    if not enable:
        return

    from openrlhf_oppo.streaming import actors
    from openrlhf_oppo.trainer import OPPOPPOTrainer

    launcher.RewardModelActor = actors.StreamingRewardModelRayActor
    launcher.ReferenceModelActor = actors.StreamingReferenceModelRayActor
    ppo_critic.CriticModelActor = actors.StreamingCriticModelRayActor
    ppo_actor.PolicyModelActor = actors.StreamingPolicyModelRayActor
    ppo_trainer.PPOTrainer = OPPOPPOTrainer


def replace_placement(driver_globals: dict) -> None:
    """Run ``placement.train`` where the upstream driver calls ``train`` (``--oppo.colocate_models``)."""
    from openrlhf_oppo import placement

    driver_globals["train"] = placement.train
