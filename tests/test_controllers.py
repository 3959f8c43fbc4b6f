"""The two controllers: Delta (overcommit) and the chunk size, on scripted inputs and on recorded GPU steps.

The recorded steps (``tests/data/chunk_traces/*.json``) are the prefill calls of one step of a GPU run,
taken from recorded Chrome traces (``TRACES``) by ``extract_trace``; to write them again:
``PYTHONPATH=. python tests/test_controllers.py``.
"""

import gzip
import json
import random
import re
from pathlib import Path

import pytest

from openrlhf_oppo.overcommit.controller import OvercommitController, ThroughputController
from openrlhf_oppo.streaming.chunking import CANDIDATES, ChunkSizeController, busiest, load

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "chunk_traces"

# fixture name: (the recorded trace, the step's oppo/chunk_size as its run logged it); the 1-GPU smoke run's trace
# is kept beside the fixtures (its run is not a benchmark result).
TRACES = {
    # 2x H200, vLLM apart, the four scorers on the training GPU; intra-step only (that run's step 3).
    "intra-2gpu-split-c128": (
        "docs/results/split-2gpu-1.5b-lognormal-patched-sync-vs-intra/trace-oppo-intra-step3.json",
        128,
    ),
    # The same placement with both halves, Delta 16 (results.json, oppo-both step 3).
    "both-2gpu-split-c16": (
        "docs/results/split-2gpu-1.5b-lognormal-unpatched-unseeded-order/trace-oppo-both-step3.json",
        16,
    ),
    # 1x H200, vLLM and three scorers on one GPU, Delta 4 (oppo-on.log, step 2).
    "both-1gpu-colocated-c128": ("tests/data/chunk_traces/raw/smoke-1gpu-colocated-step2.json", 128),
}


# -- Delta: the paper's reward-slope rule ------------------------------------------------------------


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


# -- Delta: the throughput rule ---------------------------------------------------------------------


class Rollouts:
    """Steps of inter-step overlap: of the groups in flight through training a fraction ``p_done`` is done
    when the next step starts (drawn per group unless ``exact``); the rest finish one every ``s_per_group``
    seconds into the step."""

    def __init__(self, batch, p_done, s_per_group=0.3, top_up_at_step_end=True, exact=False, seed=0):
        self.batch, self.p_done, self.s_per_group = batch, p_done, s_per_group
        self.top_up_at_step_end, self.exact = top_up_at_step_end, exact
        self.random = random.Random(seed)

    def step(self, delta):
        """(seconds the step waited for its B-th group, groups done when it started) with ``delta``."""
        # With the top-up at the step's end B + Delta groups decode through training, else only the Delta carried.
        in_flight = self.batch + delta if self.top_up_at_step_end else delta
        if self.exact:
            done = int(self.p_done * in_flight)
        else:
            done = sum(self.random.random() < self.p_done for _ in range(in_flight))
        wait = 0.01 if done >= self.batch else (self.batch - done) * self.s_per_group
        return wait, done


def drive(controller, rollouts, steps):
    """Delta after each of ``steps`` steps, and whether each step waited for its B-th group."""
    deltas, waited = [], []
    for _ in range(steps):
        wait, done = rollouts.step(controller.delta)
        waited.append(wait > 0.1)
        deltas.append(controller.record_generation(wait, done))
    return deltas, waited


def test_throughput_rule_raises_delta_until_b_groups_are_ready_and_stays():
    # Half of the groups in flight finish during training: B = 32 needs B + Delta >= 64, Delta = 32.
    controller = ThroughputController(initial=4, auto=True, batch=32, window=2, inc=2, maximum=48)
    deltas, waited = drive(controller, Rollouts(batch=32, p_done=0.5, exact=True), 60)
    assert deltas == sorted(deltas) and deltas[-1] == 32  # up, never back, and no further than needed
    assert deltas.index(32) == 27 and not any(waited[29:])  # 14 raises, two steps apart


