"""What upstream's per-token advantage loop costs after the last token, and what patch 0006 leaves.

OpenRLHF computes GAE (and REINFORCE-style returns) with one Python iteration, several torch ops each,
per response token, for every micro-batch, on the trainer's CPU, between the last token and training.
This times ``get_advantages_and_returns`` for the benchmark's workload (32 responses a step, lognormal
lengths with mean 500 and sigma 1.0 clipped to [16, 4096], micro-batches of 8 padded to their longest)
with upstream's code and with ``patches/openrlhf/0006`` applied (same results bit for bit), one thread.

    python examples/scripts/advantage_cost_cpu.py --out runs/advantage-cost.json
"""

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time

import torch

from openrlhf_oppo.bench.patched_upstream import make_patched_copy


def load_maker(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RemoteExperienceMaker


def step_lengths(rng: random.Random, batch: int, mean: float, sigma: float, high: int) -> list:
    mu = math.log(mean) - sigma**2 / 2  # a lognormal with this mean
    return [min(high, max(16, int(rng.lognormvariate(mu, sigma)))) for _ in range(batch)]


def time_step(maker, lengths: list, micro_batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(lengths), micro_batch):
        length = max(lengths[i : i + micro_batch])
        values, rewards = torch.randn(micro_batch, length), torch.randn(micro_batch, length)
        maker.get_advantages_and_returns(
            None, values, rewards, torch.ones(micro_batch, length, dtype=torch.bool), 1.0, 0.95
        )
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import openrlhf

    upstream_file = os.path.join(os.path.dirname(openrlhf.__file__), "trainer", "ppo_utils", "experience_maker.py")
    patched_root = make_patched_copy(os.path.join(tempfile.mkdtemp(), "openrlhf-patched"))
    patched_file = os.path.join(patched_root, "openrlhf", "trainer", "ppo_utils", "experience_maker.py")
    makers = dict(upstream=load_maker(upstream_file, "upstream_em"), patched=load_maker(patched_file, "patched_em"))

    rng = random.Random(0)
    steps = [step_lengths(rng, 32, 500, 1.0, 4096) for _ in range(args.steps)]
    seconds = {name: [time_step(maker, lengths, 8) for lengths in steps] for name, maker in makers.items()}
    for name, values in seconds.items():
        print(f"{name:9s} advantages per step: mean {statistics.mean(values):.3f} s, max {max(values):.3f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    command="python examples/scripts/advantage_cost_cpu.py "
                    + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
                    machine=dict(
                        cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=torch.__version__
                    ),
                    max_length_per_micro_batch=[[max(s[i : i + 8]) for i in range(0, 32, 8)] for s in steps],
                    seconds_per_step=seconds,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
