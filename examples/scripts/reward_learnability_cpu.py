"""Which reward can a random-init model learn within tens of steps? A CPU check for the convergence run.

The GPU convergence attempt (docs/RESULTS.md) used the digit rule reward and its reward stayed flat for
30 PPO steps in every system. This plain REINFORCE loop (no OpenRLHF, no PPO clipping, same ``small``
random model, same response lengths) compares that rule reward with the random reward model that the
benchmark builds from the actor's own weights (``tiny.make_checkpoints``): the reward model scores the
last token through the embeddings the actor shares, so raising it is one direction in the actor's
hidden state, not a choice among 8k unrelated tokens. Prints the mean reward per step for each, and
writes them as JSON.

    python examples/scripts/reward_learnability_cpu.py --out runs/reward-learnability.json
"""

import argparse
import importlib.util
import json
import os
import statistics

import torch

from openrlhf_oppo import tiny
from openrlhf_oppo.bench import report


def load_rule_reward(name):
    path = os.path.join(os.path.dirname(__file__), "..", "reward", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


def run(kind, actor_path, reward_path, steps, batch, length, lr, seed):
    from openrlhf.models import get_llm_for_sequence_regression
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(actor_path)
    policy = AutoModelForCausalLM.from_pretrained(actor_path, torch_dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    if kind == "reward_model":
        scorer = get_llm_for_sequence_regression(reward_path, "reward", param_dtype="bf16", attn_implementation="sdpa")
        scorer = scorer.float()  # stored rounded through bf16 (tiny.make_checkpoints): no loss
        scorer.eval()
    else:
        rule = load_rule_reward(kind)
    prompt = tokenizer(["Write some numbers:"] * batch, return_tensors="pt")
    start = prompt["input_ids"].shape[1]  # first response position
    curve = []
    for step in range(steps):
        with torch.no_grad():
            out = policy.generate(
                **prompt, do_sample=True, max_new_tokens=length, min_new_tokens=length, pad_token_id=0, top_k=0
            )
            if kind == "reward_model":
                reward = scorer(out, attention_mask=torch.ones_like(out)).float()
            else:
                queries = tokenizer.batch_decode(out)
                prompts = tokenizer.batch_decode(prompt["input_ids"])
                reward = rule(queries, prompts, None)["rewards"]
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
        logits = policy(out).logits[:, start - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, out[:, start:, None])[..., 0]
        loss = -(advantage[:, None] * logprobs).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(reward.mean().item())
        print(f"{kind:13s} step {step:3d} reward {curve[-1]:.4f}", flush=True)
    return curve


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/oppo-learnability")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--rewards",
        default="reward_model,digit_reward,parity_reward",
        help="reward_model (the benchmark's random reward model) or rule rewards from examples/reward/",
    )
    args = parser.parse_args()
    actor, reward = tiny.make_checkpoints(args.workdir, "small", "float32")
    curves = {
        kind: run(kind, actor, reward, args.steps, args.batch, args.length, args.lr, args.seed)
        for kind in args.rewards.split(",")
    }
    summary = {}
    for kind, curve in curves.items():
        first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
        spread = statistics.pstdev(curve[:5])
        summary[kind] = dict(first5=first, last5=last, first5_std=spread)
        print(f"{kind}: mean reward of the first 5 steps {first:.4f} (std {spread:.4f}), of the last 5 {last:.4f}")
    if args.out:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(out_dir, exist_ok=True)
        with open(args.out, "w") as f:
            folders = report.machine_folders(out_dir, None, args.workdir)
            results = dict(args=vars(args), curves=curves, summary=summary)
            json.dump(report.without_machine_folders(results, folders), f, indent=1)


if __name__ == "__main__":
    main()
