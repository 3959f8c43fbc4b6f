"""``--oppo.colocate_models``: the models on one set of GPUs and the vLLM engines on their own.

Actor, critic, reward and reference share the actor's GPUs, unless ``--oppo.frozen_scorers_on generation``
puts the two frozen models (reward and reference) on the vLLM engines' GPUs instead: they never change
weights, so their streamed prefill can run beside decoding, and the GPUs that train are left with the
critic and the policy. Upstream's split placements need three or more GPU groups, so on 2 GPUs upstream
can only colocate everything.

Upstream builds its placement groups inline in ``openrlhf/cli/train_ppo_ray.py:train`` (0.11.2), with no
hook for another placement, so ``train`` below is COPIED from upstream 0.11.2. Every change is marked
``OPPO change``; ``patches/openrlhf/0002-colocate-models-placement.patch`` adds the
``--train.colocate_models`` and ``--train.frozen_models_with_vllm`` flags that would retire this copy. Where the
frozen models go is the plan's topology (``Plan.topology``), as the preflight and the memory estimate read it.
"""

import os

import ray
from openrlhf.trainer.ray import create_vllm_engines, launcher, ppo_actor, ppo_critic
from openrlhf.trainer.ray.launcher import RayActorGroup
from openrlhf.utils import get_strategy
from ray.util.placement_group import placement_group

from openrlhf_oppo.plan import resolve

# The actor classes are read from their modules when ``train`` runs (``launcher.RewardModelActor``, ...),
# so that the subclasses extension.py swaps in are the ones used.


def _gpu_group(count: int):
    bundles = [{"GPU": 1, "CPU": 1} for _ in range(count)]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    return pg


