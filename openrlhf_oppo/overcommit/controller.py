"""The overcommit degree Delta under ``--oppo.overcommit auto`` (the paper's rule).

Over a window of ``w`` steps the reward slope is the mean step-to-step change of the mean reward.
While it is positive, training still gains from speed: Delta grows by ``inc``. Otherwise Delta shrinks
by ``dec``, towards fully on-policy batches near convergence. Delta stays in ``[minimum, maximum]``.
"""

from collections import deque
from typing import Optional


class OvercommitController:
    def __init__(
        self,
        initial: int,
        auto: bool,
        window: int = 5,
        inc: int = 1,
        dec: int = 1,
        minimum: int = 0,
        maximum: int = 0,
    ):
        self.delta = initial
        self.auto = auto
        self.inc, self.dec = inc, dec
        self.minimum, self.maximum = minimum, maximum
        self.rewards = deque(maxlen=window + 1)  # w differences need w + 1 rewards

    def slope(self) -> Optional[float]:
        if len(self.rewards) < self.rewards.maxlen:
            return None
        values = list(self.rewards)
        return (values[-1] - values[0]) / (len(values) - 1)

    def update(self, mean_reward: float) -> int:
        """Record a step's mean reward; return Delta for the next step."""
        self.rewards.append(mean_reward)
        slope = self.slope()
        if self.auto and slope is not None:
            if slope > 0:
                self.delta = min(self.maximum, self.delta + self.inc)
            else:
                self.delta = max(self.minimum, self.delta - self.dec)
        return self.delta

    def state_dict(self) -> dict:
        return dict(delta=self.delta, rewards=list(self.rewards))

    def load_state_dict(self, state: dict) -> None:
        self.delta = state["delta"]
        self.rewards.clear()
        self.rewards.extend(state["rewards"])
