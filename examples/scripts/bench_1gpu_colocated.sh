#!/bin/bash
# One GPU, everything colocated (upstream's hybrid engine: vLLM and DeepSpeed sleep in turn).
# Decides --oppo.intra_step auto under --train.colocate_all: OPPO must not make this step slower.
# (Upstream async needs GPUs of its own for vLLM, so it is not in this placement.)
# PATCHED=1 runs every system on OpenRLHF with patches/openrlhf applied (as bench_2gpu_split.sh).
# WARMUP (default 2) steps run first and not measured: DeepSpeed pins its host buffers at a model's first state
# offload, and OPPO's policy, awake beside vLLM with --oppo.state_moves overlap, first goes back after step 1's
# weight sync, so its one-time cost falls in step 2. Upstream pays it in step 1.
# TIMEOUT (s, default 600) a system: the first start on a machine compiles vLLM's kernels, which takes minutes.
# Further arguments go to the benchmark, e.g. an OPPO variant:
#   --oppo_tag=-name --oppo_extra=--oppo.FLAG --oppo_extra=VALUE
# OPPO with Delta equal to the batch, and the same with the DeepSpeed state moves overlapped:
#   PATCHED=1 STEPS=5 DELTA=32 SYSTEMS=upstream-sync,oppo-both bash examples/scripts/bench_1gpu_colocated.sh \
#     --oppo_tag=-delta32
#   PATCHED=1 STEPS=5 DELTA=32 SYSTEMS=oppo-both OUT_DIR=runs/1gpu-overlap \
#     bash examples/scripts/bench_1gpu_colocated.sh --oppo_tag=-delta32-state-moves-overlap \
#     --oppo_extra=--oppo.state_moves --oppo_extra=overlap
# OPPO with vLLM awake through training, its requests decoding beside the models' training. vLLM keeps its
# memory then: a smaller share (enough KV for the batch) leaves training the room it has with vLLM asleep.
#   PATCHED=1 STEPS=5 DELTA=32 SYSTEMS=oppo-both-awake OUT_DIR=runs/1gpu-awake \
#     bash examples/scripts/bench_1gpu_colocated.sh --oppo_tag=-delta32-vllm-0.25 \
#     --oppo_extra=--vllm.gpu_memory_utilization --oppo_extra=0.25
# OPPO awake against upstream sync, both with the models' DeepSpeed states kept on the GPU (no --ds.enable_sleep)
# and vLLM's share small enough for the GPU to hold both (on the lognormal workload 0.25 ran out of memory, 0.15 fit):
#   PATCHED=1 STEPS=5 DELTA=32 SYSTEMS=upstream-sync,oppo-both-awake OUT_DIR=runs/1gpu-awake-states \
#     bash examples/scripts/bench_1gpu_colocated.sh --ds_sleep off \
#     --extra=--vllm.gpu_memory_utilization --extra=0.15
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench --gpus 1 --placement colocated --shape qwen2.5-1.5b \
  --systems "${SYSTEMS:-upstream-sync,oppo-intra,oppo-inter,oppo-both}" \
  --batch 32 --steps "${STEPS:-3}" --warmup "${WARMUP:-2}" --overcommit "${DELTA:-16}" \
  --lengths lognormal --mean 500 --sigma 1.0 --high 4096 \
  --timeout "${TIMEOUT:-600}" ${PATCHED:+--upstream_patches} --workdir "${WORKDIR:-/tmp/oppo-wl-1gpu}" --scratch "${SCRATCH:-/tmp/oppo-1gpu}" --out "${OUT_DIR:-runs/1gpu}" "$@"
