"""Choosing the chunk size (``--oppo.chunk_size auto``).

A smaller chunk leaves less to score after a sequence's last token (its last chunk is what make_experience
waits for), but every prefill call has a fixed cost (a Ray call, a padded batch, kernel launches). A larger
chunk saves that cost only where calls are what keeps a scoring actor busy; its larger last chunk is always paid.

Each step every scoring actor reports its prefill calls ``(start, seconds, new tokens)``. Its utilization ``u``
is its busy time over the window its calls cover (not the generation phase, which the calls outlast through
make_experience's flush). A least-squares fit ``seconds = a + b * tokens`` splits ``u`` into a per-call part
``p`` and a per-token part ``q``; at chunk size ``C`` calls come ``C0 / C`` times as often as at the current
``C0``:

    u(C) = p * C0 / C + q

We move one candidate per step towards the smallest ``C`` with ``u(C) <= target`` for every actor. If there is
none, the actor's tokens alone keep it busy, a busy actor coalesces queued chunks anyway, and a larger chunk
would only grow the last one: the size stays. Actors on one GPU are called together and each one's call times
include the others' kernels, so we take the busiest, not the sum. The paper instead tries a few sizes every 50
steps; this decides from one step's measurements and follows the lengths as they drift.
"""

from typing import Dict, List, Optional, Tuple

import numpy as np

CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)

# A prefill call, as the scoring actor records it: (wall-clock start, seconds, new tokens).
Call = Tuple[float, float, int]


class ChunkSizeController:
    def __init__(self, fixed: Optional[int] = None, initial: int = 64, target_utilization: float = 0.5):
        self.fixed = fixed
        self.chunk_size = fixed or initial
        self.target_utilization = target_utilization
        self.utilization: Dict[str, float] = {}  # per scoring actor, measured in the last step: for the log
        self.target: Optional[int] = None  # the size the last step's measurements ask for; None: keep the size

    def update(self, calls_by_scorer: Dict[str, List[Call]]) -> int:
        """Take one step's prefill calls per scoring actor; return the chunk size for the next step."""
        if self.fixed:
            return self.chunk_size
        loads = {scorer: load(calls) for scorer, calls in calls_by_scorer.items()}
        loads = {scorer: parts for scorer, parts in loads.items() if parts is not None}
        self.utilization = {scorer: per_call + per_token for scorer, (per_call, per_token) in loads.items()}
        self.target = next(
            (
                size
                for size in CANDIDATES
                if loads and busiest(loads, self.chunk_size, size) <= self.target_utilization
            ),
            None,
        )
        if self.target is None:
            return self.chunk_size  # no actor measured, or one's tokens alone keep it over the target
        # One candidate per step: a step's measurements are noisy, and the next step re-measures.
        wanted = CANDIDATES.index(self.target)
        here = CANDIDATES.index(self.chunk_size) if self.chunk_size in CANDIDATES else wanted
        self.chunk_size = CANDIDATES[min(max(wanted, here - 1), here + 1)]
        return self.chunk_size


def busiest(loads: Dict[str, Tuple[float, float]], measured_at: int, size: int) -> float:
    """``max u(C)`` over the actors at chunk ``size``, from their loads measured at chunk ``measured_at``."""
    return max(per_call * measured_at / size + per_token for per_call, per_token in loads.values())


def load(calls: List[Call]) -> Optional[Tuple[float, float]]:
    """An actor's busy fraction over the window its calls cover, split into ``(per-call, per-token)`` parts."""
    if len(calls) < 4:
        return None
    starts = np.array([c[0] for c in calls], dtype=float)
    seconds = np.array([c[1] for c in calls], dtype=float)
    tokens = np.array([c[2] for c in calls], dtype=float)
    window = float((starts + seconds).max() - starts.min())
    if window <= 0:
        return None
    a, b = _fit_cost(tokens, seconds)
    per_call, per_token = a * len(calls), b * tokens.sum()
    utilization = seconds.sum() / window
    call_share = per_call / (per_call + per_token) if per_call + per_token > 0 else 1.0
    return utilization * call_share, utilization * (1.0 - call_share)


def _fit_cost(tokens: np.ndarray, seconds: np.ndarray) -> Tuple[float, float]:
    """Least-squares ``seconds = a + b * tokens`` per call, both terms kept non-negative."""
    if np.ptp(tokens) == 0:
        # One size of call only: cannot separate the two terms, charge it all as overhead.
        return float(seconds.mean()), 0.0
    design = np.stack([np.ones_like(tokens), tokens], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if a < 0:
        a, b = 0.0, float(seconds.sum() / max(tokens.sum(), 1.0))
    if b < 0:
        a, b = float(seconds.mean()), 0.0
    return float(a), float(b)
