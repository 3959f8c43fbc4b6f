"""A learnable task with a verifiable answer and long-tailed response lengths: addition with a chain of carries.

The prompt is a sum of two numbers, ``5821+967=``; the response adds them digit by digit from the right,
one ``a+b+carry=sum`` step of 8 characters each, then gives the answer after ``;`` and ends::

    5821+967=1+7+0=08,2+6+0=08,8+9+0=17,5+0+1=06;6788<|endoftext|>

Why this task:

* The answer, and every step of the chain, is checked exactly. The label picks the reward: 1 for the right sum
  (``answer`` credit, the default) or the share of right steps (``steps`` credit, which still tells apart the
  samples of a long sum whose answers are all wrong). The share of right answers is logged as ``accuracy``.
* The response grows with the digits (9 tokens a digit with the byte-level tokenizer), drawn from a lognormal
  (``DIGITS``): most sums are short, a few long. That long tail is what OPPO's overlap works on: the longest
  response sets how long a batch decodes, the mean how long it trains.
* Each step is the same small computation, so a model of a few million parameters learns it, and a partly
  trained one gets short sums right more often than long ones: accuracy has room to rise under PPO.

OpenRLHF loads this file by path (``--reward.remote_url .../addition.py``) and calls ``reward_func``, so it
imports nothing of this package.
"""

import json
import math
import random
import re
from typing import List, Optional

EOS = "<|endoftext|>"  # the benchmark tokenizer's end of text (``tiny.make_tokenizer``)
CREDITS = ("steps", "answer")  # what the reward gives credit for (``score``)
# Digits of the longer number: lognormal with this mean and sigma (of the underlying normal), clipped.
DIGITS = dict(mean=6.0, sigma=1.0, low=1, high=40)
# The longer number's digit counts that the accuracy is also logged for (``reward_func``): which sums a policy
# learns shows where its accuracy stops rising.
DIGIT_BANDS = ((1, 3), (4, 6), (7, None))  # None: no upper bound


