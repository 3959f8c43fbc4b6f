"""patches/openrlhf: they apply, in order, to the installed OpenRLHF 0.11.2; with them applied, upstream's
own train_ppo_ray loads OPPO as an extension, OPPO's wrapper keeps working, and the fixes do what they
say (prompt order seeded, tokenizer sent once, advantages equal bit for bit, a checkpoint of an episode's
last step resumes in the next episode, the critic's training awaited first with a hook after it, the
sleep-mode branch a method, CPU Adam on the host's cores, awake colocated engines up before the models load,
ppo_train's metrics read to the host once per fit, the rollouts' min_tokens a flag;
the bucketed weight sync of 0007 runs against a real engine in test_weight_sync.py, and 0016's evaluation in
one dispatch in test_streaming_pipeline.py).

Each check runs as a fresh interpreter would, in a fork of one that imported the patched (or the released)
OpenRLHF once (``forking_python.py``); the prompt order, which must be the same in two processes, and the
training helper run in fresh interpreters side by side."""

import json
import os
import sys
import textwrap
from pathlib import Path

import openrlhf
import pytest

from conftest import run_together
from forking_python import ForkingPython

from openrlhf_oppo.bench.patched_upstream import patches

pytestmark = pytest.mark.process

PATCHES = patches()
BASE = "--actor.model_name_or_path m --reward.model_name_or_path m --vllm.num_engines 1 --rollout.batch_size 16"
BASE += "".join(f" --{role}.num_gpus_per_node 2" for role in ("actor", "critic", "reward", "ref"))
# What the snippets import: loaded once by each forking interpreter.
STACK = "import deepspeed, ray, torch, transformers, vllm, openrlhf.trainer.ppo_trainer, openrlhf.trainer.ray.launcher"


@pytest.fixture(scope="module")
def patched(patched_openrlhf):
    return Path(patched_openrlhf)


def _path_first(patched) -> str:
    return f"import sys; sys.path.insert(0, {str(patched)!r})  # before anything imports openrlhf\n"


@pytest.fixture(scope="module")
def patched_python(patched):
    """An interpreter with the patched openrlhf first on its path; each snippet runs in a fork of it."""
    python = ForkingPython(_path_first(patched) + STACK)
    yield python
    python.close()


@pytest.fixture(scope="module")
def released_python():
    """The same with OpenRLHF as released (installed)."""
    python = ForkingPython(STACK)
    yield python
    python.close()


def run(python, code):
    """``code`` as a fresh interpreter of ``python``'s openrlhf runs it (a fork of ``ForkingPython``)."""
    result = python.run(textwrap.dedent(code))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_there_are_patches():
    assert [p.name[:4] for p in PATCHES] == [
        "0001",
        "0002",
        "0003",
        "0004",
        "0005",
        "0006",
        "0007",
        "0008",
        "0009",
        "0010",
        "0011",
        "0012",
        "0013",
        "0014",
        "0015",
        "0016",
    ]


def test_upstream_cli_loads_oppo_as_an_extension(patched, patched_python):
    out = run(
        patched_python,
        f"""
        import runpy, sys
        import openrlhf, openrlhf.utils, ray
        assert openrlhf.__file__.startswith({str(patched)!r})

        class Captured(Exception):
            pass

        def capture(args):  # stop where train() starts, and show what it would build
            components = sys.modules["__main__"].COMPONENTS
            raise Captured(args, components)

        ray.is_initialized = lambda: True
        openrlhf.utils.get_strategy = capture
        sys.argv = ["train_ppo_ray"] + {BASE!r}.split() + ["--oppo.enable", "--oppo.colocate_models"]
        try:
            runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
        except Captured as captured:
            args, components = captured.args
            trainer = components["trainer"]  # bound to the run's plan
            print("trainer", trainer.actor_class.__ray_actor_class__.__name__)
            print("rollout", components["rollout"].__ray_actor_class__.__name__)
            plan = trainer.extra_kwargs["plan"]
            print("streamed", list(plan.stream.roles), "colocate_models", args.train.colocate_models)
            print("same plan", all(components[r].extra_kwargs["plan"] is plan for r in ("policy", "critic")))
        """,
    )
    assert "trainer OPPOTrainer" in out and "rollout OPPORolloutActor" in out and "same plan True" in out
    assert "colocate_models True" in out and "'policy', 'critic', 'reward', 'reference'" in out


