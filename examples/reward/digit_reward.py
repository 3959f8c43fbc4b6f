"""A rule reward a random-init model can learn fast (for the convergence check): the share of the digits
in the response that are "1". The small benchmark tokenizer decodes most ids to filler words ``t<id>``,
so PPO raises the reward by preferring ids written with ones."""

import torch


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        digits = [c for c in query[len(prompt) :] if c.isdigit()]
        rewards.append(digits.count("1") / (len(digits) + 1))
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards}
