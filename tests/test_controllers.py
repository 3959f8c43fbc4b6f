"""The two controllers: Delta (overcommit) on scripted rewards, chunk size on scripted costs."""

import pytest

from openrlhf_oppo.overcommit.controller import OvercommitController
from openrlhf_oppo.streaming.chunking import CANDIDATES, ChunkSizeController


def run(controller, rewards):
    return [controller.update(r) for r in rewards]


def test_delta_holds_until_the_window_is_full():
    controller = OvercommitController(initial=3, auto=True, window=4, minimum=0, maximum=8)
    assert run(controller, [0.1, 0.2, 0.3, 0.4]) == [3, 3, 3, 3]
    assert controller.update(0.5) == 4  # five rewards: four differences, slope > 0


def test_delta_rises_with_the_reward_and_stops_at_the_maximum():
    controller = OvercommitController(initial=1, auto=True, window=2, inc=2, maximum=6)
    assert run(controller, [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]) == [1, 1, 3, 5, 6, 6]


def test_delta_falls_on_a_flat_or_falling_reward_and_stops_at_the_minimum():
    controller = OvercommitController(initial=4, auto=True, window=2, dec=1, minimum=2, maximum=8)
    assert run(controller, [1.0, 1.0, 1.0, 0.9, 0.8, 0.7]) == [4, 4, 3, 2, 2, 2]


def test_slope_is_the_mean_change_over_the_window():
    controller = OvercommitController(initial=2, auto=True, window=3, maximum=9)
    # Noisy but rising: 0.0 -> 0.3 over 3 steps is a positive slope even though one step fell.
    assert run(controller, [0.0, 0.5, 0.2, 0.3]) == [2, 2, 2, 3]
    assert controller.slope() == pytest.approx(0.1)


def test_fixed_delta_never_moves_and_state_round_trips():
    controller = OvercommitController(initial=5, auto=False, window=2)
    assert run(controller, [0.0, 1.0, 2.0, 0.0]) == [5, 5, 5, 5]
    auto = OvercommitController(initial=2, auto=True, window=2, maximum=9)
    run(auto, [0.0, 0.5, 1.0])
    restored = OvercommitController(initial=0, auto=True, window=2, maximum=9)
    restored.load_state_dict(auto.state_dict())
    assert restored.update(1.5) == auto.update(1.5)


def calls(overhead, per_token, tokens):
    return [(t, 1, overhead + per_token * t) for t in tokens]


def test_chunk_size_is_the_smallest_that_keeps_the_scorer_under_target():
    controller = ChunkSizeController(initial=64, target_utilization=0.5)
    # 20 ms a call + 10 us a token; at C=64 the calls came at 10/s.
    step = calls(0.02, 1e-5, [300, 500, 700, 400] * 25)  # 100 calls, 47.5k tokens in 10 s
    chosen = controller.update({"gpu0": step}, generation_seconds=10.0)
    # u(C) = 0.02 * 10 * 64 / C + 1e-5 * 4750 = 12.8 / C + 0.0475 <= 0.5  =>  C >= 28.3
    assert chosen == 32
    assert controller.utilization["gpu0"] == pytest.approx(12.8 / 32 + 0.0475, rel=1e-6)


def test_chunk_size_takes_the_busiest_scorer():
    controller = ChunkSizeController(initial=64, target_utilization=0.5)
    light = calls(0.001, 1e-6, [100, 200, 300, 400] * 5)
    heavy = calls(0.05, 1e-6, [100, 200, 300, 400] * 25)
    chosen = controller.update({"a": light, "b": heavy}, generation_seconds=10.0)
    assert chosen == min(c for c in CANDIDATES if 0.05 * 10 * 64 / c + 1e-6 * 25000 / 10 <= 0.5)


def test_chunk_size_climbs_one_candidate_a_step_to_the_largest_when_prefill_cannot_keep_up():
    controller = ChunkSizeController(initial=64)
    step = calls(0.01, 1e-3, [100, 200, 300, 400] * 10)  # 1 ms a token at 1000 tokens/s: always busy
    sizes = [controller.update({"gpu": step}, generation_seconds=10.0) for _ in range(len(CANDIDATES))]
    assert sizes[:3] == [128, 256, 512] and sizes[-1] == CANDIDATES[-1]


def test_fixed_chunk_size_and_too_few_calls_change_nothing():
    fixed = ChunkSizeController(fixed=48)
    assert fixed.update({"gpu": calls(0.05, 1e-3, [100, 200] * 10)}, 1.0) == 48
    auto = ChunkSizeController(initial=128)
    assert auto.update({"gpu": calls(0.05, 1e-3, [100, 200])}, 1.0) == 128
