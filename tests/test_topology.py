"""One answer to which models a run has and on which GPUs (the plan's ``Topology``): the preflight's placement,
the memory estimate's GPUs, OPPO's placement, the predictor and the plan's streamed models read it, and agree with
upstream's ``train``."""

import json
from types import SimpleNamespace

import pytest

from openrlhf_oppo import memory, preflight, topology
from openrlhf_oppo.plan import resolve
from openrlhf_oppo.predict.runs import setup_of
from openrlhf_oppo.predict.simulate import engine_scored_roles
from openrlhf_oppo.testing import preflight_sweep

pytestmark = pytest.mark.unit

GAE = ["--oppo.enable"]
GROUP_NORM = ["--oppo.enable", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"]


@pytest.fixture
def run(tmp_path, checkpoints):
    prompts = tmp_path / "data" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"input": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(64)))
    agent = tmp_path / "agent.py"
    agent.write_text("async def step(*args, **kwargs):\n    return {}\n")

    def parse(*extra):
        from openrlhf_oppo.cli.train_ppo_ray import parse_args

        root = str(tmp_path)
        paths = {f"{root}/models/actor": checkpoints["actor"], f"{root}/models/reward": checkpoints["reward"]}
        argv = [paths.get(flag, flag) for flag in preflight_sweep.good_argv(root)]
        return parse_args(argv + [flag.replace("AGENT", str(agent)) for flag in extra])

    return parse


SPLIT = ["--oppo.colocate_models"]
# vLLM's share leaves the frozen models room beside it: the plan puts them on the engines' GPUs.
SPLIT_FROZEN_BESIDE_VLLM = SPLIT + ["--vllm.gpu_memory_utilization", "0.7"]


@pytest.mark.parametrize(
    "extra, models",
    [
        (GAE, ("policy", "critic", "reward", "reference")),
        (GROUP_NORM, ("policy", "reward", "reference")),
        (GAE + ["--train.agent_func_path", "AGENT"], ("policy", "critic", "reference")),
        (GAE + ["--algo.kl.init_coef", "0"], ("policy", "critic", "reward")),
    ],
    ids=["gae", "group-norm", "agent-with-a-reward-path", "no-kl"],
)
@pytest.mark.parametrize(
    "placement",
    [[], SPLIT, SPLIT_FROZEN_BESIDE_VLLM, ["--train.colocate_all"]],
    ids=["apart", "split", "split-frozen-beside-vllm", "colocated"],
)
def test_preflight_memory_placement_and_predict_agree_on_the_models_and_their_gpus(
    run, extra, models, placement, monkeypatch
):
    """Upstream makes a critic for GAE only, no reward model under an agent (its driver sets --reward.remote_url
    agent), and a reference only with a KL coefficient. The preflight's placement, the memory estimate's GPU
    groups, the placement OPPO builds (--oppo.colocate_models), the predictor's models and the streamed models are
    those of the plan's one topology."""
    args = run(*extra, *placement)
    plan = resolve(args)
    topo = plan.topology
    assert topo.models == models
    assert topo == topology.of(args, plan.stream.frozen_scorers_on == "generation")
    assert bool(topo.frozen_beside_engines) == (placement == SPLIT_FROZEN_BESIDE_VLLM)
    shown = [sorted(preflight.SHOWN.get(r, r) for r in group.roles) for group in topo.groups]
    assert [sorted(names) for names, _ in preflight.placement(topo)] == shown
    assert sum(count for _, count in preflight.placement(topo)) == topo.gpus
    shapes = {role: memory.model_shape(path) for role, path in topology.checkpoints(args).items()}
    assert set(shapes) == set(models)
    estimate = memory.estimate(args, plan.memory.layout, 80.0, shapes=shapes)
    assert [peak.label.split(" ")[0] for peak in estimate.per_gpu] == [
        g.label for g in topo.groups for _ in range(g.gpus)
    ]
    in_estimate = {
        part.split(" ")[0] for peak in estimate.per_gpu for rows in peak.phases.values() for part, _ in rows
    }
    assert in_estimate & set(topology.ROLES) == set(models)
    assert set(plan.stream.roles) <= set(models)
    setup = setup_of(args, prompt_tokens=64)
    assert setup.roles == models and set(setup.trained) == set(models) & {"policy", "critic"}
    assert setup.colocated == any(topology.ENGINES in g.roles and "policy" in g.roles for g in topo.groups)
    assert set(engine_scored_roles(plan)) - {"policy"} <= set(topo.frozen_beside_engines)
    if "--oppo.colocate_models" in placement:
        assert _groups_placement_train_asks_for(args, monkeypatch) == sorted(
            (sorted(g.roles), g.gpus) for g in topo.groups
        )


def _groups_placement_train_asks_for(args, monkeypatch) -> list:
    """Run ``placement.train`` (OPPO's copy of upstream's) against stand-ins for Ray and the actor groups: each
    placement group it makes, with the models and engines it puts there, as (sorted roles, GPUs)."""
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher, ppo_actor, ppo_critic

    from openrlhf_oppo import placement

    role_of = {
        ppo_actor.PolicyModelActor: "policy",
        ppo_critic.CriticModelActor: "critic",
        launcher.RewardModelActor: "reward",
        launcher.ReferenceModelActor: "reference",
    }
    groups = []  # [roles, GPUs] per placement group, in the order train makes them

    def remote(value=None):
        return SimpleNamespace(remote=lambda *a, **k: value)

    def gpu_group(count):
        groups.append([[], count])
        return len(groups) - 1

    class ActorGroup:
        def __init__(self, nodes, gpus_per_node, actor_class, pg=None, **_):
            groups[pg][0].append(role_of[actor_class])
            self.async_init_model_from_pretrained = lambda *a: []
            self.async_save_model = lambda: None

    def create_vllm_engines(num_engines, tensor_parallel_size, *positional, **_):
        pg = positional[6]
        if pg is None:
            pg = gpu_group(num_engines * tensor_parallel_size)
        groups[pg][0].append(topology.ENGINES)
        return [SimpleNamespace(get_num_unfinished_requests=remote()) for _ in range(num_engines)]

    monkeypatch.setattr(placement, "ray", SimpleNamespace(is_initialized=lambda: True, get=lambda refs: refs))
    monkeypatch.setattr(placement, "get_strategy", lambda args: SimpleNamespace(print=lambda *a: None))
    monkeypatch.setattr(placement, "_gpu_group", gpu_group)
    monkeypatch.setattr(placement, "RayActorGroup", ActorGroup)
    monkeypatch.setattr(placement, "create_vllm_engines", create_vllm_engines)
    trainer = SimpleNamespace(get_max_steps=remote(1), fit=remote())
    monkeypatch.setattr(ppo_trainer, "PPOTrainer", SimpleNamespace(remote=lambda *a, **k: trainer))
    placement.train(args)
    return sorted((sorted(roles), gpus) for roles, gpus in groups if roles)
