"""Run by test_learning in a fresh interpreter (vLLM's engine starts its own processes): the log-prob vLLM
reports for a response's first token, as upstream's importance correction takes it (processed log-probs), with
``min_tokens`` 1 and 0, beside the policy's own from the HF forward, for a tiny model whose first token is the
end of text with a sizeable probability.

usage: first_token_logprob_helper.py WORKDIR   (prints a line "RESULT {json}")
"""

import json
import os
import shutil
import sys

PROMPT = [5, 17, 300, 41]
EOS = 0  # tiny.qwen2_config's eos_token_id


def make_model(workdir):
    """The tiny actor, with the end of text's logit after PROMPT raised above every other's: its embedding row
    (tied to the output) gets a multiple of that position's final hidden state."""
    import torch
    from transformers import AutoModelForCausalLM

    from openrlhf_oppo import tiny

    actor, _ = tiny.make_checkpoints(os.path.join(workdir, "models"))
    model = AutoModelForCausalLM.from_pretrained(actor, torch_dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPT])).last_hidden_state[0, -1]
        logits = model.lm_head(hidden)
        model.model.embed_tokens.weight[EOS] += (logits.max() - logits[EOS] + 5.0) * hidden / hidden.dot(hidden)
    path = os.path.join(workdir, "eos-first")
    tiny.save_causal_lm(model, path, "float32")
    for name in os.listdir(actor):
        if "token" in name:
            shutil.copy(os.path.join(actor, name), path)
    return path


def policy_logprobs(path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)


def main(workdir):
    from vllm import LLM, SamplingParams

    path = make_model(workdir)
    policy = policy_logprobs(path)
    # As upstream's engines run with --algo.advantage.is_correction_level on (train_ppo_ray's logprobs_mode).
    llm = LLM(
        model=path, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False, logprobs_mode="processed_logprobs", seed=0,
    )  # fmt: skip
    result = dict(eos=EOS, p_eos=policy[EOS].exp().item())
    for min_tokens in (1, 0):
        params = SamplingParams(temperature=1.0, max_tokens=1, min_tokens=min_tokens, logprobs=1, seed=3)
        sampled = []
        for output in llm.generate([{"prompt_token_ids": PROMPT}] * 4, [params] * 4, use_tqdm=False):
            token = output.outputs[0].token_ids[0]
            sampled.append([token, output.outputs[0].logprobs[0][token].logprob, policy[token].item()])
        result[f"min_tokens_{min_tokens}"] = sampled
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
