"""The overcommit degree Delta under ``--oppo.overcommit auto``, by one of two rules (``--oppo.overcommit_rule``).

``reward_slope`` (the paper's, ``OvercommitController``): over a window of ``w`` steps the reward slope
is the mean step-to-step change of the mean reward. While it is positive, training still gains from
speed: Delta grows by ``inc``. Otherwise Delta shrinks by ``dec``, towards fully on-policy batches near
convergence.

``throughput`` (``ThroughputController``): Delta is there so that the models never wait for generation:
when training and the weight sync end and the next step starts, its B groups should be done. The
samples generator reports, per step, how long it waited for the B-th group and how many groups were
already done when the step started. A step *waited* if fewer than B groups were done at its start and
the B-th came more than ``tolerance_s`` later; it had a *surplus* if at least B + ``dec`` groups were
done at its start: those beyond B are carried once more, a weight version older, for no gain. Over the
last ``w`` steps since Delta last changed:

* if most waited, Delta grows by ``inc``;
* if all had a surplus, it shrinks by the smallest surplus of the window. With a share f of the groups in
  flight done, shrinking a surplus s away leaves B + s(1 - f) done, still B; a Delta far above need comes
  down in one window, where ``dec`` a window would keep the trained samples a weight version older for many.
  A step with a surplus counts as one even where it then waited for groups the lag bound made due: on a long
  tail, short waits for those marked most windows of a Delta far above need, which then came down by ``dec``;
* if most waited past the B-th group, without a surplus, for groups that the lag bound made due
  (``overdue``: more in flight than the bound lets carry), it shrinks by ``dec``;
* otherwise it stays.

The first two cannot hold in one step, and every change waits for ``w`` steps measured after it, so noise
does not move Delta to and fro. Its cost is the policy lag of the carried groups (``oppo/policy_lag_mean``),
which Delta bounds.

Either way Delta stays in ``[minimum, maximum]``. Each controller ignores the input of the other rule,
so the samples generator feeds both the same way.
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

    def record_generation(self, wait_s: float, done_at_start: int, overdue_wait_s: float = 0.0) -> int:
        return self.delta  # the throughput rule's input

    def state_dict(self) -> dict:
        return dict(delta=self.delta, rewards=list(self.rewards))

    def load_state_dict(self, state: dict) -> None:
        self.delta = state["delta"]
        self.rewards.clear()
        self.rewards.extend(state.get("rewards", []))


class ThroughputController:
    def __init__(
        self,
        initial: int,
        auto: bool,
        batch: int,
        window: int = 5,
        inc: int = 1,
        dec: int = 1,
        minimum: int = 0,
        maximum: int = 0,
        tolerance_s: float = 0.1,
    ):
        self.delta = initial
        self.auto = auto
        self.batch = batch
        self.inc, self.dec = inc, dec
        self.minimum, self.maximum = minimum, maximum
        self.tolerance_s = tolerance_s
        self.verdicts = deque(maxlen=window)  # "waited", "overdue", "surplus" or "ok", since Delta last changed
        self.surpluses = deque(maxlen=window)  # groups done beyond B at each of those steps' start

    def record_generation(self, wait_s: float, done_at_start: int, overdue_wait_s: float = 0.0) -> int:
        """Record a step's wait for its B-th group, its wait past it for the groups it had to train (the lag bound's
        deadlines), and the groups done when it started; return Delta for the next."""
        waited = done_at_start < self.batch and wait_s > self.tolerance_s
        if waited and overdue_wait_s <= self.tolerance_s:
            self.verdicts.append("waited")
        elif done_at_start >= self.batch + self.dec:
            # A surplus even where the step then waited for due groups: those are carried ones, and fewer groups
            # in flight carry fewer to their deadline, so the surplus, not ``dec``, is what Delta can lose.
            self.verdicts.append("surplus")
        elif overdue_wait_s > self.tolerance_s and not waited:
            self.verdicts.append("overdue")
        else:
            self.verdicts.append("ok")
        self.surpluses.append(done_at_start - self.batch)
        if not self.auto or len(self.verdicts) < self.verdicts.maxlen:
            return self.delta
        before = self.delta
        if self.verdicts.count("waited") * 2 > len(self.verdicts):
            self.delta = min(self.maximum, self.delta + self.inc)
        elif self.verdicts.count("overdue") * 2 > len(self.verdicts):
            self.delta = max(self.minimum, self.delta - self.dec)
        elif self.verdicts.count("surplus") == len(self.verdicts):
            self.delta = max(self.minimum, self.delta - min(self.surpluses))
        if self.delta != before:
            self.verdicts.clear()  # judge the new Delta on steps that ran with it
            self.surpluses.clear()
        return self.delta

    def update(self, mean_reward: float) -> int:
        return self.delta  # the reward-slope rule's input

    def state_dict(self) -> dict:
        return dict(delta=self.delta, verdicts=list(self.verdicts), surpluses=list(self.surpluses))

    def load_state_dict(self, state: dict) -> None:
        self.delta = state["delta"]
        self.verdicts.clear()
        self.verdicts.extend(state.get("verdicts", []))
        self.surpluses.clear()
        # A checkpoint from before surpluses were saved: ``dec`` is the least a surplus verdict stands for.
        self.surpluses.extend(state.get("surpluses", [self.dec] * len(self.verdicts)))
