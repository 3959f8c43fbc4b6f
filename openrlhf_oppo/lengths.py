"""The trained responses by length, every step, with OPPO on and off: ``trained_length/*`` in OpenRLHF's logger.

A step of inter-step overlap ends when B groups are done, so the groups still decoding, the long responses, train
a step or more later: the short ones go first. To see whether that shows, and what it costs, each step logs, of the
responses it trains (upstream's ``_compute_rollout_stats`` reads the same ones; their mean length is upstream's
``rollout/response_length_mean``), for each length bucket of ``EDGES``:

* ``trained_length/share_LO_HI``: the share of the step's trained responses with LO to HI tokens (``LO_up`` for
  the last bucket);
* ``trained_length/reward_LO_HI``: their mean reward (``info["reward"]``, the reward before any KL penalty), where
  the bucket has responses this step.

The buckets are fixed, powers of two, so that runs and systems compare bucket by bucket: a mean over steps weighs
each step's reward by its share (``reward_by_length``).

``LengthStats`` adds them to upstream's rollout stats: OPPO's trainer has it, and with OPPO off the CLI runs
upstream's ``PPOTrainer`` with it and nothing else changed (``upstream_trainer.py``, ``extension.install``). This
module imports neither OpenRLHF nor torch, so that the reports read its names without them.
"""

PREFIX = "trained_length/"
# Response lengths in tokens where one bucket ends and the next starts: [0, 32), [32, 64), ..., [2048, inf).
EDGES = (32, 64, 128, 256, 512, 1024, 2048)


def buckets() -> list:
    """``(low, high)`` for each bucket, ``high`` excluded; None for the last bucket's."""
    lows = (0,) + EDGES
    return list(zip(lows, EDGES + (None,)))


def bucket_name(low: int, high) -> str:
    """``32_63`` (both ends included), ``2048_up`` for the last bucket."""
    return f"{low}_{high - 1}" if high is not None else f"{low}_up"


def key(what: str, low: int, high) -> str:
    """The logged name of ``what`` (``share`` or ``reward``) for a bucket."""
    return f"{PREFIX}{what}_{bucket_name(low, high)}"


def length_metrics(lengths, rewards) -> dict:
    """``trained_length/*`` for responses of ``lengths`` tokens that got ``rewards`` (tensors)."""
    lengths, rewards = lengths.float(), rewards.float()
    metrics = {}
    for low, high in buckets():
        inside = lengths >= low
        if high is not None:
            inside &= lengths < high
        metrics[key("share", low, high)] = inside.float().mean().item()
        if inside.any():
            metrics[key("reward", low, high)] = rewards[inside].mean().item()
    return metrics


def trained_length_metrics(experiences) -> dict:
    """``length_metrics`` of a step's experiences (upstream's ``Experience``: ``response_length`` and the reward in
    ``info``)."""
    import torch

    scored = [e for e in experiences if e.response_length is not None and "reward" in e.info]
    if not scored:
        return {}
    lengths = torch.cat([e.response_length.reshape(-1) for e in scored])
    rewards = torch.cat([e.info["reward"].reshape(-1) for e in scored])
    return length_metrics(lengths, rewards)


class LengthStats:
    """Upstream's rollout stats of the trained experiences, and ``trained_length_metrics`` of them."""

    def _compute_rollout_stats(self, experiences) -> dict:
        stats = super()._compute_rollout_stats(experiences)
        stats.update(trained_length_metrics(experiences))
        return stats
