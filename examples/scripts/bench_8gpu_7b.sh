#!/bin/bash
# Not measured yet (docs/RESULTS.md). Needs 8 GPUs.
# Paper scale: Qwen2.5-7B-shaped actor, critic, reward and reference (random init), 4 GPUs of vLLM
# engines and 4 for the models, long-tail workload; upstream sync, upstream async with partial rollout
# and OPPO with both halves in one invocation.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 8 --placement split --shape qwen2.5-7b \
  --systems "${SYSTEMS:-upstream-sync,upstream-async,oppo-both}" \
  --batch 64 --steps "${STEPS:-3}" --warmup 1 --overcommit "${DELTA:-32}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 --cache_budget_gb 4 \
  --timeout 1200 --workdir /tmp/oppo-wl-7b --scratch /tmp/oppo-8gpu --out "${OUT_DIR:-runs/8gpu-7b}"
