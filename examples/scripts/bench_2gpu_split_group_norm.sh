#!/bin/bash
# The 2-GPU split benchmark with group advantages (GRPO-style: --algo.advantage.estimator group_norm, no
# critic) and 4 samples a prompt: half the training work of PPO with a critic on the models' GPU and four
# times the decoding per prompt, so the vLLM GPU and the slowest sample of each group weigh more in the
# step. Upstream sync, upstream async with partial rollout and OPPO with both halves, every system on
# OpenRLHF with patches/openrlhf applied, long-tail lengths. The models' GPU needs more than 80 GB.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 2 --placement split --shape qwen2.5-1.5b \
  --systems "${SYSTEMS:-upstream-sync,upstream-async,oppo-both}" \
  --batch 16 --n_samples 4 --steps "${STEPS:-5}" --warmup 1 --overcommit "${DELTA:-8}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 \
  --extra=--algo.advantage.estimator --extra=group_norm \
  --timeout "${TIMEOUT:-600}" --upstream_patches --workdir "${WORKDIR:-/tmp/oppo-wl}" \
  --scratch "${SCRATCH:-/tmp/oppo-2gpu-group-norm}" --out "${OUT_DIR:-runs/2gpu-group-norm}"
