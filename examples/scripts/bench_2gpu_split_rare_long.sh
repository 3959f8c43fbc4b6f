#!/bin/bash
# The 2-GPU split benchmark on responses that now and then run to the length limit: 95% of 256 tokens, 5% of
# 6144. A batch of 32 then holds one or two long responses that take longer to decode than a training step:
# OpenRLHF's async mode waits for the longest response of each batch, OPPO ends the step when batch_size
# groups are done and carries the long ones. Upstream sync, upstream async with partial rollout and OPPO
# with both halves, every system on OpenRLHF with patches/openrlhf applied. The models' GPU needs more than
# 80 GB. LONG sets the long responses' length (the limit too).
# Further arguments go to the benchmark, e.g. an OPPO variant:
#   --oppo_tag=-name --oppo_extra=--oppo.FLAG --oppo_extra=VALUE
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 2 --placement split --shape qwen2.5-1.5b \
  --systems "${SYSTEMS:-upstream-sync,upstream-async,oppo-both}" \
  --batch 32 --steps "${STEPS:-5}" --warmup 1 --overcommit "${DELTA:-16}" \
  --lengths bimodal --short 256 --long "${LONG:-6144}" --long_fraction 0.05 --high "${LONG:-6144}" \
  --timeout "${TIMEOUT:-600}" --upstream_patches --workdir "${WORKDIR:-/tmp/oppo-wl-rare-long}" \
  --scratch "${SCRATCH:-/tmp/oppo-2gpu-rare-long}" --out "${OUT_DIR:-runs/2gpu-rare-long}" "$@"
