"""Supervised warm-up for the learning benchmark: a Qwen2-shaped model learns the addition task part of the way.

    python -m openrlhf_oppo.bench.warmup --out DIR [--shape small] [--target 0.3] [--digits_mean 6] [--digits_sigma 1]
        [--headroom 0.35]

Plain PyTorch, on the GPU if there is one. A random-init ``tiny.SHAPES`` model with the byte-level benchmark
tokenizer (no downloads) trains on fresh sums every step (loss on the response only) until its greedy accuracy
on held-out sums reaches ``target``: it gets some sums right and many wrong, which PPO can improve. With
``headroom`` it stops instead at the first evaluation where its responses sampled as PPO samples them are right at
most ``target`` of the time, and the sums with a right one among ``samples`` are at least ``headroom`` more: with
the answer's credit PPO learns from those sums only, and earlier runs rose to about their share (docs/results,
learning-1gpu-small-addition-digits-mean2-sync), so the gap is the room a run has to rise. It writes
``DIR/models/actor``, ``DIR/models/reward`` (as ``tiny.make_checkpoints`` builds them) and ``DIR/warmup.json``
(accuracy by digits, a few wrong responses, and how often ``samples`` responses sampled as PPO samples them get
each sum right: what PPO can learn from). A second run with the same settings reuses them.
"""

import argparse
import hashlib
import json
import os
import time

from openrlhf_oppo import tiny
from openrlhf_oppo.bench import addition

# Seeds of the sums: the training draws and the held-out set use their own, apart from the PPO prompts'.
TRAIN_SEED, HELDOUT_SEED = 10**7, 10**7 - 1