def test_throughput_rule_settles_in_a_narrow_band_on_noisy_steps():
    # 60% drawn per group: the groups done at a step's start vary by about +-4 around the mean.
    controller = ThroughputController(initial=4, auto=True, batch=32, window=3, inc=2, maximum=48)
    deltas, waited = drive(controller, Rollouts(batch=32, p_done=0.6, seed=1), 120)
    settled = deltas[60:]
    assert 22 <= min(settled) and max(settled) - min(settled) <= 6  # B + 22 groups in flight make B on average
    assert sum(waited[60:]) <= 0.3 * len(settled)  # most steps find their B groups ready


def test_throughput_rule_lowers_a_delta_that_only_adds_lag():
    # Nearly everything finishes during training: a large Delta leaves groups waiting a step longer.
    controller = ThroughputController(initial=16, auto=True, batch=32, window=3, maximum=16)
    deltas, waited = drive(controller, Rollouts(batch=32, p_done=0.95, seed=2), 80)
    # Down by the window's smallest surplus (11 groups) at once, not by one group a window, and it stays small.
    assert deltas[:3] == [16, 16, 5] and max(deltas[40:]) <= 4
    assert sum(waited) <= 20  # B groups were still ready at most steps' start


def test_throughput_rule_stays_within_its_bounds():
    # Carried groups alone can never make B (top-up at the step's start): Delta climbs to the maximum and stays.
    rollouts = Rollouts(batch=32, p_done=0.5, top_up_at_step_end=False, seed=3)
    controller = ThroughputController(initial=2, auto=True, batch=32, window=2, maximum=8)
    assert drive(controller, rollouts, 30)[0][-14:] == [8] * 14
    # Everything done at the start, always: down to the minimum in one window and no further.
    controller = ThroughputController(initial=6, auto=True, batch=4, window=2, minimum=3, maximum=8)
    assert [controller.record_generation(0.01, 12) for _ in range(6)] == [6, 3, 3, 3, 3, 3]
    # A surplus of ``dec`` groups, the least that counts, shrinks by ``dec``.
    controller = ThroughputController(initial=6, auto=True, batch=4, window=2, dec=2, maximum=8)
    assert [controller.record_generation(0.01, 6) for _ in range(4)] == [6, 4, 4, 2]


LONG_TAIL_RUN = ROOT / "docs/results/learning-1gpu-small-addition-digits-sigma1.6-three-seeds-100-steps"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_throughput_rule_counts_a_surplus_that_waited_for_due_groups(seed):
    # A recorded learning run with a long tail, Delta starting at B = 32 (window 3, dec 4): all 64 groups were
    # done at every step's start after the first, and some steps then waited a little for carried groups the lag
    # bound made due. Those steps had a surplus of 32 all the same: Delta comes down to 0 after the first
    # window of them, where the run (which judged such steps by their wait) came down by 4 at a time until
    # step 9 or 20.
    with gzip.open(LONG_TAIL_RUN / f"results-oppo-seed{seed}.json.gz") as f:
        (run,) = json.load(f)["systems"].values()
    steps = run["steps"][:4]  # the steps before Delta first changed in that run
    assert [step["oppo/overcommit"] for step in steps] == [32] * 4
    controller = ThroughputController(initial=32, auto=True, batch=32, window=3, dec=4, maximum=32)
    deltas = [
        controller.record_generation(
            step["oppo/bth_group_done_s"], step["oppo/groups_done_at_start"], step["oppo/overdue_wait_s"]
        )
        for step in steps
    ]
    assert deltas == [32, 32, 32, 0]
    assert any(step["oppo/overdue_wait_s"] > controller.tolerance_s for step in steps[1:])  # waited for due groups


def test_throughput_rule_shrinks_by_dec_for_due_groups_without_a_surplus():
    controller = ThroughputController(initial=32, auto=True, batch=32, window=3, dec=4, maximum=32)
    assert [controller.record_generation(0.05, 32, 0.3) for _ in range(4)] == [32, 32, 28, 28]


def test_throughput_rule_ignores_short_waits_and_rewards():
    controller = ThroughputController(initial=4, auto=True, batch=8, window=2, maximum=8, tolerance_s=0.1)
    assert [controller.record_generation(0.05, 7) for _ in range(6)] == [4] * 6  # within the tolerance
    assert [controller.update(reward) for reward in (0.0, 1.0, 2.0, 3.0)] == [4] * 4
    assert [controller.record_generation(0.5, 7), controller.record_generation(0.5, 7)] == [4, 5]


