#!/bin/bash
# Convergence check: short real PPO on the small random model (30M parameters) with a rule reward that a
# random model learns within tens of steps (examples/reward/parity_reward.py: the share of even token
# ids), one GPU, everything colocated. Upstream with two seeds (run-to-run noise), then OPPO with both
# halves, intra only and inter only; reward against step and wall-clock time in convergence.png and the
# time to a target reward in table.md. The actor's learning rate is high because the model is random.
# Advantages come from group_norm (4 samples a prompt): with GAE from a random critic and the digit reward
# the first GPU attempt stayed flat for 30 steps; on CPU both rewards rise under clean advantages
# (examples/scripts/reward_learnability_cpu.py, docs/RESULTS.md).
# RUNS picks the runs (default all three, one after the other; on two GPUs, start RUNS="a b" and RUNS=c
# with a CUDA_VISIBLE_DEVICES each).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT_DIR=${OUT_DIR:-runs/convergence}
SCRATCH=${SCRATCH:-/tmp/oppo-conv}
COMMON="--gpus 1 --placement colocated --shape small --batch 16 --n_samples 4 --steps ${STEPS:-30} --warmup 0
  --overcommit 4 --lengths lognormal --mean 48 --sigma 0.8 --high 192 --timeout 420 --workdir $SCRATCH/workload
  --extra=--reward.remote_url=$PWD/examples/reward/parity_reward.py --extra=--actor.adam.lr=3e-4
  --extra=--train.micro_batch_size=8 --extra=--algo.advantage.estimator=group_norm"
run() {  # name, systems, extra flags: same models and prompts (the workload's seed) in every run
  python3 -m openrlhf_oppo.bench $COMMON --systems "$2" --scratch "$SCRATCH/$1" --out "$OUT_DIR/$1" "${@:3}" || true
}
for name in ${RUNS:-a b c}; do
  case $name in
    a) run a upstream-sync,oppo-both ;;
    b) run b upstream-sync --extra=--train.seed=1 --tag=-seed1 ;;
    c) run c oppo-intra,oppo-inter ;;
  esac
done
python3 -m openrlhf_oppo.bench.report "$OUT_DIR"/*/results.json --out "$OUT_DIR/merged" || true
