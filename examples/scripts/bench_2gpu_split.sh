#!/bin/bash
# The 2-GPU side-by-side benchmark of docs/RESULTS.md: vLLM on one GPU, the four models on the other,
# Qwen2.5-1.5B shape, long-tail lengths (lognormal, mean 500, up to 4096 tokens), all six systems.
# The models' GPU holds four 1.5B models with their optimizer states: it needs more than 80 GB.
# PATCHED=1 runs every system on OpenRLHF with patches/openrlhf applied (--upstream_patches): upstream
# then gets the fixes OPPO proposes (the tokenizer sent once, the faster advantage recurrence).
# About 2.5 minutes a system once vLLM's kernels are compiled (the first start on a machine takes longer).
# Systems run one after the other; to run them in parts, pass SYSTEMS and OUT_DIR and merge the parts with
#   python -m openrlhf_oppo.bench.report runs/2gpu-a/results.json runs/2gpu-b/results.json --out runs/2gpu
# Further arguments go to the benchmark, e.g. an OPPO variant:
#   --oppo_tag=-name --oppo_extra=--oppo.FLAG --oppo_extra=VALUE
# The README's first rows (OPPO with Delta equal to the batch and the policy's log-probs from vLLM, 8 steps):
#   PATCHED=1 STEPS=8 DELTA=32 SYSTEMS=oppo-both bash examples/scripts/bench_2gpu_split.sh \
#     --oppo_tag=-delta32-policy-logprobs-vllm --oppo_extra=--oppo.policy_logprobs --oppo_extra=vllm
#   PATCHED=1 STEPS=8 SYSTEMS=upstream-async,upstream-sync OUT_DIR=runs/2gpu-base bash examples/scripts/bench_2gpu_split.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 2 --placement split --shape qwen2.5-1.5b \
  --systems "${SYSTEMS:-upstream-sync,oppo-both,upstream-async,oppo-both-early,oppo-intra,oppo-inter}" \
  --batch 32 --steps "${STEPS:-3}" --warmup 1 --overcommit "${DELTA:-16}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 \
  --timeout "${TIMEOUT:-600}" ${PATCHED:+--upstream_patches} --workdir "${WORKDIR:-/tmp/oppo-wl}" --scratch "${SCRATCH:-/tmp/oppo-2gpu}" --out "${OUT_DIR:-runs/2gpu}" "$@"
