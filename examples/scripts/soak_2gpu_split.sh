#!/bin/bash
# A long run of OPPO with both halves in the 2-GPU split placement (vLLM on one GPU, the four models on the
# other; more than 80 GB on the models' GPU), long-tail lengths, so that groups are carried across every
# weight sync: about 10 minutes at the default 80 steps on H200s. Every step logs each actor's memory
# (oppo/memory/*); the report's memory table and memory.png show whether anything grows.
#   STEPS=160 OUT_DIR=runs/soak bash examples/scripts/soak_2gpu_split.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 2 --placement split --shape qwen2.5-1.5b --systems oppo-both \
  --batch 32 --steps "${STEPS:-80}" --warmup 1 --overcommit "${DELTA:-16}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 \
  --timeout "${TIMEOUT:-1800}" --upstream_patches --workdir "${WORKDIR:-/tmp/oppo-wl}" \
  --scratch "${SCRATCH:-/tmp/oppo-soak}" --out "${OUT_DIR:-runs/soak-2gpu}"
