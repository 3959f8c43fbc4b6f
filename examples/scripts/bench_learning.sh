#!/bin/bash
# The learning benchmark (docs/benchmark.md): the small model (about 22M parameters) learns multi-digit addition
# with a chain of carries, first supervised until 30% of held-out sums come out right, then with PPO and the
# task's rule reward (1 for a right answer), for upstream sync, upstream async + partial rollout,
# and OPPO with both halves (carried KV recomputed, and kept), 3 seeds each, every system on OpenRLHF with
# patches/openrlhf applied. 2 GPUs, split placement (vLLM on one, the models on the other). No downloads.
# The warm-up is cached in WORKDIR; runs go one after the other and results.json is written after each. To run
# them in parts (a system or a seed each), pass SYSTEMS, SEEDS and OUT_DIR (also STEPS, LR; further arguments go to
# the benchmark, e.g. --updates 2), and merge the parts with
#   python -m openrlhf_oppo.bench.report runs/learning-*/results.json --out runs/learning
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --task addition --gpus 2 --placement split --upstream_patches \
  --systems "${SYSTEMS:-upstream-sync,upstream-async,oppo-both,oppo-both-keep}" --seeds "${SEEDS:-0,1,2}" \
  --steps "${STEPS:-80}" --lr "${LR:-2e-5}" --timeout "${TIMEOUT:-1200}" \
  --workdir "${WORKDIR:-/tmp/oppo-learning}" --scratch "${SCRATCH:-/tmp/oppo-learning-runs}" --out "${OUT_DIR:-runs/learning}" "$@"