def test_throughput_rule_fixed_delta_and_state():
    fixed = ThroughputController(initial=3, auto=False, batch=8, window=2, maximum=8)
    assert [fixed.record_generation(5.0, 0) for _ in range(5)] == [3] * 5
    auto = ThroughputController(initial=3, auto=True, batch=8, window=3, maximum=8)
    auto.record_generation(5.0, 0)
    auto.record_generation(5.0, 0)
    restored = ThroughputController(initial=0, auto=True, batch=8, window=3, maximum=8)
    restored.load_state_dict(auto.state_dict())
    assert restored.record_generation(5.0, 0) == auto.record_generation(5.0, 0) == 4
    # The surpluses a restored rule judges by are the saved ones: 9 groups above B, then 5.
    surplus = ThroughputController(initial=16, auto=True, batch=8, window=3, maximum=16)
    surplus.record_generation(0.0, 17)
    surplus.record_generation(0.0, 13)
    restored.load_state_dict(surplus.state_dict())
    assert restored.record_generation(0.0, 24) == surplus.record_generation(0.0, 24) == 11
    # A checkpoint from before surpluses were saved: its surplus verdicts stand for ``dec`` groups each.
    restored = ThroughputController(initial=0, auto=True, batch=8, window=3, dec=2, maximum=16)
    restored.load_state_dict(dict(delta=16, verdicts=["surplus", "surplus"]))
    assert restored.record_generation(0.0, 24) == 14
    assert OvercommitController(initial=3, auto=True).record_generation(5.0, 0) == 3  # not the slope rule's input


def test_overcommit_rule_option():
    from openrlhf_oppo.cli.train_ppo_ray import parse_args
    from openrlhf_oppo.config import OPPOConfigError
    from openrlhf_oppo.plan import resolve

    base = ["--actor.model_name_or_path", "m", "--reward.model_name_or_path", "m", "--vllm.num_engines", "1"]
    assert resolve(parse_args(base + ["--oppo.enable"])).carry.overcommit.rule == "throughput"
    rule = ["--oppo.overcommit_rule", "reward_slope"]
    assert resolve(parse_args(base + ["--oppo.enable"] + rule)).carry.overcommit.rule == "reward_slope"
    with pytest.raises(OPPOConfigError, match="--oppo.overcommit 8 fixes it"):
        parse_args(base + ["--oppo.enable", "--oppo.overcommit", "8"] + rule)
    with pytest.raises(SystemExit):
        parse_args(base + ["--oppo.enable", "--oppo.overcommit_rule", "fastest"])


# -- chunk size: scripted steps ---------------------------------------------------------------------


def streamed_step(chunk_size, overhead, per_token, tokens_per_s, seconds=10.0):
    """A step's prefill calls ``(start, seconds, tokens)`` as a scoring actor sees them at ``chunk_size``: chunk
    events come evenly as ``tokens_per_s`` are decoded, carrying 1, 2, 3, 2 chunks in turn; a call costs
    ``overhead + per_token * tokens`` and starts when its chunks come or when the previous call ends."""
    events = round(tokens_per_s * seconds / (2 * chunk_size))
    calls, free_at = [], 0.0
    for i in range(events):
        tokens = chunk_size * (1, 2, 3, 2)[i % 4]
        start = max(i * seconds / events, free_at)
        calls.append((start, overhead + per_token * tokens, tokens))
        free_at = start + calls[-1][1]
    return calls


def closed_loop(controller, steps, **scorers):
    """Run ``steps`` steps, each measured at the chunk size the controller chose before it."""
    sizes = []
    for _ in range(steps):
        sizes.append(
            controller.update({name: streamed_step(controller.chunk_size, **s) for name, s in scorers.items()})
        )
    return sizes


def busy_fraction(size, overhead, per_token, tokens_per_s):
    """What a step at ``size`` keeps a scorer busy, from the scripted costs (not from the controller)."""
    return overhead * tokens_per_s / (2 * size) + per_token * tokens_per_s


