"""What one thread costs DeepSpeed's CPU Adam in a Ray actor placed as OpenRLHF places its model actors.

OpenRLHF asks Ray for as many CPUs as GPUs per model actor, a fraction of one when models share a GPU, and Ray
then starts the actor with OMP_NUM_THREADS=1. With ``--ds.adam_offload`` the optimizer step runs on the CPU, in
PyTorch's OpenMP runtime, so on one core. This starts such an actor (``num_cpus=0.2``) and runs DeepSpeed's CPU
Adam step on ``--params`` float32 parameters and their copy into a bf16 buffer (what goes back to the GPU),
once with the threads the actor started with and once with ``cpu_adam_threads`` set in an earlier call, as
OPPO's training actors and ``patches/openrlhf/0011`` set it when the model loads. It prints the median seconds
of each.

    python examples/scripts/cpu_adam_threads_cpu.py --out runs/cpu-adam-threads.json
"""

import argparse
import json
import os
import platform
import sys
import time
from types import SimpleNamespace

import ray

from openrlhf_oppo.streaming.actors import cpu_adam_threads


@ray.remote(num_gpus=0)
class OptimizerRank:
    def started_with(self, threads: int = None) -> dict:
        """The threads this actor started with; then ``threads``, set as a training actor sets them at init."""
        import torch

        found = dict(omp_num_threads=os.environ.get("OMP_NUM_THREADS"), torch_threads=torch.get_num_threads())
        if threads:
            torch.set_num_threads(threads)
        return found

    def step_seconds(self, params: int, steps: int) -> dict:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        weights = torch.nn.Parameter(torch.randn(params))
        weights.grad = torch.randn(params)
        bf16 = torch.empty(params, dtype=torch.bfloat16)
        optimizer = DeepSpeedCPUAdam([weights], lr=1e-5)
        optimizer.step()  # the first step allocates the moments
        adam, copy = [], []
        for _ in range(steps):
            start = time.perf_counter()
            optimizer.step()
            adam.append(time.perf_counter() - start)
            start = time.perf_counter()
            bf16.copy_(weights.data)
            copy.append(time.perf_counter() - start)
        return dict(
            torch_threads=torch.get_num_threads(),
            adam_step_s=sorted(adam)[len(adam) // 2],
            bf16_copy_s=sorted(copy)[len(copy) // 2],
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="float32 parameters of the rank's partition")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (the median is reported)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()

    # One policy rank and no critic on this host: the rank gets every core.
    threads = cpu_adam_threads(
        SimpleNamespace(actor=SimpleNamespace(num_gpus_per_node=1), critic=SimpleNamespace(model_name_or_path=None))
    )
    ray.init(include_dashboard=False, log_to_driver=False)
    runs = {}
    for name, wanted in (("as placed", None), ("cpu_adam_threads", threads)):
        rank = OptimizerRank.options(num_cpus=0.2).remote()
        started_with = ray.get(rank.started_with.remote(wanted))
        runs[name] = dict(started_with=started_with, **ray.get(rank.step_seconds.remote(args.params, args.steps)))
        ray.kill(rank)
        print(
            f"{name:>16}: {runs[name]['torch_threads']} thread(s), CPU Adam step {runs[name]['adam_step_s']:.3f} s, "
            f"bf16 copy {runs[name]['bf16_copy_s']:.3f} s ({args.params / 1e6:.0f}M parameters)"
        )
    ray.shutdown()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    command=" ".join(["python", "examples/scripts/cpu_adam_threads_cpu.py"] + sys.argv[1:]),
                    date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    machine=dict(cpu=platform.processor() or platform.machine(), cores=len(os.sched_getaffinity(0))),
                    params=args.params,
                    runs=runs,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
