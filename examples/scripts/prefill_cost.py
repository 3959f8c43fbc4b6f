"""How fast the streaming scorer prefills the policy and the critic, against upstream's forward.

Builds a random checkpoint of a benchmark shape (``--shape``) and sequences of a 64-token prompt and a
response of the benchmark's lengths (the same ``--lengths`` options), then times, for the policy (log-probs
of the response tokens) and the critic (values):

* ``upstream``: OpenRLHF's ``Actor`` and critic forward over micro-batches of ``--micro_batch`` right-padded
  sequences, in prompt order, as its make_experience runs them;
* ``whole``: ``ChunkScorer`` given every sequence as one final chunk, in one call: what the policy and the
  critic do after training for the tokens decoded while they trained;
* ``chunked``: ``ChunkScorer`` given the sequences in chunks of ``--chunk_size`` tokens, a call per round:
  what they do while the engine decodes.

With ``--vllm``, two passes of the policy alone follow: ``whole_policy_only`` (the scorer, whole sequences) and
``vllm_prompt_logprobs`` (a vLLM engine on the same checkpoint, one-token requests with prompt log-probs:
what ``--oppo.policy_logprobs vllm`` runs on the engines' GPUs after a weight sync). Their differences are
over the log-probs only.

Each is run ``--repeats`` times after one warm-up; the median seconds and tokens/s are printed and written to
``--out`` with the largest and the mean difference between the scorer's outputs and upstream's (bf16 on a GPU,
float32 on the CPU). ``upstream_one_a_batch`` is upstream's forward with one sequence a micro-batch, timed
once: in bf16 a change of batching alone moves upstream's numbers, which sets the scale for the scorer's.
On a GPU, the policy and critic share one card in the benchmark's split placement: their times add.

    python examples/scripts/prefill_cost.py --shape qwen2.5-1.5b --device cuda --out prefill.json
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch

from openrlhf_oppo import tiny
from openrlhf_oppo.bench.workload import add_workload_arguments, check_workload_arguments, length_params
from openrlhf_oppo.protocol import Chunk
from openrlhf_oppo.streaming.scorer import ChunkScorer

PROMPT_TOKENS = 64


def load_models(folder: str, shape: str, device: str, dtype: torch.dtype):
    """The policy and critic of a random checkpoint of ``shape``, written to ``folder``; and the policy's path."""
    from openrlhf.models import Actor, get_llm_for_sequence_regression

    actor_path, reward_path = tiny.make_checkpoints(folder, shape=shape, dtype="bfloat16", seed=0)
    actor = Actor(actor_path, attn_implementation="sdpa", param_dtype="bf16")
    critic = get_llm_for_sequence_regression(reward_path, "critic", param_dtype="bf16", attn_implementation="sdpa")
    actor.model.to(device=device, dtype=dtype).eval()
    critic.to(device=device, dtype=dtype).eval()
    return actor, critic, actor_path


def make_sequences(args, vocab_size: int):
    rng = random.Random(args.seed)
    lengths = tiny.response_lengths(args.sequences, args.lengths, seed=args.seed, **length_params(args))
    return [[rng.randrange(1, vocab_size) for _ in range(PROMPT_TOKENS + n)] for n in lengths]


