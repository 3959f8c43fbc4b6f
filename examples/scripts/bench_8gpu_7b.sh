#!/bin/bash
# Not measured yet (docs/RESULTS.md). Needs 8 GPUs of 141 GB (H200).
# Paper scale: Qwen2.5-7B-shaped policy, critic, reward and reference (random init); 4 vLLM engines on 4 GPUs,
# the policy and critic on the other 4 (four ranks each); OPPO puts the reward and reference models beside the
# engines (one rank per engine GPU), upstream keeps all four models on the models' GPUs. Long-tail workload;
# upstream sync, upstream async with partial rollout and OPPO with both halves, one after the other, every
# system on OpenRLHF with patches/openrlhf applied.
# ZERO (2 by default) is the policy's and critic's ZeRO stage: over four ranks ZeRO-2 fits a 7B policy and
# critic with their Adam states on 141 GB cards; ZERO=3 shards the weights too (OPPO's critic, and its policy
# unless --oppo.policy_logprobs vllm, then stream on a full copy gathered after each update). VLLM_UTIL is vLLM's
# share of its GPUs for every system (0.5: 70 GB, of which the 7B weights take 15 GB; the rest holds the frozen
# models beside it). BATCH prompts a step, STEPS measured steps after WARMUP steps that are not measured.
# Further arguments go to the benchmark, e.g. the OPPO options of the 4-GPU runs:
#   DELTA=64 bash examples/scripts/bench_8gpu_7b.sh --oppo_extra=--oppo.policy_logprobs --oppo_extra=vllm
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 8 --placement split --shape qwen2.5-7b \
  --systems "${SYSTEMS:-upstream-async,oppo-both,upstream-sync}" \
  --batch "${BATCH:-64}" --rollout_micro_batch 8 --train_micro_batch 2 \
  --steps "${STEPS:-5}" --warmup "${WARMUP:-1}" --overcommit "${DELTA:-64}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 --cache_budget_gb 4 \
  --extra=--ds.zero_stage --extra="${ZERO:-2}" \
  --extra=--vllm.gpu_memory_utilization --extra="${VLLM_UTIL:-0.5}" \
  --timeout "${TIMEOUT:-1800}" --upstream_patches \
  --workdir "${WORKDIR:-/tmp/oppo-wl-7b}" --scratch "${SCRATCH:-/tmp/oppo-8gpu}" \
  --out "${OUT_DIR:-runs/8gpu-7b}" "$@"