def test_oppo_wrapper_works_with_the_patches(patched_python):
    out = run(
        patched_python,
        f"""
        from openrlhf_oppo.cli.train_ppo_ray import parse_args
        from openrlhf_oppo.plan import resolve
        plan = resolve(parse_args({BASE!r}.split() + ["--oppo.enable", "--oppo.overcommit", "3"]))
        print("overcommit", plan.carry.overcommit.initial, "inter", plan.inter_step)
        args = parse_args({BASE!r}.split())
        print("enable", args.oppo.enable)
        """,
    )
    assert "overcommit 3 inter True" in out and "enable False" in out


def test_patched_cli_help_lists_the_new_placement_sync_and_oppo_options(patched_python):
    out = run(
        patched_python,
        """
        import contextlib, io, runpy, sys
        sys.argv, out = ["train_ppo_ray", "--help"], io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
            except SystemExit:
                pass
        help = out.getvalue()
        print("colocate_models" in help, "--oppo.enable" in help, "--vllm.sync_bucket_mb" in help)
        """,
    )
    assert out.split()[-3:] == ["True", "True", "True"]


def test_patched_prompt_shuffle_is_the_same_in_every_process(patched):
    code = """
        from openrlhf.utils.deepspeed import DeepspeedStrategy

        strategy = DeepspeedStrategy.__new__(DeepspeedStrategy)  # setup_dataloader needs only the seed here
        strategy.seed = 5
        print([int(i) for i in strategy.setup_dataloader(list(range(64)), 1, True, True, None)])
        """
    # Two fresh interpreters: forks of one would share its random state whatever the patch does.
    command = [sys.executable, "-c", _path_first(patched) + textwrap.dedent(code)]
    orders = []
    for done in run_together([command, command], timeout=300):
        assert done.returncode == 0, done.stderr[-4000:]
        orders.append(done.stdout.splitlines()[-1])
    assert orders[0] == orders[1] != str(list(range(64)))


def test_patched_generator_sends_the_tokenizer_once(patched_python):
    out = run(
        patched_python,
        """
        from types import SimpleNamespace
        import ray
        from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

        class Method:  # actor_handle.method.remote(...) without a Ray cluster: records the call
            def __init__(self, calls, name, result=None):
                self.calls, self.name, self.result = calls, name, result
            def remote(self, *args, **kwargs):
                self.calls.append((self.name, args, kwargs))
                return self.result

        calls = []
        engine = SimpleNamespace(
            set_tokenizer=Method(calls, "set_tokenizer"),
            get_num_unfinished_requests=Method(calls, "pending", 0),
            generate_responses=Method(calls, "generate"),
        )
        ray.get = lambda refs: refs
        args = SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")),
                               rollout=SimpleNamespace(n_samples_per_prompt=1))
        generator = SamplesGenerator(SimpleNamespace(args=args), None, None, "TOKENIZER", [engine])
        for _ in range(2):
            generator._dispatch_prompts_to_vllm(["a", "b"], ["1", "2"], max_new_tokens=4)
        print([name for name, _, _ in calls])
        sent = [args for name, args, _ in calls if name == "set_tokenizer"]
        print([kw.get("hf_tokenizer") for name, _, kw in calls if name == "generate"], sent)
        """,
    )
    names, tokenizers = out.splitlines()[-2:]
    assert names == str(["pending", "set_tokenizer", "generate", "generate", "pending", "generate", "generate"])
    assert tokenizers == "[None, None, None, None] [('TOKENIZER',)]"


