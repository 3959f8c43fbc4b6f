"""Which reward does group_norm learn the addition task from faster: credit for each step of the chain, or for the
answer alone? A CPU check for the learning benchmark's ``--credit``.

In the benchmark's GPU runs the reward was 1 for a right answer, and at most about a third of a step's prompts
had samples that differed (docs/RESULTS.md, Convergence): group_norm has nothing to learn from the others. This
loop warms up a small model on the task (``bench/warmup.py``, supervised), then trains one copy of it per credit
with the same policy-gradient step: 8 samples a prompt, advantages normalised within each prompt's samples
(OpenRLHF's group_norm), one update per batch of fresh samples (so no clipping or importance weights are
needed), no KL term. Both copies see the same prompts. It records per step the share of right answers among the
samples (and per band of the longer number's digits, ``addition.DIGIT_BANDS``), and every ``--eval_every`` steps the greedy accuracy on held-out sums; prints a line per step and
writes JSON.

    python examples/scripts/credit_learnability_cpu.py --out runs/credit-learnability.json
"""

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from openrlhf_oppo import tiny
from openrlhf_oppo.bench import addition, warmup

# Larger than ``tiny`` (which learns sums of one or two digits), far smaller than the benchmark's ``small``.
SHAPE = "credit-check"
tiny.SHAPES[SHAPE] = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
RL_SEED = 10**6  # the PPO prompts' seeds, apart from the warm-up's and the held-out sums'


def sample(model, tokenizer, pairs, n_samples, max_new_tokens):
    """``n_samples`` responses a prompt at temperature 1: token ids (up to and with the first end of text) and
    their text."""
    prompts = [addition.prompt(a, b) for a, b in pairs for _ in range(n_samples)]
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    responses = []
    for ids in out[:, inputs["input_ids"].shape[1] :].tolist():
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        responses.append(ids)
    return prompts, responses, [tokenizer.decode(ids) for ids in responses]


def policy_loss(model, tokenizer, prompts, responses, advantages):
    """Minus the advantage-weighted log-probability of the response tokens, averaged over all of them (OpenRLHF's
    token-level mean)."""
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    on_response = torch.zeros((len(rows), width))
    for i, (row, response) in enumerate(zip(rows, responses)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        on_response[i, len(row) - len(response) : len(row)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    weights = on_response[:, 1:] * advantages[:, None]
    return -(logprobs * weights).sum() / on_response[:, 1:].sum()


def group_norm(rewards, n_samples):
    groups = rewards.view(-1, n_samples)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-9)).flatten()


def train(actor_dir, credit, seed, args, heldout):
    torch.manual_seed(seed)  # the sampling's; the prompts are the same for every seed and credit
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    model = Qwen2ForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    digits = dict(mean=args.digits_mean, high=args.digits_high)
    eval_tokens = max(len(addition.solution(a, b)) for a, b in heldout) + 8
    history = []
    for step in range(1, args.steps + 1):
        started = time.time()
        pairs = addition.problems(args.batch, RL_SEED + step, **digits)
        model.eval()
        longest = max(len(addition.solution(a, b)) for a, b in pairs)
        prompts, responses, texts = sample(model, tokenizer, pairs, args.n_samples, 2 * longest + 2)
        labels = [addition.label(a, b, credit) for a, b in pairs for _ in range(args.n_samples)]
        scored = addition.reward_func([p + t for p, t in zip(prompts, texts)], prompts, labels)  # as OpenRLHF calls it
        rewards, right = scored["rewards"], scored["extra_logs"]["accuracy"].tolist()
        spread = rewards.view(-1, args.n_samples).std(1)
        model.train()
        loss = policy_loss(model, tokenizer, prompts, responses, group_norm(rewards, args.n_samples))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        logs = {key: value.sum().item() for key, value in scored["extra_logs"].items()}
        record = dict(
            step=step,
            accuracy=sum(right) / len(right),
            # Per band of the longer number's digits: its samples and the right ones among them.
            bands={
                f"{lo}-{hi or ''}": [
                    logs[addition.band_key((lo, hi), "share")],
                    logs[addition.band_key((lo, hi), "right")],
                ]
                for lo, hi in addition.DIGIT_BANDS
            },
            reward=rewards.mean().item(),
            groups_that_differ=(spread > 0).float().mean().item(),
            response_length=statistics.mean(len(r) for r in responses),
            seconds=time.time() - started,
        )
        if step % args.eval_every == 0 or step == args.steps:
            right_heldout = warmup.greedy_right(model, tokenizer, heldout, eval_tokens, "cpu")
            record["heldout"] = sum(right_heldout) / len(right_heldout)
            record["heldout_by_digits"] = warmup.accuracy_by_digits(heldout, right_heldout)
        history.append(record)
        print(
            f"[{credit}, seed {seed}] step {step}: accuracy {record['accuracy']:.1%}, reward {record['reward']:.3f}, groups that"
            f" differ {record['groups_that_differ']:.0%}"
            + (f", held-out {record['heldout']:.1%}" if "heldout" in record else "")
            + f" ({record['seconds']:.1f} s)",
            flush=True,
        )
    return history