@torch.no_grad()
def upstream(actor, critic, sequences, micro_batch: int, device: str):
    """Log-probs and values per sequence (response positions), upstream's way."""
    outputs = []
    for start in range(0, len(sequences), micro_batch):
        batch = sequences[start : start + micro_batch]
        width = max(len(tokens) for tokens in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        action_mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for row, tokens in enumerate(batch):
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            attention_mask[row, : len(tokens)] = 1
            action_mask[row, PROMPT_TOKENS - 1 : len(tokens) - 1] = True
        input_ids, attention_mask, action_mask = (t.to(device) for t in (input_ids, attention_mask, action_mask))
        log_probs = actor(input_ids, action_mask, attention_mask)
        values = critic(input_ids, action_mask, attention_mask)
        for row, tokens in enumerate(batch):
            span = slice(PROMPT_TOKENS - 1, len(tokens) - 1)  # the positions that score the response tokens
            outputs.append((log_probs[row, span].float().cpu(), values[row, span].float().cpu()))
    return outputs


@torch.no_grad()
def scorer_pass(scorers, sequences, chunk_size):
    """Every sequence through the scorers (per sequence, their outputs in order), in chunks of ``chunk_size``
    (None: whole), as the protocol sends."""
    results = {role: {} for role in scorers}
    sent = [0] * len(sequences)
    while any(s is not None for s in sent):
        chunks = []
        for i, tokens in enumerate(sequences):
            if sent[i] is None:
                continue
            end = len(tokens) if chunk_size is None else min(len(tokens), max(sent[i], PROMPT_TOKENS) + chunk_size)
            chunks.append(Chunk(f"s{i}", sent[i], tokens[sent[i] : end], PROMPT_TOKENS, final=end == len(tokens)))
            sent[i] = None if end == len(tokens) else end
        for role, scorer in scorers.items():
            results[role].update(scorer.process(chunks))
    return [tuple(results[role][f"s{i}"].output.float().cpu() for role in scorers) for i in range(len(sequences))]


def vllm_pass(llm, sequences):
    """The policy's log-probs of the response tokens from vLLM's prompt log-probs, as
    ``streaming/engine_logprobs.py`` asks for them (critic: none)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=tokens) for tokens in sequences]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (torch.tensor([out.prompt_logprobs[i][tokens[i]].logprob for i in range(PROMPT_TOKENS, len(tokens))]),)
        for out, tokens in zip(outputs, sequences)
    ]


def start_vllm(path: str, dtype: torch.dtype, device: str, max_len: int):
    from vllm import LLM

    # Prefill only: no CUDA graphs to capture. vLLM's share leaves the policy and critic their room on the card.
    memory = dict(gpu_memory_utilization=0.5) if device == "cuda" else dict(kv_cache_memory_bytes=256 << 20)
    return LLM(path, dtype=dtype, max_model_len=max_len, enforce_eager=True, seed=0, **memory)


def timed(run, repeats: int, device: str):
    """The outputs of one run, and the median wall time of ``repeats`` more (after that warm-up)."""
    outputs, seconds = run(), []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return outputs, statistics.median(seconds)


def differences(ours, theirs) -> dict:
    """The largest and the mean absolute difference over every log-prob and value."""
    gaps = torch.cat(
        [(a - b).abs().flatten().float() for pair, other in zip(ours, theirs) for a, b in zip(pair, other)]
    )
    return dict(max_difference=gaps.max().item(), mean_difference=gaps.mean().item())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(tiny.SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--sequences", type=int, default=32, help="sequences per pass (a step's batch)")
    parser.add_argument("--micro_batch", type=int, default=8, help="upstream's --rollout.micro_batch_size")
    parser.add_argument("--chunk_size", type=int, default=256, help="tokens per chunk in the chunked pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="also time vLLM's prompt log-probs (the policy only)")
    parser.add_argument("--out", required=True, help="the figures, as JSON")
    add_workload_arguments(parser)
    args = parser.parse_args()
    check_workload_arguments(parser, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # float32 only on the CPU
    folder = tempfile.TemporaryDirectory(prefix="prefill-cost-")
    actor, critic, actor_path = load_models(folder.name, args.shape, args.device, dtype)
    sequences = make_sequences(args, actor.model.config.vocab_size)
    tokens = sum(len(s) for s in sequences)

    def scorers():
        budget = 1 << 40  # no eviction: this measures the prefill itself
        return dict(policy=ChunkScorer(actor.model, "policy", budget), critic=ChunkScorer(critic, "critic", budget))

    reference, upstream_s = timed(
        lambda: upstream(actor, critic, sequences, args.micro_batch, args.device), args.repeats, args.device
    )
    passes = {"upstream": dict(seconds=upstream_s, max_difference=0.0, mean_difference=0.0)}
    # Upstream again, one sequence a micro-batch: how far its own numbers move when only the batching changes.
    outputs, seconds = timed(lambda: upstream(actor, critic, sequences, 1, args.device), 1, args.device)
    passes["upstream_one_a_batch"] = dict(seconds=seconds, **differences(outputs, reference))
    for name, chunk_size in (("whole", None), ("chunked", args.chunk_size)):
        outputs, seconds = timed(lambda: scorer_pass(scorers(), sequences, chunk_size), args.repeats, args.device)
        passes[name] = dict(seconds=seconds, **differences(outputs, reference))
    if args.vllm:
        policy_only = [(log_probs,) for log_probs, _ in reference]
        budget = 1 << 40
        outputs, seconds = timed(
            lambda: scorer_pass(dict(policy=ChunkScorer(actor.model, "policy", budget)), sequences, None),
            args.repeats,
            args.device,
        )
        passes["whole_policy_only"] = dict(seconds=seconds, **differences(outputs, policy_only))
        llm = start_vllm(actor_path, dtype, args.device, max(len(s) for s in sequences) + 1)
        outputs, seconds = timed(lambda: vllm_pass(llm, sequences), args.repeats, args.device)
        passes["vllm_prompt_logprobs"] = dict(seconds=seconds, **differences(outputs, policy_only))
    folder.cleanup()
    for figures in passes.values():
        figures["tokens_per_s"] = tokens / figures["seconds"]

    result = dict(
        # The output file as OUT: where this machine keeps it says nothing about the figures.
        command="python "
        + " ".join([os.path.relpath(__file__)] + ["OUT" if a == args.out else a for a in sys.argv[1:]]),
        machine=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        versions=dict(torch=torch.__version__, **({"vllm": __import__("vllm").__version__} if args.vllm else {})),
        shape=args.shape,
        dtype=str(dtype).removeprefix("torch."),
        sequences=len(sequences),
        tokens=tokens,
        response_tokens=tokens - PROMPT_TOKENS * len(sequences),
        chunk_size=args.chunk_size,
        micro_batch=args.micro_batch,
        passes=passes,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.shape} ({result['dtype']}, {result['machine']}): {len(sequences)} sequences, {tokens} tokens")
    for name, figures in passes.items():
        print(
            f"  {name:20s} {figures['seconds']:8.3f} s  {figures['tokens_per_s']:10.0f} tokens/s  |difference| to"
            f" upstream: max {figures['max_difference']:.2e}, mean {figures['mean_difference']:.2e}"
        )


if __name__ == "__main__":
    main()
