#!/bin/bash
# The paper's second setting: Qwen2.5-3B-Instruct on OpenCoder-SFT stage 2 prompts, scored by a reward
# model. 8 GPUs; downloads the model and data; not measured yet (docs/RESULTS.md). OPPO by default;
# upstream twin: ppo_qwen2.5_3b_opencoder_upstream.sh.
# REWARD_MODEL: a reward model for code answers (the paper does not publish one).
set -euo pipefail
: "${REWARD_MODEL:?set REWARD_MODEL to a reward model for code answers}"
OPPO_FLAGS="--oppo.enable"  # the plan picks the rest; add --oppo.trace_dir DIR for a trace of every step
[ "${SYSTEM:-oppo}" = upstream ] && OPPO_FLAGS=""
python3 -m openrlhf_oppo.cli.train_ppo_ray \
  --actor.num_nodes 1 --actor.num_gpus_per_node 4 --critic.num_nodes 1 --critic.num_gpus_per_node 4 \
  --reward.num_nodes 1 --reward.num_gpus_per_node 4 --ref.num_nodes 1 --ref.num_gpus_per_node 4 \
  --oppo.colocate_models --vllm.num_engines 4 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85 \
  --actor.model_name_or_path Qwen/Qwen2.5-3B-Instruct --reward.model_name_or_path "$REWARD_MODEL" \
  --critic.model_name_or_path "$REWARD_MODEL" \
  --data.prompt_dataset OpenCoder-LLM/opc-sft-stage2 --data.input_key instruction --data.apply_chat_template \
  --data.max_samples 100000 --data.max_len 3072 --rollout.max_new_tokens 2048 \
  --rollout.batch_size 112 --rollout.n_samples_per_prompt 1 --rollout.micro_batch_size 8 \
  --train.batch_size 112 --train.micro_batch_size 2 --train.max_epochs 1 \
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2 \
  --actor.gradient_checkpointing_enable --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 \
  --algo.advantage.estimator gae --algo.kl.init_coef 0.01 \
  --ckpt.output_dir "${SAVE:-ckpt}/opencoder-${SYSTEM:-oppo}" --logger.logging_steps 1 \
  ${OPPO_FLAGS} "$@"
