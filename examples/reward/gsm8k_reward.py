"""GSM8K rule reward for OpenRLHF's ``--reward.remote_url path/to/this.py``: 1.0 when the last number in the
response equals the reference answer's (the number after ``####``), else 0.0."""

import re

import torch

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def last_number(text: str):
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt) :] if query.startswith(prompt) else query
        reference = label.split("####")[-1].strip().replace(",", "")
        rewards.append(1.0 if last_number(response) == reference else 0.0)
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards}}
