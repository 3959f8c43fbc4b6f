#!/bin/bash
# A check of a GPU install: 3 PPO steps on a small random model (built on the spot, no downloads), one GPU,
# everything colocated, through openrlhf-oppo's wrapper. Extra flags (OPPO's, say) are appended.
#   bash examples/scripts/gpu_smoke.sh                       # OPPO off: upstream's run
#   bash examples/scripts/gpu_smoke.sh --oppo.enable         # OPPO on
# Needs the GPU stack (vllm, ray, deepspeed, openrlhf); writes into ${WORK:-/tmp/oppo-smoke}.
set -uo pipefail
WORK=${WORK:-/tmp/oppo-smoke}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m openrlhf_oppo.bench.workload --out "$WORK" --shape small --dtype bfloat16 --prompts 96 \
  --lengths uniform --low 16 --high 512 >/dev/null
timeout ${T:-500} python3 -m openrlhf_oppo.cli.train_ppo_ray \
  --ref.num_nodes 1 --ref.num_gpus_per_node 1 --reward.num_nodes 1 --reward.num_gpus_per_node 1 \
  --critic.num_nodes 1 --critic.num_gpus_per_node 1 --actor.num_nodes 1 --actor.num_gpus_per_node 1 \
  --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.4 \
  --actor.model_name_or_path "$WORK/models/actor" --reward.model_name_or_path "$WORK/models/reward" \
  --critic.model_name_or_path "$WORK/models/reward" \
  --ckpt.output_dir "$WORK/out" --ckpt.path "$WORK/ckpt" --train.batch_size 32 --train.micro_batch_size 8 \
  --rollout.micro_batch_size 16 --rollout.batch_size 32 --rollout.n_samples_per_prompt 1 --train.max_epochs 1 \
  --data.max_len 1024 --rollout.max_new_tokens 512 --data.max_samples 96 --ds.zero_stage 2 --ds.param_dtype bf16 \
  --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset "$WORK/prompts.jsonl" \
  --data.input_key input --ds.attn_implementation sdpa --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep \
  --algo.advantage.estimator gae --logger.logging_steps 1 "$@"
echo "ppo rc=$?"
