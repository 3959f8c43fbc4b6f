"""Makes tests/data/learning-cpu: the learning benchmark's raw results as its runs side by side give them, on CPU.

    PYTHONPATH=$PWD python tests/learning_raw_helper.py tests/data/learning-cpu

The same steps as on a GPU, scaled down: one warm-up made first (``warmup.py`` with its headroom rule), then each
(system, seed) of upstream sync and the flag swap (``oppo``) in a run of its own from that folder
(``--warmup_from``), each writing its own results file, then ``--speed_alone``: a few steps of each system, for
their step times. On CPU the training step is a stand-in that leaves the weights as they are
(``testing/cpu_pipeline.py``): the curves are real rollouts of one model, not learning. ``test_learning.py`` builds
the report from these files. Takes about ten minutes on two cores.
"""

import glob
import gzip
import os
import shutil
import sys
import tempfile

import ray
import torch

from openrlhf_oppo.bench import learning, report, warmup
from openrlhf_oppo.bench.__main__ import header
from openrlhf_oppo.testing.cpu_bench import CPURunner

SHARED = [
    "--task", "addition", "--gpus", "2", "--placement", "split", "--shape", "tiny",
    "--batch", "4", "--n_samples", "4", "--digits_mean", "2", "--digits_high", "6", "--eval_every", "0",
    "--target", "0.5",
]  # fmt: skip
SEEDS, SYSTEMS, STEPS, ALONE_STEPS = (0, 1, 2), ("upstream-sync", "oppo"), 10, 4
WARMUP = dict(batch=64, lr=3e-3, eval_every=50, heldout=64, dtype="float32", max_steps=600, samples=4)


def main(folder: str) -> None:
    scratch = tempfile.mkdtemp(prefix="learning-raw-")
    warm_dir = os.path.join(scratch, "warmup")
    torch.set_num_threads(1)
    warmup.warm_up(warm_dir, "tiny", 0.3, 0, dict(mean=2, high=6), headroom=0.2, **WARMUP)
    ray.init(num_cpus=4, include_dashboard=False)
    runner = CPURunner()
    os.makedirs(folder, exist_ok=True)
    try:
        for system in SYSTEMS:
            for seed in SEEDS:
                out = os.path.join(scratch, f"{system}-seed{seed}")
                _run(
                    runner, [*SHARED, "--systems", system, "--seeds", str(seed), "--steps", str(STEPS)], warm_dir, out
                )
                _keep(out, folder, f"{system}-seed{seed}")
        out = os.path.join(scratch, "speed-alone")
        alone = ["--systems", ",".join(SYSTEMS), "--seeds", "0", "--steps", str(ALONE_STEPS), "--speed_alone"]
        _run(runner, [*SHARED, *alone], warm_dir, out)
        _keep(out, folder, "speed-alone")
    finally:
        runner.close()
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


def _run(runner, argv: list, warm_dir: str, out: str) -> None:
    args = learning.parse([*argv, "--warmup_from", warm_dir, "--out", out])
    learning.run(args, runner, header())


def _keep(out: str, folder: str, name: str) -> None:
    """The run's results.json, gzipped as docs/results keeps it, as ``results-<name>.json.gz``."""
    with open(os.path.join(out, "results.json"), "rb") as f, gzip.open(
        os.path.join(folder, f"results-{name}.json.gz"), "wb"
    ) as g:
        g.write(f.read())
    assert report.load(os.path.join(folder, f"results-{name}.json.gz"))["systems"]


if __name__ == "__main__":
    main(sys.argv[1])
    print(sorted(glob.glob(os.path.join(sys.argv[1], "*"))))
