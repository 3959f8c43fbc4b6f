#!/bin/bash
# The GPU measurements of docs/RESULTS.md in one go on a 4-GPU machine, as lanes that run at the same
# time, each on GPUs of its own and in namespaces of its own (PID, network, mount: its own Ray cluster,
# ports and `ray stop`, which would otherwise end the other lanes' runs):
#   a  GPUs 0,1  bench_2gpu_split.sh: vLLM on one GPU, the four models on the other (SPLIT_SYSTEMS, in
#                order of priority: a lane cut short keeps the systems that finished)
#   c  GPU 2     convergence_small.sh, runs a and b (upstream seed 0 with oppo-both, upstream seed 1)
#   d  GPU 3     convergence_small.sh, run c (oppo-intra, oppo-inter)
# LAYOUT=patched (fourth session) runs a: the split with every system patched (PATCHED=1), b: the colocated
# placement as released, c: the colocated placement patched.
# (The second session's lanes were a, then b on GPU 2: gpu_smoke.sh with OPPO off and
# bench_1gpu_colocated.sh, and c on GPU 3: all of convergence_small.sh; docs/results/h200x4-lanes.)
# The lanes share only the host's CPUs (64 cores) and disk; every comparison is made within one lane
# (the convergence runs compare reward per step, which does not depend on the lane).
# Needs root (unshare). Starts the lanes in the background and returns; each writes ROOT/<lane>/lane.log
# and its results under ROOT/<lane>/out.
#   bash examples/scripts/gpu_lanes.sh /tmp/lanes
set -euo pipefail
ROOT=${1:-/tmp/lanes}
cd "$(dirname "$0")/../.."
lane() {  # name, GPUs, command
  mkdir -p "$ROOT/$1/ray"
  CUDA_VISIBLE_DEVICES=$2 LANE=$ROOT/$1 setsid unshare --pid --fork --mount-proc --net --mount \
    bash examples/scripts/gpu_lane.sh "$3" >"$ROOT/$1/lane.log" 2>&1 </dev/null &
}
SPLIT_SYSTEMS=${SPLIT_SYSTEMS:-upstream-sync,oppo-both-early,upstream-async,oppo-intra,oppo-both}
split="STEPS=${SPLIT_STEPS:-4} OUT_DIR=\$LANE/out SCRATCH=\$LANE/scratch WORKDIR=\$LANE/workload bash examples/scripts/bench_2gpu_split.sh"
colocated="STEPS=${COLOCATED_STEPS:-3} OUT_DIR=\$LANE/out SCRATCH=\$LANE/scratch WORKDIR=\$LANE/workload bash examples/scripts/bench_1gpu_colocated.sh"
case "${LAYOUT:-convergence}" in
  convergence)  # third session
    lane a 0,1 "SYSTEMS=$SPLIT_SYSTEMS $split"
    lane c 2 'RUNS="a b" OUT_DIR=$LANE/out SCRATCH=$LANE/scratch bash examples/scripts/convergence_small.sh'
    lane d 3 'RUNS=c OUT_DIR=$LANE/out SCRATCH=$LANE/scratch bash examples/scripts/convergence_small.sh'
    ;;
  patched)  # fourth session: every system on OpenRLHF with patches/openrlhf applied, and the colocated placement
    #   a  GPUs 0,1  split, patched      b  GPU 2  colocated, as released      c  GPU 3  colocated, patched
    lane a 0,1 "PATCHED=1 SYSTEMS=${SPLIT_SYSTEMS_PATCHED:-upstream-sync,oppo-intra,oppo-both,upstream-async} $split"
    lane b 2 "SYSTEMS=upstream-sync,oppo-inter,oppo-intra $colocated"
    lane c 3 "PATCHED=1 SYSTEMS=upstream-sync,oppo-inter $colocated"
    ;;
  pair)  # fourth session's last 9 minutes: upstream sync and OPPO intra-step, patched, side by side at the same time
    lane a 0,1 "PATCHED=1 SYSTEMS=upstream-sync $split"
    lane b 2,3 "PATCHED=1 SYSTEMS=oppo-intra $split"
    ;;
  *) echo "unknown LAYOUT=$LAYOUT (convergence, patched or pair)" >&2; exit 2 ;;
esac
echo "lanes started under $ROOT"