def test_patched_advantages_equal_upstreams_bit_for_bit(patched_python):
    upstream = Path(openrlhf.__file__).parent / "trainer" / "ppo_utils" / "experience_maker.py"
    out = run(
        patched_python,
        f"""
        import importlib.util, time, torch
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as Patched

        spec = importlib.util.spec_from_file_location("upstream_experience_maker", {str(upstream)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        Upstream = module.RemoteExperienceMaker

        torch.manual_seed(0)
        equal = True
        for length in (1, 2, 7, 500):
            for gamma, lambd in ((1.0, 0.95), (0.99, 0.9)):
                values, rewards = torch.randn(8, length) * 3, torch.randn(8, length)
                mask = torch.rand(8, length) > 0.2
                for ours, theirs in zip(
                    Patched.get_advantages_and_returns(None, values, rewards, mask, gamma, lambd),
                    Upstream.get_advantages_and_returns(None, values, rewards, mask, gamma, lambd),
                ):
                    equal &= ours.dtype == theirs.dtype and torch.equal(ours, theirs)
                for m in (mask, None):
                    ours = Patched.get_cumulative_returns(None, rewards, m, gamma)
                    equal &= torch.equal(ours, Upstream.get_cumulative_returns(None, rewards, m, gamma))
        # bf16 (not the float32 fast path) still takes upstream's loop
        values = torch.randn(2, 5, dtype=torch.bfloat16)
        ours = Patched.get_advantages_and_returns(None, values, values, None, 1.0, 0.95)[0]
        equal &= torch.equal(ours, Upstream.get_advantages_and_returns(None, values, values, None, 1.0, 0.95)[0])
        print("equal", equal)
        """,
    )
    assert out.splitlines()[-1] == "equal True"


RESUME_FROM_EVERY_STEP = """
    import copy, json
    from types import SimpleNamespace as NS
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator, _collect_prompt_batch

    class Generator(SamplesGenerator):
        # Upstream's generate_samples; each prompt stands for its samples (no vLLM here).
        def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs):
            prompts, _, _, exhausted = _collect_prompt_batch(dataloader_iter, num_prompts)
            return prompts, len(prompts), exhausted or not prompts

    args = NS(
        train=NS(num_episodes=2), algo=NS(dynamic_filtering_enable=False), eval=NS(steps=float("inf")),
        rollout=NS(batch_size=2, n_samples_per_prompt=1), vllm=NS(enable_sleep=False), ckpt=NS(best_metric_key=""),
    )

    def fit(states):
        '''Upstream's PPOTrainer.fit from ``states`` with a fresh trainer and dataloader: the prompts trained
        and the checkpoint saved at each step.'''
        trainer = PPOTrainer.__ray_actor_class__.__new__(PPOTrainer.__ray_actor_class__)
        loader = StatefulDataLoader(
            ["p0", "p1", "p2", "p3", "p4"], batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0),
            collate_fn=lambda batch: (None, batch, [None] * len(batch), [None] * len(batch)),
        )
        trained, saved = [], []
        trainer.__dict__.update(
            args=args, prompts_dataloader=loader, eval_dataloader=None, generate_kwargs={}, wandb_logger=None,
            tensorboard_logger=None, best_eval_metric_key="", best_eval_metric_value=float("-inf"),
            samples_generator=Generator(NS(args=args), loader, None, None, []),
            init_checkpoint_states=lambda: copy.deepcopy(states),
            broadcast_to_vllm=lambda: None,
            train_step=lambda samples, step: (trained.append(samples), ({}, step + 1))[1],
            save_logs_and_checkpoints=lambda step, status, states: saved.append(copy.deepcopy(states)),
        )
        trainer.fit()
        return trained, saved

    full, checkpoints = fit(dict(episode=0, global_step=0, total_consumed_prompts=0, data_loader_state_dict={}))
    resumed = [full[: state["global_step"]] + fit(state)[0] for state in checkpoints]
    print(json.dumps(dict(full=full, resumed=resumed, episodes=[s["episode"] for s in checkpoints])))
"""


def _episodes_trained_once(steps, prompts):
    """Every prompt once in the first episode's steps, then once in the second's."""
    flat = [prompt for step in steps for prompt in step]
    bounds = {sum(len(step) for step in steps[:i]) for i in range(len(steps) + 1)}
    return sorted(flat[: len(prompts)]) == sorted(flat[len(prompts) :]) == prompts and len(prompts) in bounds


