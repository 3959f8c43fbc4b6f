"""Choosing the chunk size (``--oppo.chunk_size auto``).

The smaller the chunk, the less is left to score after a sequence's last token; but every prefill call
costs a fixed overhead (a Ray call, a padded batch, kernel launches), and the calls come faster as
chunks shrink. A scoring device that falls behind the decoder hides nothing.

Each step we measure, per scoring actor, the time of every prefill call and fit
``seconds = a * calls + b * tokens``, and the rates at which tokens and calls arrived during the
generation phase. At chunk size ``C`` the calls come ``C0 / C`` times as often as they did at the
current ``C0`` while the token rate stays the same, so the actor is busy a fraction

    u(C) = a * calls_per_s * C0 / C + b * tokens_per_s

of the time. We move one candidate per step towards the smallest with ``u(C) <= target`` for every
actor. Actors that share a GPU each see the others' kernels in their own times, so each one's busy
fraction already says whether it keeps up (summing them would count the sharing twice). The paper instead
tries a few sizes every 50 steps and keeps the fastest; this reaches the same choice from one step's
measurements, without spending steps on bad candidates, and follows the response lengths as they drift.
"""

from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)


class ChunkSizeController:
    def __init__(self, fixed: Optional[int] = None, initial: int = 64, target_utilization: float = 0.5):
        self.fixed = fixed
        self.chunk_size = fixed or initial
        self.target_utilization = target_utilization
        self.utilization: Dict[str, float] = {}  # per scoring actor, at the chosen size: for the log

    def update(self, calls_by_scorer: Dict[str, List[Tuple[int, int, float]]], generation_seconds: float) -> int:
        """Take one step's prefill calls ``(new tokens, forwards, seconds)`` per scoring actor; return the next size."""
        if self.fixed or generation_seconds <= 0:
            return self.chunk_size
        models = {}
        for scorer, calls in calls_by_scorer.items():
            fit = _fit_cost(calls)
            if fit is None:
                continue
            a, b = fit
            calls_per_s = len(calls) / generation_seconds
            tokens_per_s = sum(tokens for tokens, _, _ in calls) / generation_seconds
            models[scorer] = (a * calls_per_s * self.chunk_size, b * tokens_per_s)
        if not models:
            return self.chunk_size

        def fits(size: int) -> bool:
            return all(
                per_call / size + per_token <= self.target_utilization for per_call, per_token in models.values()
            )

        target = next((size for size in CANDIDATES if fits(size)), CANDIDATES[-1])
        # One candidate per step: a step's measurements are noisy, and the next step re-measures.
        here = CANDIDATES.index(self.chunk_size) if self.chunk_size in CANDIDATES else CANDIDATES.index(target)
        chosen = CANDIDATES[min(max(CANDIDATES.index(target), here - 1), here + 1)]
        self.utilization = {d: per_call / chosen + per_token for d, (per_call, per_token) in models.items()}
        self.chunk_size = chosen
        return chosen


def _fit_cost(calls: Iterable[Tuple[int, int, float]]) -> Optional[Tuple[float, float]]:
    """Least-squares ``seconds = a + b * tokens`` per call, both terms kept non-negative."""
    calls = [c for c in calls if c[0] > 0]
    if len(calls) < 4:
        return None
    tokens = np.array([c[0] for c in calls], dtype=float)
    seconds = np.array([c[2] for c in calls], dtype=float)
    if np.ptp(tokens) == 0:
        # One size of call only: cannot separate the two terms, charge it all as overhead.
        return float(seconds.mean()), 0.0
    design = np.stack([np.ones_like(tokens), tokens], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if a < 0:
        a, b = 0.0, float(seconds.sum() / tokens.sum())
    if b < 0:
        a, b = float(seconds.mean()), 0.0
    return float(a), float(b)