def plot(runs: dict, path: str) -> None:
    """Sampled accuracy (5-step moving mean) and held-out greedy accuracy per step, per credit: the mean over the
    seeds with a band from the lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (sampled, greedy) = plt.subplots(1, 2, figsize=(10, 4))
    for credit, histories in runs.items():
        curves = np.array([[r["accuracy"] for r in history] for history in histories])
        curves = np.array([np.convolve(c, np.ones(5) / 5, mode="valid") for c in curves])
        x = np.arange(5, curves.shape[1] + 5)
        (line,) = sampled.plot(x, curves.mean(0), label=f"{credit} credit")
        sampled.fill_between(x, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.2)
        steps = [r["step"] for r in histories[0] if "heldout" in r]
        held = np.array([[r["heldout"] for r in history if "heldout" in r] for history in histories])
        greedy.plot(steps, held.mean(0), marker="o", color=line.get_color(), label=f"{credit} credit")
        greedy.fill_between(steps, held.min(0), held.max(0), color=line.get_color(), alpha=0.2)
    sampled.set(xlabel="step", ylabel="share of right answers among the samples\n(5-step moving mean)")
    greedy.set(xlabel="step", ylabel="greedy accuracy on held-out sums")
    sampled.legend(fontsize=8)
    fig.suptitle("Addition, policy gradient with group_norm on CPU: mean and range over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file of the results")
    parser.add_argument("--workdir", default="/tmp/credit-learnability", help="the warm-up's checkpoint")
    parser.add_argument("--credits", default="answer,steps")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="prompts a step")
    parser.add_argument("--n_samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--digits_mean", type=float, default=3.0)
    parser.add_argument("--digits_high", type=int, default=8)
    parser.add_argument("--warmup_target", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0, help="the warm-up's and the held-out sums' seed")
    parser.add_argument("--seeds", default="0,1", help="the sampling's seeds: one run each, per credit")
    args = parser.parse_args()

    digits = dict(mean=args.digits_mean, high=args.digits_high)
    warm = warmup.warm_up(
        args.workdir, SHAPE, args.warmup_target, args.seed, digits, batch=64, lr=3e-3, max_steps=3000,
        eval_every=50, heldout=128, dtype="float32",
    )  # fmt: skip
    heldout = addition.problems(128, args.seed + warmup.HELDOUT_SEED, **dict(addition.DIGITS, **digits))
    actor_dir = os.path.join(args.workdir, "models", "actor")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = {
        credit: [train(actor_dir, credit, seed, args, heldout) for seed in seeds] for credit in args.credits.split(",")
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(settings=vars(args), warmup={k: v for k, v in warm.items() if k != "history"}, runs=runs), f)
    plot(runs, os.path.splitext(args.out)[0] + ".png")
    for credit, histories in runs.items():
        for seed, history in zip(seeds, histories):
            first, last = history[:5], history[-5:]
            print(
                f"{credit}, seed {seed}: sampled accuracy {statistics.mean(r['accuracy'] for r in first):.1%} (first"
                f" 5 steps) -> {statistics.mean(r['accuracy'] for r in last):.1%} (last 5); held-out"
                f" {warm['accuracy']:.1%} -> {history[-1]['heldout']:.1%}; groups that differ"
                f" {statistics.mean(r['groups_that_differ'] for r in history):.0%}"
            )
            print(f"  held-out by digits: warm-up {warm['accuracy_by_digits']} -> {history[-1]['heldout_by_digits']}")
            for band in history[0]["bands"]:
                (samples_first, right_first), (samples_last, right_last) = (
                    [sum(r["bands"][band][k] for r in part) for k in (0, 1)] for part in (history[:10], history[-10:])
                )
                print(
                    f"  {band} digits: sampled accuracy {right_first / max(samples_first, 1):.1%} (first 10 steps, "
                    f"{samples_first:.0f} samples) -> {right_last / max(samples_last, 1):.1%} (last 10)"
                )


if __name__ == "__main__":
    main()