def test_patched_trainer_resumes_an_ended_episode_in_the_next(patched_python, released_python):
    """Upstream's fit, resumed from the checkpoint of every step of two episodes: patched, every prompt is
    trained once an episode; as released, a resume from an episode's last step trains an extra epoch."""
    prompts = ["p0", "p1", "p2", "p3", "p4"]  # B=2: the third step of an episode has one prompt and ends it
    result = json.loads(run(patched_python, RESUME_FROM_EVERY_STEP).splitlines()[-1])
    assert result["episodes"] == [0, 0, 1, 1, 1, 2]
    assert _episodes_trained_once(result["full"], prompts)
    assert all(_episodes_trained_once(steps, prompts) for steps in result["resumed"])

    result = json.loads(run(released_python, RESUME_FROM_EVERY_STEP).splitlines()[-1])
    assert result["episodes"] == [0, 0, 0, 1, 1, 1]
    trained = [sum(len(step) for step in steps) for steps in result["resumed"]]
    assert trained == [10, 10, 15, 10, 10, 15]  # an extra epoch after the resumes from steps 3 and 6


# ppo_train's loop alone: model groups whose calls return at once, and a ray.get that logs when each is
# awaited (no models, no Ray).
FAKE_GROUPS = """
    import json
    from types import SimpleNamespace

    import ray
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    log = []

    class Group:
        def __init__(self, name):
            self.name = name

        def async_run_method(self, method_name, **kwargs):
            log.append(f"{self.name} {method_name}")
            return [self.name]

    def get(refs):
        log.extend(f"{ref} awaited" for ref in refs)
        return [{f"{ref}_loss": 1.0} for ref in refs]

    ray.get = get

    def fake_trainer(enable_sleep, **hooks):
        ds, critic = SimpleNamespace(enable_sleep=enable_sleep), SimpleNamespace(freezing_steps=-1)
        return SimpleNamespace(
            args=SimpleNamespace(ds=ds, critic=critic),
            critic_model_group=Group("critic"),
            actor_model_group=Group("actor"),
            kl_ctl=SimpleNamespace(value=0.0),
            **hooks,
        )
"""

CRITIC_FIRST = (
    FAKE_GROUPS
    + """
    trainer = fake_trainer(False, on_critic_trained=lambda: log.append("on_critic_trained"))
    status = BasePPOTrainer.ppo_train(trainer, 1)
    print(json.dumps([log, status]))
"""
)


def test_patched_ppo_train_awaits_the_critic_first_and_calls_the_hook(patched_python):
    """Patch 0009: both models start training together; the critic's results are awaited first, then
    on_critic_trained runs while the actor may still train; the status is the same merge of both."""
    log, status = json.loads(run(patched_python, CRITIC_FIRST).splitlines()[-1])
    assert log == ["critic fit", "actor fit", "critic awaited", "on_critic_trained", "actor awaited"]
    assert status == {"critic_loss": 1.0, "actor_loss": 1.0}


SLEEP_MODE = (
    FAKE_GROUPS
    + """
    trainer = fake_trainer(True)
    hooked = hasattr(BasePPOTrainer, "ppo_train_sleeping")
    if hooked:  # the hook, logged where ppo_train calls it

        def sleeping(*run):
            log.append("ppo_train_sleeping")
            return BasePPOTrainer.ppo_train_sleeping(trainer, *run)

        trainer.ppo_train_sleeping = sleeping
    status = BasePPOTrainer.ppo_train(trainer, 1)
    print(json.dumps([hooked, log, status]))
"""
)


def test_patched_sleep_mode_branch_is_a_method_that_makes_the_same_calls(patched_python, released_python):
    """Patch 0010: in sleep mode ppo_train calls ppo_train_sleeping, which makes upstream's calls in
    upstream's order (reload, fit, offload of the critic, then of the actor) and returns the same status."""
    hooked, log, status = json.loads(run(patched_python, SLEEP_MODE).splitlines()[-1])
    assert hooked and log[0] == "ppo_train_sleeping"  # patched, ppo_train goes through the hook
    released = json.loads(run(released_python, SLEEP_MODE).splitlines()[-1])
    assert released == [False, log[1:], status]  # upstream's own calls
    calls = [entry for entry in log[1:] if not entry.endswith("awaited")]
    assert calls == [
        f"{model} {call}" for model in ("critic", "actor") for call in ("reload_states", "fit", "offload_states")
    ]
    assert status == {"critic_loss": 1.0, "actor_loss": 1.0}


