#!/bin/bash
# The upstream twin of ppo_qwen2.5_7b_gsm8k.sh: the same run, OpenRLHF alone (no --oppo.* flags).
SYSTEM=upstream exec bash "$(dirname "$0")/ppo_qwen2.5_7b_gsm8k.sh" "$@"
