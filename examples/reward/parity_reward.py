"""A rule reward a random-init model learns within tens of steps (the convergence check): the share of
the response's tokens with an even id. The small benchmark tokenizer decodes the ids it does not spend
on bytes to filler words ``t<id>``, so the id of almost every sampled token can be read back from the
text. Every token counts (a chance policy scores 0.5), and raising it is one direction in the hidden
state (the even rows of the output layer against the odd ones), which PPO finds in a few steps."""

import re

import torch

FILLER = re.compile(r"t(\d+)")


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        ids = [int(word) for word in FILLER.findall(query[len(prompt) :])]
        rewards.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards}
