#!/bin/bash
# The paper's third setting: Qwen2.5-7B on GSM8K with a rule reward (examples/reward/gsm8k_reward.py: 1
# if the last number of the answer is the reference's). The reward is computed in the rollout actors, so
# the critic, reference and policy stream and no reward model runs. 8 GPUs; downloads the model and data;
# not measured yet (docs/RESULTS.md). OPPO by default; upstream twin: ppo_qwen2.5_7b_gsm8k_upstream.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OPPO_FLAGS="--oppo.enable"  # the plan picks the rest; add --oppo.trace_dir DIR for a trace of every step
[ "${SYSTEM:-oppo}" = upstream ] && OPPO_FLAGS=""
python3 -m openrlhf_oppo.cli.train_ppo_ray \
  --actor.num_nodes 1 --actor.num_gpus_per_node 4 --critic.num_nodes 1 --critic.num_gpus_per_node 4 \
  --reward.num_nodes 1 --reward.num_gpus_per_node 4 --ref.num_nodes 1 --ref.num_gpus_per_node 4 \
  --oppo.colocate_models --vllm.num_engines 4 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85 \
  --actor.model_name_or_path Qwen/Qwen2.5-7B --reward.remote_url "$HERE/../reward/gsm8k_reward.py" \
  --data.prompt_dataset openai/gsm8k --data.input_key question --data.label_key answer \
  --data.input_template $'Question: {}\nAnswer: Let\'s think step by step.' \
  --data.max_samples 100000 --data.max_len 1536 --rollout.max_new_tokens 1024 \
  --rollout.batch_size 112 --rollout.n_samples_per_prompt 1 --rollout.micro_batch_size 8 \
  --train.batch_size 112 --train.micro_batch_size 2 --train.max_epochs 1 \
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2 \
  --actor.gradient_checkpointing_enable --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 \
  --algo.advantage.estimator gae --algo.kl.init_coef 0.01 \
  --ckpt.output_dir "${SAVE:-ckpt}/gsm8k-${SYSTEM:-oppo}" --logger.logging_steps 1 \
  ${OPPO_FLAGS} "$@"