def test_chunk_size_settles_on_the_smallest_that_keeps_the_scorer_under_target():
    gpu = dict(overhead=0.02, per_token=1e-5, tokens_per_s=2000)  # 20 ms a call, 10 us a token
    smallest = min(c for c in CANDIDATES if busy_fraction(c, **gpu) <= 0.5)
    assert smallest == 64  # 0.02 * 2000 / 128 + 0.02 = 0.33; at 32 it would be 0.645
    assert closed_loop(ChunkSizeController(initial=512), 8, gpu=gpu) == [256, 128, 64, 64, 64, 64, 64, 64]
    assert closed_loop(ChunkSizeController(initial=16), 8, gpu=gpu) == [32, 64, 64, 64, 64, 64, 64, 64]


def test_chunk_size_follows_the_busiest_scorer():
    light = dict(overhead=0.002, per_token=1e-6, tokens_per_s=2000)
    heavy = dict(overhead=0.05, per_token=1e-6, tokens_per_s=2000)
    smallest = min(c for c in CANDIDATES if busy_fraction(c, **heavy) <= 0.5)
    sizes = closed_loop(ChunkSizeController(initial=64), 6, light=light, heavy=heavy)
    assert sizes[-1] == smallest == 128


def test_chunk_size_grows_one_candidate_a_step_while_calls_saturate_the_scorer():
    # 40 ms a call, chunk events every 16 ms at 16: calls back to back; the tokens take only 5% of the time.
    gpu = dict(overhead=0.04, per_token=2.5e-5, tokens_per_s=2000)
    sizes = closed_loop(ChunkSizeController(initial=16), 8, gpu=gpu)
    assert sizes == [32, 64, 128, 128, 128, 128, 128, 128]
    assert busy_fraction(128, **gpu) <= 0.5 < busy_fraction(64, **gpu)


def test_chunk_size_stays_when_tokens_alone_keep_the_scorer_over_target():
    # 0.3 ms a token at 2000 tokens/s: the tokens alone keep the scorer 60% busy at any chunk size.
    controller = ChunkSizeController(initial=128)
    gpu = dict(overhead=0.01, per_token=3e-4, tokens_per_s=2000)
    assert closed_loop(controller, 6, gpu=gpu) == [128] * 6
    assert controller.target is None and controller.utilization["gpu"] > 0.6


def test_utilization_is_busy_time_over_the_window_the_calls_cover():
    # Four 0.1 s calls between 5 s and 6 s of a long step: 40% busy, however long the step around them.
    calls = [(5.0, 0.1, 100), (5.3, 0.1, 200), (5.6, 0.1, 300), (5.9, 0.1, 200)]
    controller = ChunkSizeController(initial=64)
    controller.update({"gpu": calls})
    assert controller.utilization["gpu"] == pytest.approx(0.4)
    assert sum(load(calls)) == pytest.approx(0.4)


def test_fixed_chunk_size_and_too_few_calls_change_nothing():
    fixed = ChunkSizeController(fixed=48)
    assert fixed.update({"gpu": streamed_step(48, 0.05, 1e-3, 2000)}) == 48
    auto = ChunkSizeController(initial=128)
    assert auto.update({"gpu": streamed_step(128, 0.05, 1e-3, 2000)[:3]}) == 128
    assert auto.update({}) == 128


# -- chunk size: recorded GPU steps -----------------------------------------------------------------