def train(args):
    """Upstream's ``train`` with the models on one placement group and the vLLM engines apart."""
    # initialize ray if not initialized
    if not ray.is_initialized():
        # Use os.environ.get() to respect user-set values (e.g. NCCL_DEBUG=INFO via
        # ray job submit --runtime-env-json), falling back to sensible defaults.
        ray.init(
            runtime_env={
                "env_vars": {
                    "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
                    "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
                    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
                }
            }
        )

    # configure strategy
    strategy = get_strategy(args)
    strategy.print(args)

    # --- OPPO change: one placement group for the models on the actor's GPUs (upstream: one for actor and
    # reference under colocate_actor_ref / colocate_all, and one for critic and reward under
    # colocate_critic_reward, both removed here), and, with the frozen models beside vLLM, one for the
    # engines' GPUs (upstream lets create_vllm_engines make it). plan.resolve checked the GPU counts. ---
    pg = _gpu_group(args.actor.num_nodes * args.actor.num_gpus_per_node)
    frozen_with_vllm = bool(resolve(args).topology.frozen_beside_engines)  # the plan extension.configure printed
    vllm_pg = _gpu_group(args.vllm.num_engines * args.vllm.tensor_parallel_size) if frozen_with_vllm else None

    # init vLLM engine for text generation
    max_len = args.data.max_len
    vllm_engines = None
    if args.vllm.num_engines is not None and args.vllm.num_engines > 0:
        # --- OPPO change: upstream's colocate_all assertion removed (colocate_all is refused with this placement). ---
        vllm_engines = create_vllm_engines(
            args.vllm.num_engines,
            args.vllm.tensor_parallel_size,
            args.actor.model_name_or_path,
            args.train.seed,
            args.train.full_determinism_enable,
            args.vllm.enable_prefix_caching,
            args.vllm.enforce_eager,
            max_len,
            vllm_pg,  # --- OPPO change: the engines' own GPUs (upstream: the models' pg under colocate_all). ---
            args.vllm.gpu_memory_utilization,
            args.vllm.enable_sleep,
            "processed_logprobs" if args.algo.advantage.is_correction_level != "off" else None,
            agent_func_path=args.train.agent_func_path,
            remote_rm_url=args.reward.remote_url,
            max_images_per_prompt=getattr(args.data, "max_images_per_prompt", 0),
        )
        if frozen_with_vllm:
            # --- OPPO change: the engines take their share of GPU memory before the frozen models load
            # beside them (vLLM sizes its KV cache from the memory it sees at start-up). ---
            ray.get([engine.get_num_unfinished_requests.remote() for engine in vllm_engines])

    actor_model = RayActorGroup(
        args.actor.num_nodes,
        args.actor.num_gpus_per_node,
        ppo_actor.PolicyModelActor,
        pg=pg,
        num_gpus_per_actor=0.2 if pg else 1,
        duplicate_actors=args.ds.ring_attn_size * args.ds.tensor_parallel_size,
    )

    # --- OPPO change: the frozen models' placement group (upstream: pg, or none outside colocate_all). ---
    frozen_pg = vllm_pg if frozen_with_vllm else pg
    if args.algo.kl.init_coef > 0:
        ref_model = RayActorGroup(
            args.ref.num_nodes,
            args.ref.num_gpus_per_node,
            launcher.ReferenceModelActor,
            pg=frozen_pg,
            num_gpus_per_actor=0.2 if frozen_pg else 1,
            duplicate_actors=args.ds.ring_attn_size * args.ds.tensor_parallel_size,
        )
    else:
        ref_model = None

    # --- OPPO change: upstream's `pg = None` and the critic/reward placement group removed: the critic
    # stays on the models' pg. ---
    if args.critic.model_name_or_path:
        critic_model = RayActorGroup(
            args.critic.num_nodes,
            args.critic.num_gpus_per_node,
            ppo_critic.CriticModelActor,
            pg=pg,
            num_gpus_per_actor=0.2 if pg else 1,
            duplicate_actors=args.ds.ring_attn_size * args.ds.tensor_parallel_size,
        )
    else:
        critic_model = None

    # multiple reward models
    if not args.reward.remote_url:
        reward_model = RayActorGroup(
            args.reward.num_nodes,
            args.reward.num_gpus_per_node,
            launcher.RewardModelActor,
            pg=frozen_pg,
            num_gpus_per_actor=0.2 if frozen_pg else 1,
            duplicate_actors=args.ds.ring_attn_size * args.ds.tensor_parallel_size,
        )
    else:
        reward_model = None

    # Select trainer by mode
    if args.train.async_enable:
        from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync as PPOTrainer
    else:
        from openrlhf.trainer.ppo_trainer import PPOTrainer

    # init PPO trainer (Single controller)
    ppo_trainer = PPOTrainer.remote(
        args.actor.model_name_or_path,
        strategy,
        actor_model,
        critic_model,
        reward_model,
        ref_model,
        vllm_engines,
        # generate kwargs
        do_sample=True,
        max_len=max_len,
        max_new_tokens=args.rollout.max_new_tokens,
        # --- OPPO change: patch 0015's --rollout.min_new_tokens, where applied (upstream: 1). ---
        min_new_tokens=getattr(args.rollout, "min_new_tokens", 1),
        temperature=args.rollout.temperature,
        top_p=args.rollout.top_p,
    )

    # training update steps
    max_steps = ray.get(ppo_trainer.get_max_steps.remote())

    # init actor/reference/reward model
    refs = []
    refs.extend(
        actor_model.async_init_model_from_pretrained(strategy, args.actor.model_name_or_path, max_steps, vllm_engines)
    )
    if ref_model is not None:
        refs.extend(ref_model.async_init_model_from_pretrained(strategy, args.actor.model_name_or_path))
    if reward_model is not None and args.reward.model_name_or_path:
        refs.extend(reward_model.async_init_model_from_pretrained(strategy, args.reward.model_name_or_path))
    ray.get(refs)

    if critic_model is not None and args.critic.model_name_or_path:
        # critic scheduler initialization depends on max_step, so we have to init critic after actor
        # TODO: use first reward model as critic model
        refs = critic_model.async_init_model_from_pretrained(strategy, args.critic.model_name_or_path, max_steps)
        ray.get(refs)

    # train actor and critic model
    ray.get(ppo_trainer.fit.remote())

    # save model
    ray.get(actor_model.async_save_model())

    if args.critic.model_name_or_path and args.critic.save_value_network and critic_model is not None:
        ray.get(critic_model.async_save_model())