def warm_up(
    workdir: str,
    shape: str = "small",
    target: float = 0.3,
    seed: int = 0,
    digits: dict = None,
    batch: int = 256,
    lr: float = 5e-4,
    max_steps: int = 5000,
    eval_every: int = 10,
    heldout: int = 256,
    dtype: str = "bfloat16",
    samples: int = 8,
    headroom: float = None,
) -> dict:
    """Train until the held-out greedy accuracy reaches ``target`` (or, with ``headroom``, until ``stop_here`` says
    so; or ``max_steps``), save, return the summary."""
    settings = dict(
        shape=shape, target=target, seed=seed, digits=dict(addition.DIGITS, **(digits or {})), batch=batch, lr=lr
    )
    settings.update(max_steps=max_steps, eval_every=eval_every, heldout=heldout, dtype=dtype, samples=samples)
    if headroom is not None:  # absent otherwise, so that warm-ups cached before keep their settings
        settings["headroom"] = headroom
    summary_path = os.path.join(workdir, "warmup.json")
    actor_dir, reward_dir = os.path.join(workdir, "models", "actor"), os.path.join(workdir, "models", "reward")
    if os.path.exists(summary_path) and os.path.exists(os.path.join(reward_dir, "config.json")):
        with open(summary_path) as f:
            summary = json.load(f)
        if summary["settings"] == settings:
            print(f"[warm-up] reusing {workdir}/models: held-out accuracy {summary['accuracy']:.1%}", flush=True)
            return summary

    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(actor_dir, exist_ok=True)
    tiny.make_tokenizer(actor_dir, tiny.SHAPES[shape]["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny.qwen2_config(shape)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup_steps = min(100, max_steps // 10 + 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
    tests = addition.problems(heldout, seed + HELDOUT_SEED, **settings["digits"])
    # Greedy responses stop a little past the longest right one: one longer than that is not a chain of carries.
    max_new_tokens = max(len(addition.solution(a, b)) for a, b in tests) + 8
    print(
        f"[warm-up] {shape} model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) on {device},"
        f" until greedy accuracy on {heldout} held-out sums reaches {target:.0%}",
        flush=True,
    )

    started, history, step, done, past = time.time(), [], 0, False, False
    while step < max_steps and not (done or past):
        model.train()
        for _ in range(steps_to_next_check(history, eval_every, target, headroom)):
            pairs = addition.problems(batch, (seed + 1) * TRAIN_SEED + step, **settings["digits"])
            loss = _loss(model, *_batch(tokenizer, pairs, device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
        right = greedy_right(model, tokenizer, tests, max_new_tokens, device)
        accuracy, bands = sum(right) / len(right), accuracy_by_digits(tests, right)
        point = dict(step=step, loss=loss.item(), accuracy=accuracy, accuracy_by_digits=bands)
        if headroom is not None:  # every held-out sum's samples in one batch: an evaluation at every check
            sampled = sampled_right(model, tokenizer, tests, samples, max_new_tokens, device, heldout * samples)
            point.update(sampled_summary(tests, sampled))
        history.append(dict(point, seconds=time.time() - started))
        done = stop_here(point, target, headroom)
        # Past the sampled accuracy allowed, the room can only shrink: stop short of the rule rather than train on.
        past = headroom is not None and point["sampled_accuracy"] > target
        print(
            f"[warm-up] step {step}: loss {loss.item():.3f}, held-out accuracy {accuracy:.1%}"
            f" ({_bands(bands)}{_sampled_line(point)}; {time.time() - started:.0f} s)",
            flush=True,
        )

    tiny.save_causal_lm(model, actor_dir, dtype)
    tiny.save_value_model(actor_dir, reward_dir, dtype)
    # The accuracy of what was saved (rounded through bfloat16), which is what PPO starts from.
    saved = Qwen2ForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).to(device)
    responses = greedy_responses(saved, tokenizer, tests, max_new_tokens, device)
    right = right_answers(tests, responses)
    torch.manual_seed(seed)
    sampled = sampled_right(saved, tokenizer, tests, samples, max_new_tokens, device)
    summary = dict(
        settings=settings,
        steps=step,
        seconds=time.time() - started,
        accuracy=sum(right) / len(right),
        # PPO with the answer's credit learns nothing from sums whose samples are all wrong: where the saved model
        # gets none of a band right, the most a run can rise is the other bands' share (docs/benchmark.md).
        accuracy_by_digits=accuracy_by_digits(tests, right),
        # How it gets them wrong: whether a long sum's chain goes astray at its first steps or at the answer.
        wrong_by_digits=wrong_by_digits(tests, responses, right),
        # PPO's samples: at temperature 1 the model gets fewer sums right than greedily (sampled_accuracy), and a
        # sum is learnable where one of its group's samples gets it right (pass_at_samples): with the answer's
        # credit, the accuracy PPO can reach soon is about pass_at_samples.
        **sampled_summary(tests, sampled),
        reached_target=done,
        history=history,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
    )
    if device == "cuda":
        # The PPO runs that follow share the GPU with this process: what its allocator holds on to (a batch of 256
        # sums with their logits, at every width the batches had) would be taken from vLLM and the models.
        summary["gpu_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        del model, optimizer, scheduler, saved
        torch.cuda.empty_cache()
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    if not summary["reached_target"]:
        why = f"its sampled accuracy passed {target:.0%}" if past else f"{max_steps} steps"
        print(f"[warm-up] stopped short of its stopping rule: {why}", flush=True)
    print(
        f"[warm-up] saved {actor_dir}: held-out accuracy {summary['accuracy']:.1%}; of {samples} samples per sum"
        f" {summary['sampled_accuracy']:.1%} right, a sum with one right sample {summary['pass_at_samples']:.1%}"
        f" ({_bands(summary['pass_at_samples_by_digits'])})",
        flush=True,
    )
    return summary


def stop_here(point: dict, target: float, headroom: float = None) -> bool:
    """Whether the warm-up stops at this evaluation (``point``: a ``history`` entry). Without ``headroom``: the
    greedy accuracy reached ``target``. With it: sampled at temperature 1 the responses are right at most ``target``
    of the time, and the sums with a right one among the samples (pass@samples) are at least ``headroom`` more:
    PPO starts low, with that much room to rise."""
    if headroom is None:
        return point["accuracy"] >= target
    sampled = point["sampled_accuracy"]
    return sampled <= target and point["pass_at_samples"] - sampled >= headroom


def steps_to_next_check(history: list, eval_every: int, target: float, headroom: float = None) -> int:
    """Steps to train before the next check. Once it starts to rise, the sampled accuracy can pass ``target`` within
    a few steps and jump over the steps where the headroom rule holds: from a quarter of the target on, every step
    is checked."""
    if headroom is not None and history and history[-1]["sampled_accuracy"] >= target / 4:
        return 1
    return eval_every


def _sampled_line(point: dict) -> str:
    if "pass_at_samples" not in point:
        return ""
    return f"; sampled {point['sampled_accuracy']:.1%}, pass@samples {point['pass_at_samples']:.1%}"


def made_before(workdir: str, shape: str, digits: dict) -> dict:
    """The summary of the warm-up in ``workdir`` (``models/`` and ``warmup.json``), made before by this module, for
    runs that share it; an error where there is none, or where its shape or sums are not the run's."""
    path = os.path.join(workdir, "warmup.json")
    if not os.path.exists(path) or not os.path.exists(os.path.join(workdir, "models", "actor", "config.json")):
        raise FileNotFoundError(f"no warm-up in {workdir}: make it first (python -m openrlhf_oppo.bench.warmup)")
    with open(path) as f:
        summary = json.load(f)
    wanted = dict(shape=shape, digits=dict(addition.DIGITS, **digits))
    made = {key: summary["settings"][key] for key in wanted}
    if made != wanted:
        raise ValueError(f"the warm-up in {workdir} was made for {made}, the run wants {wanted}")
    return summary


def checkpoint_sha256(workdir: str) -> str:
    """The SHA-256 of the warm-up's policy weights (``models/actor/model.safetensors``): runs with the same one
    started from the same model."""
    digest = hashlib.sha256()
    with open(os.path.join(workdir, "models", "actor", "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _batch(tokenizer, pairs, device):
    """Prompt + response + end of text, right-padded; labels only on the response and its end of text."""
    import torch

    prompts = [tokenizer(addition.prompt(a, b), add_special_tokens=False)["input_ids"] for a, b in pairs]
    responses = [tokenizer(addition.solution(a, b), add_special_tokens=False)["input_ids"] for a, b in pairs]
    eos = tokenizer.eos_token_id
    width = max(len(p) + len(r) + 1 for p, r in zip(prompts, responses))
    ids = torch.full((len(pairs), width), eos, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        sequence = p + r + [eos]
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(p) : len(sequence)] = torch.tensor(r + [eos])
        mask[row, : len(sequence)] = 1
    return ids.to(device), labels.to(device), mask.to(device)


def _loss(model, ids, labels, mask):
    import torch

    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def accuracy_by_digits(pairs, right: list) -> dict:
    """The share of right ones among ``pairs`` whose longer number has each ``addition.DIGIT_BANDS`` band's digits
    (``"4-6"``; ``"7+"`` for the last), for the bands the pairs have: which sums the model gets right."""
    counts = [addition.digits(addition.prompt(a, b)) for a, b in pairs]
    shares = {}
    for band in addition.DIGIT_BANDS:
        oks = [ok for count, ok in zip(counts, right) if addition.in_band(count, band)]
        if oks:
            shares[addition.band_name(band)] = sum(oks) / len(oks)
    return shares


def _bands(bands: dict) -> str:
    """Shares by the longer number's digits, as '1-3 digits 54%, 4-6 digits 0%'."""
    return ", ".join(f"{k} digits {v:.0%}" for k, v in bands.items())


def wrong_by_digits(pairs, responses: list, right: list, per_band: int = 3) -> dict:
    """Per ``addition.DIGIT_BANDS`` band, the first ``per_band`` wrong greedy responses, each after its prompt."""
    wrong = {}
    for (a, b), response, ok in zip(pairs, responses, right):
        count = addition.digits(addition.prompt(a, b))
        band = next(band for band in addition.DIGIT_BANDS if addition.in_band(count, band))
        examples = wrong.setdefault(addition.band_name(band), [])
        if not ok and len(examples) < per_band:
            examples.append(addition.prompt(a, b) + response)
    return wrong


def greedy_right(model, tokenizer, pairs, max_new_tokens: int, device, batch: int = 256) -> list:
    """For each of ``pairs``, whether its greedy response gives the right sum and ends."""
    return right_answers(pairs, greedy_responses(model, tokenizer, pairs, max_new_tokens, device, batch))


def right_answers(pairs, responses: list) -> list:
    """For each of ``pairs``, whether its response gives the right sum and ends."""
    return [addition.answer(response) == str(a + b) for (a, b), response in zip(pairs, responses)]


def greedy_responses(model, tokenizer, pairs, max_new_tokens: int, device, batch: int = 256) -> list:
    """The greedy response to each of ``pairs``, up to its first end of text (included, where it has one)."""
    return _responses(model, tokenizer, pairs, max_new_tokens, device, batch, do_sample=False)


def sampled_right(model, tokenizer, pairs, samples: int, max_new_tokens: int, device, batch: int = 256) -> list:
    """For each of ``pairs``, whether each of ``samples`` responses sampled at temperature 1 over the whole vocabulary
    (as the PPO runs sample, OpenRLHF's default ``--rollout.temperature``) gives the right sum and ends."""
    responses = _responses(
        model, tokenizer, pairs, max_new_tokens, device, max(1, batch // samples),
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples,
    )  # fmt: skip
    return [
        right_answers([pair] * samples, responses[i * samples : (i + 1) * samples]) for i, pair in enumerate(pairs)
    ]


def sampled_summary(pairs, sampled: list) -> dict:
    """``sampled_right``'s results as shares: of all samples, and of sums with at least one right, overall and by
    the longer number's digits."""
    share = [sum(oks) / len(oks) for oks in sampled]
    anyone = [any(oks) for oks in sampled]
    return dict(
        sampled_accuracy=sum(share) / len(share),
        sampled_accuracy_by_digits=accuracy_by_digits(pairs, share),
        pass_at_samples=sum(anyone) / len(anyone),
        pass_at_samples_by_digits=accuracy_by_digits(pairs, anyone),
    )


def _responses(model, tokenizer, pairs, max_new_tokens: int, device, batch: int, **sampling) -> list:
    """The responses ``model.generate`` gives ``pairs`` with ``sampling``, in order, each up to its first end of
    text (included, where it has one)."""
    import torch

    model.eval()
    tokenizer.padding_side = "left"
    responses = []
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        inputs = tokenizer([addition.prompt(a, b) for a, b in chunk], return_tensors="pt", padding=True).to(device)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
                **sampling,
            )
        for ids in out[:, inputs["input_ids"].shape[1] :].tolist():
            if tokenizer.eos_token_id in ids:  # up to the first end of text: what follows is padding
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
            responses.append(tokenizer.decode(ids))
    return responses


def add_digits_arguments(parser: argparse.ArgumentParser) -> None:
    """The sums' digits (``addition.DIGITS``), for the warm-up and the learning benchmark alike: a run can only
    start from a warm-up made on the same sums (``made_before``)."""
    parser.add_argument("--digits_mean", type=float, default=addition.DIGITS["mean"])
    parser.add_argument("--digits_high", type=int, default=addition.DIGITS["high"])
    parser.add_argument(
        "--digits_sigma",
        type=_sigma,
        default=addition.DIGITS["sigma"],
        help="sigma of the digits' lognormal: above 1, more short sums and a longer tail of long ones",
    )


def _sigma(value: str) -> float:
    sigma = float(value)
    if sigma < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return sigma


def digits_of(args: argparse.Namespace) -> dict:
    """The digits ``add_digits_arguments`` read, as ``addition.problems`` takes them."""
    return dict(mean=args.digits_mean, sigma=args.digits_sigma, high=args.digits_high)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the workload folder (models/ and warmup.json go there)")
    parser.add_argument("--shape", default="small", choices=sorted(tiny.SHAPES))
    parser.add_argument(
        "--target",
        type=float,
        default=0.3,
        help="held-out greedy accuracy at which to stop; with --headroom, the most sampled accuracy to stop at",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="stop where pass@samples is at least this far above the sampled accuracy (and that at most --target); "
        "stop short of it once the sampled accuracy passes --target",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_digits_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max_steps", type=int, default=5000)
    parser.add_argument(
        "--eval_every", type=int, default=10, help="steps between evaluations: how far past the target it may stop"
    )
    parser.add_argument(
        "--samples", type=int, default=8, help="responses sampled per held-out sum once saved (PPO's group size)"
    )
    args = parser.parse_args()
    summary = warm_up(
        args.out,
        args.shape,
        args.target,
        args.seed,
        digits_of(args),
        batch=args.batch,
        lr=args.lr,
        max_steps=args.max_steps,
        eval_every=args.eval_every,
        samples=args.samples,
        headroom=args.headroom,
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))


if __name__ == "__main__":
    main()