def digit_counts(count: int, seed: int, mean: float, sigma: float, low: int, high: int) -> List[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2  # so that the lognormal's mean is ``mean``
    return [int(min(high, max(low, round(rng.lognormvariate(mu, sigma))))) for _ in range(count)]


def problems(count: int, seed: int, **digits) -> List[tuple]:
    """``count`` pairs of numbers: the longer one has a drawn number of digits, the other as many or fewer."""
    rng = random.Random(seed + 1)
    pairs = []
    for n in digit_counts(count, seed, **dict(DIGITS, **digits)):
        a, b = _number(rng, n), _number(rng, rng.randint(1, n))
        pairs.append((a, b) if rng.random() < 0.5 else (b, a))
    return pairs


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def solution(a: int, b: int) -> str:
    """The chain of carries and the answer (without the end of text)."""
    steps, carry = [], 0
    for i in range(max(len(str(a)), len(str(b)))):
        x, y = a // 10**i % 10, b // 10**i % 10
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return ",".join(steps) + f";{a + b}"


def operands(prompt: str) -> tuple:
    """``(a, b)`` of a prompt ``a+b=``."""
    match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
    if match is None:
        raise ValueError(f"not a prompt of the addition task: {prompt!r}")
    return int(match[1]), int(match[2])


def digits(prompt: str) -> int:
    """The digits of a prompt's longer number."""
    return max(len(str(n)) for n in operands(prompt))


def in_band(count: int, band: tuple) -> bool:
    """Whether ``count`` digits are in a ``DIGIT_BANDS`` band."""
    return band[0] <= count and (band[1] is None or count <= band[1])


def band_name(band: tuple) -> str:
    """``1-3``, or ``7+`` for the last band."""
    return f"{band[0]}-{band[1]}" if band[1] else f"{band[0]}+"


def band_key(band: tuple, what: str) -> str:
    """The logged name of ``what`` (``share`` of the step's samples, or ``right`` among them) for a digit band."""
    return f"{what}_digits_{band[0]}_{band[1] or 'up'}"


def label(a: int, b: int, credit: str) -> str:
    """The prompt's label: the sum, after ``steps:`` where the reward gives credit for each step of the chain."""
    if credit not in CREDITS:
        raise ValueError(f"credit {credit!r} is not one of {CREDITS}")
    return f"steps:{a + b}" if credit == "steps" else str(a + b)


def answer(response: str) -> Optional[str]:
    """The answer a response gives: what follows its last ``;``, if the response ended (at the end of text)."""
    if not response.endswith(EOS) or ";" not in response:
        return None
    return response[: -len(EOS)].rsplit(";", 1)[1]


def step_credit(prompt: str, response: str) -> float:
    """The share of the right response's steps that ``response`` has right in their place, its answer counting as
    one step more: 1 for the right response, 0 for one that did not end (cut off at the length limit)."""
    if not response.endswith(EOS):
        return 0.0
    chain, total = solution(*operands(prompt)).rsplit(";", 1)
    given = response[: -len(EOS)].rsplit(";", 1)[0].split(",")
    right = sum(x == y for x, y in zip(given, chain.split(","))) + (answer(response) == total)
    return right / (chain.count(",") + 2)


def score(prompt: str, response: str, label: str) -> float:
    """The reward of one response: ``step_credit`` for a ``steps:`` label, else 1 for the right sum, 0 otherwise."""
    credit, _, total = label.rpartition(":")
    if credit == "steps":
        return step_credit(prompt, response)
    return float(answer(response) == total)


def reward_func(queries, prompts, labels):
    """OpenRLHF's rule reward (``score``), given at the end of each response.

    Logged beside it (``extra_logs``): ``accuracy``; ``first_token_end``, responses that are the end of text
    alone (possible only with ``--rollout.min_new_tokens 0``, see ``learning.first_token_flags``); and per
    ``DIGIT_BANDS`` band the share of samples in it (``share_digits_LO_HI``) and of those right
    (``right_digits_LO_HI``). OpenRLHF logs means over a step's samples, so a band's accuracy is their ratio
    (``learning_report.band_accuracy``)."""
    import torch

    responses = [query[len(prompt) :] for query, prompt in zip(queries, prompts)]
    rewards = torch.tensor([score(*args) for args in zip(prompts, responses, labels)])
    sums = [tag.rpartition(":")[2] for tag in labels]
    right = torch.tensor([float(answer(response) == total) for response, total in zip(responses, sums)])
    ended_at_once = torch.tensor([float(response == EOS) for response in responses])
    logs = {"accuracy": right, "first_token_end": ended_at_once}
    counts = [digits(prompt) for prompt in prompts]
    for band in DIGIT_BANDS:
        inside = torch.tensor([float(in_band(count, band)) for count in counts])
        logs[band_key(band, "share")], logs[band_key(band, "right")] = inside, inside * right
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


def write_prompts(path: str, count: int, seed: int, credit: str = "answer", **digits) -> dict:
    """A JSONL prompt set (``input``: the prompt, ``answer``: its ``label``) and what its responses' lengths will
    be."""
    lengths = []
    with open(path, "w") as f:
        for a, b in problems(count, seed, **digits):
            f.write(json.dumps({"input": prompt(a, b), "answer": label(a, b, credit)}) + "\n")
            lengths.append(len(solution(a, b)) + 1)  # tokens of the right response, its end of text included
    return dict(prompts=count, seed=seed, credit=credit, digits=dict(DIGITS, **digits), **length_summary(lengths))


def length_summary(lengths: List[int]) -> dict:
    ordered = sorted(lengths)
    return dict(
        mean_length=sum(ordered) / len(ordered),
        p90_length=ordered[int(0.9 * (len(ordered) - 1))],
        max_length=ordered[-1],
    )


def max_response_tokens(high: int) -> int:
    """Twice the longest right response (to a sum of ``high`` digits: 9 tokens a step, the answer of up to
    ``high + 1`` digits, ``;`` and the end of text), so that a wrong one has room to end too."""
    return 2 * (10 * high + 2)
