"""The learning benchmark end to end on CPU, scaled down: the supervised warm-up of a tiny model, then PPO steps
with the addition task's rule reward for upstream sync and OPPO (a real vLLM engine, OpenRLHF's trainer loop),
results.json, and the table and plots made from it.

It makes no claim about learning: on CPU the training step is a stand-in that leaves the weights as they are
(``testing/cpu_pipeline.py``), and a tiny model learns little in a few hundred supervised steps.
"""

import json

import pytest
import torch

from openrlhf_oppo import lengths
from openrlhf_oppo.bench import addition, learning, learning_report, warmup
from openrlhf_oppo.bench.__main__ import header
from openrlhf_oppo.testing.cpu_bench import CPURunner

pytestmark = pytest.mark.engine

BATCH, N_SAMPLES, STEPS = 4, 2, 2
WORKLOAD = ("prompts.jsonl", "heldout.jsonl")
WARMUP = dict(batch=64, lr=3e-3, eval_every=50, heldout=64, dtype="float32")


def test_learning_benchmark_end_to_end(ray_session, tmp_path):
    out = tmp_path / "out"
    args = learning.parse(
        [
            "--task", "addition", "--systems", "upstream-sync,oppo-both", "--seeds", "0",
            "--gpus", "2", "--placement", "split", "--shape", "tiny",
            "--batch", str(BATCH), "--n_samples", str(N_SAMPLES), "--steps", str(STEPS), "--overcommit", "1",
            "--warmup_target", "0.2", "--warmup_max_steps", "600", "--digits_mean", "1.5", "--digits_high", "2",
            "--target", "0.05", "--eval_every", "4", "--credit", "steps", "--out", str(out),
            "--oppo_extra=--oppo.stream_interval", "--oppo_extra=2", "--oppo_tag=-interval2",
        ]
    )  # fmt: skip
    runner, threads = CPURunner(), torch.get_num_threads()
    torch.set_num_threads(1)  # the warm-up's small matrices: faster on one thread beside Ray and vLLM
    try:
        results = learning.run(args, runner, header(), warmup_options=WARMUP)
    finally:
        torch.set_num_threads(threads)
        runner.close()

    # The warm-up reached a measurable accuracy on held-out sums, and a second run reuses its checkpoint.
    warm = results["task"]["warmup"]
    assert warm["reached_target"] and warm["accuracy"] > 0, warm["history"]
    again = warmup.warm_up(
        str(out / "workload"), "tiny", 0.2, 0, dict(mean=1.5, high=2), max_steps=600, samples=N_SAMPLES, **WARMUP
    )  # fmt: skip
    assert again == warm

    # --oppo_extra reached the OPPO system alone, whose name and system carry --oppo_tag.
    assert sorted(results["systems"]) == ["oppo-both-interval2-seed0", "upstream-sync-seed0"]
    assert results["systems"]["oppo-both-interval2-seed0"]["system"] == "oppo-both-interval2"
    flags = {name: " ".join(result["flags"]) for name, result in results["systems"].items()}
    assert "--oppo.stream_interval 2" in flags["oppo-both-interval2-seed0"]
    assert "--oppo.stream_interval" not in flags["upstream-sync-seed0"]

    # Every prompt of the run's dataset was trained once, scored by the rule reward (there is no reward model).
    for name in ("upstream-sync-seed0", "oppo-both-interval2-seed0"):
        steps = results["systems"][name]["steps"]
        assert len(steps) == STEPS + 2
        assert sum(s["rollout/num_samples"] for s in steps) == (STEPS + 2) * BATCH * N_SAMPLES
        assert all(0 <= s["rollout/reward_mean"] <= 1 for s in steps)
        # The reward's extra logs reach the step's log through the policy's training status, as on GPU: the
        # table's accuracy is the share of right answers, not the steps credit's mean reward.
        assert all(0 <= s["accuracy"] <= 1 and 0 <= s["first_token_end"] <= 1 for s in steps)
        # So does the accuracy by digits: every sum of this run has 1 or 2 digits, in the first band.
        assert all(s["share_digits_1_3"] == 1 and s["share_digits_4_6"] == 0 for s in steps)
        first_band = learning_report.band_accuracy(steps, addition.DIGIT_BANDS[0])
        assert first_band == pytest.approx(learning_report.accuracy(steps))
        # The trained responses by length, in both systems (OPPO's trainer and upstream's as the CLI runs it): the
        # buckets' shares cover every trained response, their rewards make up the step's mean reward, and the
        # buckets with responses hold the mean length.
        for s in steps:
            shares = {b: s[lengths.key("share", *b)] for b in lengths.buckets()}
            assert sum(shares.values()) == pytest.approx(1)
            rewards = {b: s[lengths.key("reward", *b)] for b in lengths.buckets() if shares[b]}
            assert sum(shares[b] * r for b, r in rewards.items()) == pytest.approx(s["rollout/reward_mean"], abs=1e-5)
            lowest, highest = min(rewards), max(rewards)
            assert lowest[0] <= s["rollout/response_length_mean"] < (highest[1] or float("inf"))
    # The training prompts give credit for each step of the chain (--credit steps), the held-out ones for the
    # answer alone, since OpenRLHF's pass@1 on them is their mean reward.
    labels = {name: [json.loads(line)["answer"] for line in open(out / "workload" / name)] for name in WORKLOAD}
    assert all(label.startswith("steps:") for label in labels["prompts.jsonl"])
    assert all(label.isdigit() for label in labels["heldout.jsonl"])
    # Some sampled responses of the warmed-up model are right and scored so (the rule reads the end of text that
    # vLLM's response ends with); with the engine's seed the same ones every time.
    assert max(s["rollout/reward_mean"] for r in results["systems"].values() for s in r["steps"]) > 0
    # Both were evaluated after their last step on the warm-up's held-out sums (the first 16 of its 64: OpenRLHF's
    # --data.max_samples caps the eval set too), greedy, one response each: with the weights as the warm-up left
    # them (the CPU stand-in trains nothing), the same right answers in both.
    evaluations = []
    for name in ("upstream-sync-seed0", "oppo-both-interval2-seed0"):
        steps = results["systems"][name]["steps"]
        assert [s["step"] for s in steps if learning_report.HELDOUT in s] == [STEPS + 2]
        assert steps[-1]["eval/eval_num_samples"] == (STEPS + 2) * BATCH
        evaluations.append(steps[-1][learning_report.HELDOUT])
    assert evaluations[0] == evaluations[1] > 0
    oppo = results["systems"]["oppo-both-interval2-seed0"]["steps"]
    # The policy and reference streamed: a micro-batch fell back to the model's forward only for a response cut at
    # the length limit (vLLM cannot score a sequence that fills its max_model_len; test_streaming_pipeline.py). The
    # warm-up's model differs from run to run, and so do its responses: some runs cut one.
    for s in oppo:
        assert s["oppo/fallback_micro_batches"] <= s["rollout/truncated_rate"] * s["rollout/num_samples"], s
    assert max(s["oppo/carried_groups"] for s in oppo) <= 1

    # The report comes from the raw JSON alone.
    raw = json.loads((out / "results.json").read_text())
    assert str(tmp_path) not in json.dumps(raw) and raw["settings"]["out"] == "OUT"  # no folder of this machine
    assert (out / "table.md").read_text() == learning_report.table(raw)
    for plot in ("accuracy-by-step.png", "accuracy-by-time.png", "signals-by-step.png", "breakdown.png"):
        assert (out / plot).stat().st_size > 0
    assert f"Held-out accuracy (greedy, the same {(STEPS + 2) * BATCH} sums" in (out / "table.md").read_text()
    rows = [line for line in (out / "table.md").read_text().splitlines() if line.startswith("| upstream-sync")]
    assert rows and rows[0].split("|")[2].strip() == "1"  # one seed
