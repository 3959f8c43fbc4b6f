#!/bin/bash
# Convergence check (NOT RUN YET on GPU): short real PPO on the small random model with a rule reward
# that rises (examples/reward/digit_reward.py), upstream with two seeds and OPPO intra only, inter only
# and both; reward against step and wall-clock time in convergence.png. One GPU, colocated.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
COMMON="--gpus 1 --placement colocated --shape small --batch 32 --n_samples 4 --steps ${STEPS:-40} --warmup 0
  --lengths lognormal --mean 120 --sigma 1.0 --high 512 --timeout 500 --workdir /tmp/oppo-conv
  --extra=--reward.remote_url=$PWD/examples/reward/digit_reward.py --extra=--actor.adam.lr=1e-5"
python3 -m openrlhf_oppo.bench $COMMON --systems upstream-sync,oppo-intra,oppo-inter,oppo-both --seed 0 \
  --scratch /tmp/oppo-conv-0 --out runs/convergence-seed0
python3 -m openrlhf_oppo.bench $COMMON --systems upstream-sync --seed 1 --tag -seed1 \
  --scratch /tmp/oppo-conv-1 --out runs/convergence-seed1
python3 -m openrlhf_oppo.bench.report runs/convergence-seed0/results.json runs/convergence-seed1/results.json \
  --out runs/convergence
