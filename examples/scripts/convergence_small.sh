#!/bin/bash
# Convergence check: short real PPO on the small random model (30M parameters) with a rule reward that a
# random model can learn (examples/reward/digit_reward.py), one GPU, everything colocated. Upstream with
# two seeds (run-to-run noise), then OPPO with both halves, intra only and inter only; reward against step
# and wall-clock time in convergence.png. The actor's learning rate is high because the model is random.
# Advantages come from group_norm (4 samples a prompt): with GAE and a random critic the first GPU attempt
# stayed flat for 30 steps, while the same reward rose under clean advantages on CPU
# (examples/scripts/reward_learnability_cpu.py, docs/RESULTS.md). Not yet run on GPU in this form.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT_DIR=${OUT_DIR:-runs/convergence}
SCRATCH=${SCRATCH:-/tmp/oppo-conv}
COMMON="--gpus 1 --placement colocated --shape small --batch 16 --n_samples 4 --steps ${STEPS:-30} --warmup 0
  --overcommit 4 --lengths lognormal --mean 48 --sigma 0.8 --high 192 --timeout 420 --workdir $SCRATCH/workload
  --extra=--reward.remote_url=$PWD/examples/reward/digit_reward.py --extra=--actor.adam.lr=1e-4
  --extra=--train.micro_batch_size=8 --extra=--algo.advantage.estimator=group_norm"
run() {  # name, systems, extra flags: same models and prompts (the workload's seed) in every run
  python3 -m openrlhf_oppo.bench $COMMON --systems "$2" --scratch "$SCRATCH/$1" --out "$OUT_DIR/$1" "${@:3}" || true
}
run a upstream-sync,oppo-both
run b upstream-sync --extra=--train.seed=1 --tag=-seed1
run c oppo-intra,oppo-inter
python3 -m openrlhf_oppo.bench.report "$OUT_DIR"/{a,b,c}/results.json --out "$OUT_DIR/merged"