def test_patched_model_actors_give_cpu_adam_the_hosts_cores(patched, patched_python):
    out = run(
        patched_python,
        f"""
        import os
        from types import SimpleNamespace
        import ray, torch
        from openrlhf.trainer.ray.launcher import BaseModelActor

        class Rank(BaseModelActor):  # upstream's model actors start with _setup_distributed
            def setup(self, strategy):
                self._setup_distributed(strategy)
                return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env=dict(env_vars=dict(PYTHONPATH={str(patched)!r})))
        for adam_offload in (True, False):
            args = SimpleNamespace(actor=SimpleNamespace(num_gpus_per_node=1),
                                   critic=SimpleNamespace(model_name_or_path=None, num_gpus_per_node=1))
            strategy = SimpleNamespace(setup_distributed=lambda: None, adam_offload=adam_offload, args=args)
            rank = ray.remote(num_gpus=0)(Rank).options(num_cpus=0.2).remote(1, 0, "127.0.0.1", 29500)
            print(adam_offload, *ray.get(rank.setup.remote(strategy)))
        """,
    )
    cores = len(os.sched_getaffinity(0))
    assert out.splitlines()[-2:] == [f"True 1 {cores}", "False 1 1"]


def test_patched_rollout_actor_leaves_the_text_to_those_that_read_it(patched_python):
    """Patch 0012: the detokenize flag upstream's ``RolloutRayActor.generate`` hands vLLM, for the single-turn
    executor (which decodes the token ids itself), with stop strings (matched on the text), and for a
    multi-turn agent (which reads the text). The engine's outputs under each flag are compared in
    test_streaming_pipeline.py."""
    out = run(
        patched_python,
        """
        import asyncio
        from types import SimpleNamespace
        from vllm import SamplingParams
        from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
        from openrlhf.utils.agent import MultiTurnAgentExecutor, SingleTurnAgentExecutor

        class Recorder:  # what the actor hands vLLM's generate
            async def generate(self, prompt, params, request_id):
                self.detokenize = params.detokenize
                yield "output"

        async def detokenize(executor, params):
            actor = SimpleNamespace(executor=executor, llm=Recorder(), _mm_pad_token_ids=None)
            await RolloutRayActor.__ray_actor_class__.generate(actor, [1, 2, 3], params)
            return actor.llm.detokenize

        single, multi = SingleTurnAgentExecutor(), MultiTurnAgentExecutor.__new__(MultiTurnAgentExecutor)
        print(asyncio.run(detokenize(single, SamplingParams(max_tokens=4))),
              asyncio.run(detokenize(single, SamplingParams(max_tokens=4, stop=["</answer>"]))),
              asyncio.run(detokenize(multi, SamplingParams(max_tokens=4))))
        """,
    )
    assert out.split()[-3:] == ["False", "True", "True"]


def test_patched_create_vllm_engines_waits_for_awake_engines_on_the_models_gpus(patched_python):
    """Patch 0013: under --train.colocate_all with vLLM awake (a shared placement group, no sleep),
    ``create_vllm_engines`` returns once the engines are up, so that the models load beside a started engine;
    engines on GPUs of their own are not waited for. The engine actor starts as vLLM's does: its creation task
    returns once the engine is up (three seconds here). Ray is told of one GPU, which nothing uses."""
    out = run(
        patched_python,
        """
        import asyncio, os, tempfile
        import ray
        from ray.util.placement_group import placement_group
        from openrlhf.trainer.ray import vllm_engine

        @ray.remote
        class SlowStartingEngine:
            async def __init__(self, model, **kwargs):
                await asyncio.sleep(3)
                open(model, "w").close()

        vllm_engine.RolloutRayActor = SlowStartingEngine
        ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
        folder = tempfile.mkdtemp()

        def up_on_return(name, shared_pg):
            marker = os.path.join(folder, name)
            engines = vllm_engine.create_vllm_engines(1, 1, marker, 0, False, False, False, 128, shared_pg, 0.2)
            up = os.path.exists(marker)
            ray.get([engine.__ray_ready__.remote() for engine in engines])
            for engine in engines:
                ray.kill(engine)
            return up

        shared = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
        ray.get(shared.ready())
        print(up_on_return("colocated", shared))
        ray.util.remove_placement_group(shared)
        print(up_on_return("apart", None))
        ray.shutdown()
        """,
    )
    assert out.split()[-2:] == ["True", "False"]