def extract_trace(path, chunk_size):
    """One traced step as a fixture: its phases and each scorer's prefill calls ``[start, seconds, chunks]``,
    in seconds from the start of the step's generation phase."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    t0 = next(e["ts"] for e in events if e["name"] == "generation")
    phases = {
        e["name"]: [round((e["ts"] - t0) / 1e6, 6), round((e["ts"] + e["dur"] - t0) / 1e6, 6)]
        for e in events
        if e.get("tid") == "trainer"
    }
    calls = {}
    for e in sorted((e for e in events if e["name"] == "prefill"), key=lambda e: e["ts"]):
        scorer = e["pid"].replace(" scorer", "")  # "critic 4929": the model's kind and the actor's pid
        calls.setdefault(scorer, []).append(
            [round((e["ts"] - t0) / 1e6, 6), round(e["dur"] / 1e6, 6), e["args"]["chunks"]]
        )
    return dict(trace=str(Path(path).relative_to(ROOT)), chunk_size=chunk_size, phases=phases, calls=calls)


def recorded(name, per_call_s=0.0, per_chunk_s=0.0):
    """A fixture's calls as the controller takes them: ``(start, seconds, tokens)`` per scorer.

    Tokens are the chunks times the chunk size (a last chunk is shorter, but a common scale does not
    change the split into per-call and per-token time). ``per_call_s`` and ``per_chunk_s`` make every
    call or every chunk that much costlier, each call starting no earlier than the previous one ends.
    """
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    size = fixture["chunk_size"]
    calls = {}
    for scorer, recorded_calls in fixture["calls"].items():
        free_at, calls[scorer] = float("-inf"), []
        for start, seconds, chunks in recorded_calls:
            start, seconds = max(start, free_at), seconds + per_call_s + per_chunk_s * chunks
            calls[scorer].append((start, seconds, chunks * size))
            free_at = start + seconds
    return fixture, calls


@pytest.mark.parametrize("name", TRACES)
def test_fixtures_are_the_recorded_traces(name):
    path, chunk_size = TRACES[name]
    assert json.loads((FIXTURES / f"{name}.json").read_text()) == extract_trace(ROOT / path, chunk_size)


@pytest.mark.parametrize("name", TRACES)
def test_recorded_gpu_steps_keep_a_small_chunk(name):
    fixture, calls = recorded(name)
    controller = ChunkSizeController(initial=fixture["chunk_size"])
    controller.update(calls)
    # Every call ran between the step's start and the end of its make_experience (held through training).
    generation, make_experience = fixture["phases"]["generation"], fixture["phases"]["make_experience"]
    for scorer_calls in calls.values():
        assert generation[0] <= scorer_calls[0][0] and scorer_calls[-1][0] + scorer_calls[-1][1] <= make_experience[1]
    # The GPU kept up (busy 16-46% of the window), so the size stays where it was, far from the largest.
    assert all(0.15 < u < 0.5 for u in controller.utilization.values())
    assert controller.target is not None and controller.target <= fixture["chunk_size"]
    assert controller.chunk_size <= fixture["chunk_size"] < CANDIDATES[-1]


@pytest.mark.parametrize("name", ["intra-2gpu-split-c128", "both-1gpu-colocated-c128"])
def test_recorded_gpu_steps_whose_calls_cost_more_grow_the_chunk(name):
    # Every call 40 ms dearer (more models on the GPU, a slower launch path): calls saturate the scorers.
    fixture, calls = recorded(name, per_call_s=0.04)
    controller = ChunkSizeController(initial=fixture["chunk_size"])
    assert controller.update(calls) == 2 * fixture["chunk_size"]  # one candidate a step
    size, loads = fixture["chunk_size"], {scorer: load(c) for scorer, c in calls.items()}
    assert busiest(loads, size, controller.target // 2) > 0.5 >= busiest(loads, size, controller.target)
    assert max(controller.utilization.values()) > 0.7 and controller.target < CANDIDATES[-1]


@pytest.mark.parametrize(
    "name, per_chunk_s",
    [("intra-2gpu-split-c128", 0.02), ("both-2gpu-split-c16", 0.05), ("both-1gpu-colocated-c128", 0.02)],
)
def test_recorded_gpu_steps_whose_chunks_cost_more_keep_the_chunk(name, per_chunk_s):
    # Every chunk 20-50 ms dearer (as when carried sequences are prefilled again under new weights): the
    # tokens alone keep a scorer over the target, at the largest candidate too, where the rule used to go.
    fixture, calls = recorded(name, per_chunk_s=per_chunk_s)
    controller = ChunkSizeController(initial=fixture["chunk_size"])
    assert controller.update(calls) == fixture["chunk_size"] and controller.target is None
    loads = {scorer: load(c) for scorer, c in calls.items()}
    assert busiest(loads, fixture["chunk_size"], CANDIDATES[-1]) > 0.5


def write_fixtures():
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, (path, chunk_size) in TRACES.items():
        text = json.dumps(extract_trace(ROOT / path, chunk_size), indent=1)
        text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
        (FIXTURES / f"{name}.json").write_text(text + "\n")


if __name__ == "__main__":
    write_fixtures()
