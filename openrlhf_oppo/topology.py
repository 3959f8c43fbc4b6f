"""Which models a run has and on which GPUs: one answer for the plan, the memory estimate, the preflight and the
predictor, from the flags as upstream's ``train`` (0.11.2) reads them.

Upstream's driver settles two things after parsing, before ``train``: ``--train.agent_func_path`` sets
``--reward.remote_url agent`` (no reward model), and the critic exists only for GAE (its checkpoint defaults to the
reward model's, or the actor's). OPPO's plan resolves before that, so ``models`` reads the flags as the driver
will leave them, not as parsed.
"""

from dataclasses import dataclass
from typing import Tuple

ROLES = ("policy", "critic", "reward", "reference")
FROZEN = ("reward", "reference")
LOG_PROBS = ("policy", "reference")
# Each role's option group in OpenRLHF's flags (``--actor.num_gpus_per_node``, ...).
FLAG_GROUP = {"policy": "actor", "critic": "critic", "reward": "reward", "reference": "ref"}
ENGINES = "vllm"
# The order upstream's ``train`` creates the models' actor groups in (each asks Ray for its GPUs then).
CREATED = ("policy", "reference", "critic", "reward")


@dataclass(frozen=True)
class GPUGroup:
    """GPUs that hold the same processes: one rank of each role (or engine) per GPU."""

    label: str
    gpus: int
    roles: Tuple[str, ...]  # models and ``ENGINES``


@dataclass(frozen=True)
class Topology:
    models: Tuple[str, ...]  # the models the run loads, in ``ROLES`` order
    groups: Tuple[GPUGroup, ...]  # in the order the placement asks Ray for them

    @property
    def gpus(self) -> int:
        return sum(group.gpus for group in self.groups)

    @property
    def frozen_beside_engines(self) -> Tuple[str, ...]:
        """The models on the engines' own GPUs, where no model trains (``--oppo.frozen_scorers_on generation``):
        they prefill beside decoding, and training leaves them alone."""
        apart = [group for group in self.groups if ENGINES in group.roles and "policy" not in group.roles]
        return tuple(role for group in apart for role in group.roles if role != ENGINES)


def models(args) -> Tuple[str, ...]:
    """The models upstream's ``train`` creates: the critic for GAE only, a reward model unless the reward comes
    from ``--reward.remote_url`` or an agent, the reference only with a KL coefficient."""
    present = {
        "policy": True,
        "critic": args.algo.advantage.estimator == "gae",
        "reward": not (args.reward.remote_url or args.train.agent_func_path),
        "reference": args.algo.kl.init_coef > 0,
    }
    return tuple(role for role in ROLES if present[role])


def checkpoints(args) -> dict:
    """Each model's checkpoint, by role: the critic's defaults as upstream's driver sets it (the reward model's,
    or the actor's where the reward is remote), the reference loads the actor's."""
    present = models(args)
    actor = args.actor.model_name_or_path
    reward = (args.reward.model_name_or_path or "").split(",")[0].strip() or None
    critic = args.critic.model_name_or_path or (reward if "reward" in present else actor)
    paths = dict(policy=actor, critic=critic, reward=reward, reference=actor)
    return {role: paths[role] for role in present}


def ranks(args, role: str) -> int:
    if role == ENGINES:
        return (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    group = getattr(args, FLAG_GROUP[role])
    return group.num_nodes * group.num_gpus_per_node


def of(args, frozen_beside_vllm: bool = False) -> Topology:
    """The run's models and GPU groups, as upstream's ``train`` (or ``placement.train`` under
    ``--oppo.colocate_models``) asks Ray for them. ``frozen_beside_vllm``: the plan put the reward and reference
    models on the engines' GPUs (``--oppo.frozen_scorers_on generation``)."""
    roles = models(args)
    engines = (ENGINES,) if ranks(args, ENGINES) else ()
    train = args.train
    oppo = getattr(args, "oppo", None)
    together = train.colocate_all or bool(oppo is not None and oppo.colocate_models)
    if train.colocate_all and not train.async_enable:
        return Topology(roles, (GPUGroup("shared", ranks(args, "policy"), engines + roles),))
    if together:
        beside = tuple(r for r in roles if r in FROZEN) if frozen_beside_vllm else ()
        groups = [GPUGroup("models", ranks(args, "policy"), tuple(r for r in roles if r not in beside))]
        if engines:
            groups.append(GPUGroup("vLLM", ranks(args, ENGINES), engines + beside))
        return Topology(roles, tuple(groups))
    groups = []
    actor_ref = train.colocate_actor_ref
    if actor_ref:
        groups.append(GPUGroup("policy+reference", ranks(args, "policy"), tuple(r for r in roles if r in LOG_PROBS)))
    if engines:
        groups.append(GPUGroup("vLLM", ranks(args, ENGINES), engines))
    critic_reward = train.colocate_critic_reward and "critic" in roles
    for role in sorted(roles, key=CREATED.index):
        if actor_ref and role in LOG_PROBS or critic_reward and role in ("critic", "reward"):
            continue
        groups.append(GPUGroup(role, ranks(args, role), (role,)))
    if critic_reward:
        shared = tuple(r for r in roles if r in ("critic", "reward"))
        groups.append(GPUGroup("critic+reward", ranks(args, "critic"), shared))
    return Topology(roles, tuple(groups))
