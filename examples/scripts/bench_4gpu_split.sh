#!/bin/bash
# Split placement on 4 GPUs: 2 vLLM engines on 2 GPUs, the policy and critic on the other 2 (two ranks
# each); OPPO puts the reward and reference models beside the engines (one rank per engine GPU), upstream
# keeps all four models on the models' GPUs. Random-init Qwen2.5-3B (default) or 7B shape, long-tail
# workload; upstream sync, upstream async with partial rollout and OPPO with both halves in one invocation,
# every system on OpenRLHF with patches/openrlhf applied. Needs 141 GB cards (H200) for the 3B shape.
#   SHAPE=qwen2.5-7b ZERO=3 OFFLOAD=1 VLLM_UTIL=0.5 BATCH=32 DELTA=32 bash examples/scripts/bench_4gpu_split.sh
# (7B: docs/RESULTS.md, split-4gpu-7b-lognormal-patched-zero3-offload). ZERO=3 shards the policy's and
# critic's parameters and optimizer states over their ranks (OPPO's critic, and its policy unless
# --oppo.policy_logprobs vllm, then stream on a full copy of the weights, gathered after each update: one more
# copy per rank; the frozen reward and reference models load unsharded beside vLLM). OFFLOAD=1 keeps the Adam
# states in host memory (--ds.adam_offload), which the 7B policy and critic need on two GPUs.
# BATCH is the prompts a step, STEPS the measured steps after WARMUP steps that are not measured.
# ROLLOUT_MB and TRAIN_MB are the micro-batch sizes of upstream's forward passes and of training (per GPU);
# OpenRLHF's own recipes use 32 and 8 (with sample packing).
# MODEL_GPUS=3 gives the policy and critic three GPUs and vLLM one (one engine; OPPO's reward and reference
# models beside it): with ZeRO-3 over three ranks the 7B shape trains without host-side Adam states:
#   SHAPE=qwen2.5-7b ZERO=3 MODEL_GPUS=3 VLLM_UTIL=0.5 BATCH=32 DELTA=32 bash examples/scripts/bench_4gpu_split.sh
# (not measured yet).
# VLLM_UTIL is vLLM's share of its GPUs, the same for every system; the rest holds the frozen models beside it.
# Further arguments go to the benchmark, e.g. an OPPO variant beside the baselines:
#   DELTA=64 SYSTEMS=oppo-both bash examples/scripts/bench_4gpu_split.sh --oppo_tag=-policy-logprobs-vllm \
#     --oppo_extra=--oppo.policy_logprobs --oppo_extra=vllm
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
offload=()
[ "${OFFLOAD:-0}" = 1 ] && offload=(--extra=--ds.adam_offload)
python3 -m openrlhf_oppo.bench --gpus 4 --placement split --model_gpus "${MODEL_GPUS:-2}" \
  --shape "${SHAPE:-qwen2.5-3b}" \
  --systems "${SYSTEMS:-upstream-async,oppo-both,upstream-sync}" \
  --batch "${BATCH:-64}" --rollout_micro_batch "${ROLLOUT_MB:-8}" --train_micro_batch "${TRAIN_MB:-2}" \
  --steps "${STEPS:-5}" --warmup "${WARMUP:-1}" --overcommit "${DELTA:-32}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 --cache_budget_gb 4 \
  --extra=--ds.zero_stage --extra="${ZERO:-2}" "${offload[@]}" \
  --extra=--vllm.gpu_memory_utilization --extra="${VLLM_UTIL:-0.6}" \
  --timeout "${TIMEOUT:-1200}" --upstream_patches \
  --workdir "${WORKDIR:-/tmp/oppo-wl-4gpu}" --scratch "${SCRATCH:-/tmp/oppo-4gpu}" \
  --out "${OUT_DIR:-runs/4gpu-${SHAPE:-qwen2.5-3b}}" "$@"
