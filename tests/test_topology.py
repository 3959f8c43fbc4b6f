"""One answer to which models a run has and on which GPUs (``openrlhf_oppo.topology``): the preflight's placement,
the memory estimate's GPUs and the plan's streamed models read it, and agree with upstream's ``train``."""

import json

import pytest

from openrlhf_oppo import memory, preflight, topology
from openrlhf_oppo.plan import resolve
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
@pytest.mark.parametrize("placement", [[], ["--oppo.colocate_models"], ["--train.colocate_all"]])
def test_preflight_memory_and_the_plan_agree_on_the_models_and_their_gpus(run, extra, models, placement):
    """Upstream makes a critic for GAE only, no reward model under an agent (its driver sets --reward.remote_url
    agent), and a reference only with a KL coefficient. The preflight's placement, the memory estimate's GPU
    groups and the streamed models are those of the one topology."""
    args = run(*extra, *placement)
    plan = resolve(args)
    topo = topology.of(args, plan.frozen_scorers_on == "generation")
    assert topo.models == models
    shown = [sorted(preflight.SHOWN.get(r, r) for r in group.roles) for group in topo.groups]
    assert [sorted(names) for names, _ in preflight.placement(args)] == shown
    assert sum(count for _, count in preflight.placement(args)) == topo.gpus
    shapes = {role: memory.model_shape(path) for role, path in topology.checkpoints(args).items()}
    assert set(shapes) == set(models)
    estimate = memory.estimate(args, plan.layout, 80.0, shapes=shapes)
    assert [peak.label.split(" ")[0] for peak in estimate.per_gpu] == [
        g.label for g in topo.groups for _ in range(g.gpus)
    ]
    in_estimate = {
        part.split(" ")[0] for peak in estimate.per_gpu for rows in peak.phases.values() for part, _ in rows
    }
    assert in_estimate & set(topology.ROLES) == set(models)
    assert set(plan.streamed_roles) <= set(models)
