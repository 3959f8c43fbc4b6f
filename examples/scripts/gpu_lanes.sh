#!/bin/bash
# The GPU measurements of docs/RESULTS.md in one go on a 4-GPU machine, as three lanes that run at the
# same time, each on GPUs of its own and in namespaces of its own (PID, network, mount: its own Ray
# cluster, ports and `ray stop`, which would otherwise end the other lanes' runs):
#   a  GPUs 0,1  bench_2gpu_split.sh: six systems, vLLM on one GPU, the four models on the other
#   b  GPU 2     gpu_smoke.sh with OPPO off (issue 2), then bench_1gpu_colocated.sh
#   c  GPU 3     convergence_small.sh
# The lanes share only the host's CPUs (64 cores) and disk; every comparison is made within one lane.
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
lane a 0,1 'OUT_DIR=$LANE/out bash examples/scripts/bench_2gpu_split.sh'
lane b 2 'T=400 WORK=$LANE/smoke bash examples/scripts/gpu_smoke.sh >$LANE/smoke-oppo-off.log 2>&1;
  OUT_DIR=$LANE/out bash examples/scripts/bench_1gpu_colocated.sh'
lane c 3 'OUT_DIR=$LANE/out SCRATCH=$LANE/scratch bash examples/scripts/convergence_small.sh'
echo "lanes started under $ROOT"