def test_patched_ppo_train_reads_its_metrics_once_per_fit(patched_python, released_python, checkpoints):
    """Patch 0014: the actor's and the critic's ppo_train (real training_step, tiny models, CPU) return the same
    status and train the same weights as upstream's, and OpenRLHF's own reads of tensors to the host during a fit
    no longer grow with the micro-batches (on a GPU each read waits for the GPU to finish the micro-batch)."""
    helper = [str(Path(__file__).parent / "ppo_train_reads_helper.py"), checkpoints["actor"], checkpoints["reward"]]
    script = f"import runpy, sys; sys.argv = {helper!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    fits = {
        name: json.loads(run(python, script).splitlines()[-1])
        for name, python in (("upstream", released_python), ("patched", patched_python))
    }
    for count in ("4", "8"):
        upstream, patched_fit = fits["upstream"][count], fits["patched"][count]
        assert patched_fit["weights"] == upstream["weights"]
        for model in ("actor", "critic"):
            assert patched_fit[model].keys() == upstream[model].keys()
            for key, value in upstream[model].items():
                assert patched_fit[model][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (model, key)
    reads = {name: [(fit["actor_reads"], fit["critic_reads"]) for fit in runs.values()] for name, runs in fits.items()}
    assert reads["upstream"][1][0] > reads["upstream"][0][0] and reads["upstream"][1][1] > reads["upstream"][0][1]
    assert reads["patched"] == [(2, 1), (2, 1)]  # the actor's sums and gradient norm; the critic's means


def test_patched_cli_takes_min_new_tokens_to_the_rollouts_sampling(patched_python):
    """Patch 0015: ``--rollout.min_new_tokens`` (default 1, upstream's) is parsed, ``train`` hands it to the
    trainer with the other generate kwargs, and upstream's samples generator samples with it as min_tokens. What
    vLLM does with min_tokens 1 and 0 is in test_learning.py."""
    out = run(
        patched_python,
        f"""
        import ast, inspect
        from types import SimpleNamespace
        import ray
        from openrlhf.cli import train_ppo_ray
        from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
        from openrlhf_oppo.cli.train_ppo_ray import parse_args

        print("parsed", parse_args({BASE!r}.split()).rollout.min_new_tokens,
              parse_args({BASE!r}.split() + ["--rollout.min_new_tokens", "0"]).rollout.min_new_tokens)
        corrected = {BASE!r}.split() + ["--algo.advantage.is_correction_level", "token"]
        parse_args(corrected)
        print("then")
        parse_args(corrected + ["--rollout.min_new_tokens", "0"])
        call = next(node for node in ast.walk(ast.parse(inspect.getsource(train_ppo_ray.train)))
                    if isinstance(node, ast.Call) and ast.unparse(node.func) == "PPOTrainer.remote")
        print("passed", [ast.unparse(k.value) for k in call.keywords if k.arg == "min_new_tokens"])

        sent = []
        engine = SimpleNamespace(
            set_tokenizer=SimpleNamespace(remote=lambda *a, **k: None),
            get_num_unfinished_requests=SimpleNamespace(remote=lambda: 0),
            generate_responses=SimpleNamespace(remote=lambda *a, **k: sent.append(k["sampling_params"])),
        )
        ray.get = lambda refs: refs
        args = SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="token")),
                               rollout=SimpleNamespace(n_samples_per_prompt=1))
        generator = SamplesGenerator(SimpleNamespace(args=args), None, None, "TOKENIZER", [engine])
        generator._dispatch_prompts_to_vllm(["a"], ["1"], max_new_tokens=4, min_new_tokens=0)
        generator._dispatch_prompts_to_vllm(["a"], ["1"], max_new_tokens=4)
        print("sampled", [params.min_tokens for params in sent])
        """,
    )
    assert "parsed 1 0" in out
    # With the importance correction on, the parse warns of the first token's log-prob until it is set to 0.
    warned, after = out.split("\nthen\n")
    assert "the correction is biased there" in warned and "(--rollout.min_new_tokens 0 removes it)" in warned
    assert "the correction is biased there" not in after.split("passed")[0]
    assert "passed ['args.rollout.min_new_tokens']" in out
    assert "sampled [0, 1]" in out
