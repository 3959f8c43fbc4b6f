"""The learning benchmark's parts: the addition task and its rule reward as OpenRLHF loads it, the warm-up's
cache, and the convergence table and plots on known curves. (End to end on CPU: ``test_learning_cpu.py``.)"""

import json
import os
import random
import statistics

import pytest

from openrlhf_oppo import lengths, tiny
from openrlhf_oppo.bench import addition, learning, learning_report, report, warmup


def test_the_response_is_a_chain_of_carries_then_the_answer():
    assert addition.prompt(5821, 967) == "5821+967="
    assert addition.solution(5821, 967) == "1+7+0=08,2+6+0=08,8+9+0=17,5+0+1=06;6788"
    assert addition.solution(99, 1) == "9+1+0=10,9+0+1=10;100"
    for a, b in addition.problems(200, seed=5):
        assert addition.answer(addition.solution(a, b) + addition.EOS) == str(a + b)


def test_response_lengths_are_long_tailed(tmp_path):
    workload = addition.write_prompts(str(tmp_path / "prompts.jsonl"), 4096, seed=0)
    assert 50 < workload["mean_length"] < 70
    assert workload["max_length"] > 3 * workload["mean_length"]  # a few sums are far longer than most
    first = json.loads((tmp_path / "prompts.jsonl").read_text().splitlines()[0])
    a, b = map(int, first["input"].rstrip("=").split("+"))
    assert first["answer"] == str(a + b)


def test_openrlhf_loads_the_rule_reward_by_path_and_it_scores_the_decoded_responses(tmp_path):
    """``--reward.remote_url .../addition.py``: upstream's executor imports the file and calls ``reward_func`` on
    prompt + response decoded with the special tokens; only a right answer at the end of a finished response
    scores."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer

    tiny.make_tokenizer(str(tmp_path), 2048)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    executor = SingleTurnAgentExecutor([addition.__file__])
    prompt, right = addition.prompt(5821, 967), addition.solution(5821, 967)
    eos = [tokenizer.eos_token_id]
    responses = [
        tokenizer.encode(right) + eos,  # right
        tokenizer.encode(right.replace(";6788", ";6789")) + eos,  # wrong answer
        tokenizer.encode(right),  # cut off before its end (the length limit)
        tokenizer.encode(right.replace("=17", "=16")) + eos,  # a slip in the chain, the answer still right
        tokenizer.encode(right + ",0") + eos,  # not ending with the answer
        eos,  # the end of text at once (sampled with --rollout.min_new_tokens 0)
        tokenizer.encode("7") + eos,  # a stray token, then the end
    ]
    queries = [tokenizer.decode(tokenizer.encode(prompt) + ids, skip_special_tokens=False) for ids in responses]
    out = executor.reward_func(queries, [prompt] * len(queries), ["6788"] * len(queries))
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert out["extra_logs"]["accuracy"].tolist() == out["rewards"].tolist()
    assert out["extra_logs"]["first_token_end"].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]

    # Steps credit: the share of the 4 steps and the answer in their place, for a finished response only. The
    # accuracy logged beside it is still the share of right answers.
    steps = executor.reward_func(queries, [prompt] * len(queries), ["steps:6788"] * len(queries))
    assert steps["rewards"].tolist() == pytest.approx([1.0, 0.8, 0.0, 0.8, 0.8, 0.0, 0.0])
    assert steps["extra_logs"]["accuracy"].tolist() == out["rewards"].tolist()


def test_the_accuracy_is_logged_by_the_longer_numbers_digits():
    # Sums whose longer number has 2, 5, 5 and 9 digits; the first, one of the 5-digit ones and the last right.
    pairs = [(12, 3), (12345, 678), (99999, 1), (123456789, 5)]
    prompts = [addition.prompt(a, b) for a, b in pairs]
    responses = [addition.solution(a, b) + addition.EOS for a, b in pairs]
    responses[2] = responses[2].replace(";100000", ";100001")
    logs = addition.reward_func([p + r for p, r in zip(prompts, responses)], prompts, [str(a + b) for a, b in pairs])
    logs = {key: value.tolist() for key, value in logs["extra_logs"].items()}
    assert logs["share_digits_1_3"] == [1, 0, 0, 0] and logs["right_digits_1_3"] == [1, 0, 0, 0]
    assert logs["share_digits_4_6"] == [0, 1, 1, 0] and logs["right_digits_4_6"] == [0, 1, 0, 0]
    assert logs["share_digits_7_up"] == [0, 0, 0, 1] and logs["right_digits_7_up"] == [0, 0, 0, 1]


def test_the_warm_ups_accuracy_is_told_by_digits():
    pairs = [(1, 2), (34, 5), (123, 4), (1234, 5), (12345678, 9)]
    bands = warmup.accuracy_by_digits(pairs, [True, False, True, False, False])
    assert bands == {"1-3": 2 / 3, "4-6": 0.0, "7+": 0.0}
    assert warmup.accuracy_by_digits(pairs[:2], [True, True]) == {"1-3": 1.0}  # only the bands it has


def test_a_sum_is_learnable_where_one_of_its_samples_is_right():
    pairs = [(1, 2), (34, 5), (1234, 5)]
    sampled = [[True, False, False, False], [False] * 4, [True, True, False, True]]
    summary = warmup.sampled_summary(pairs, sampled)
    assert summary["sampled_accuracy"] == (1 / 4 + 0 + 3 / 4) / 3
    assert summary["pass_at_samples"] == 2 / 3
    assert summary["sampled_accuracy_by_digits"] == {"1-3": 1 / 8, "4-6": 3 / 4}
    assert summary["pass_at_samples_by_digits"] == {"1-3": 1 / 2, "4-6": 1.0}
    warm = dict(steps=100, seconds=60, accuracy=0.3, device="NVIDIA H200", settings=dict(samples=4), **summary)
    results = _results({("upstream-sync", 0): ([0.2, 0.4], 2.0)})  # PPO's groups of 8: the line counts the warm-up's 4
    results["task"]["warmup"] = warm
    text = learning_report.table(results)
    assert "33.3% of the responses are right and 66.7% of the sums have one right in 4 (1-3 50%, 4-6 100%)" in text
    del warm["pass_at_samples"]  # warm-ups from before did not sample: their line says nothing of it
    assert "have one right" not in learning_report.table(results)


def test_steps_credit_grows_with_the_steps_right_in_their_place():
    prompt, right = addition.prompt(5821, 967), addition.solution(5821, 967)
    chain = right.split(";")[0].split(",")
    # The first k steps right, then the end: k of the 5 (4 steps and the answer).
    for k in range(len(chain) + 1):
        assert addition.step_credit(prompt, ",".join(chain[:k]) + addition.EOS) == k / 5
    # A step out of its place does not count, nor does a later step after a missing one.
    assert addition.step_credit(prompt, ",".join(chain[1:]) + ";6788" + addition.EOS) == 1 / 5
    with pytest.raises(ValueError, match="not a prompt of the addition task"):
        addition.step_credit("5821 + 967 =", right + addition.EOS)
    with pytest.raises(ValueError, match="credit 'digits'"):
        addition.label(1, 2, "digits")


def test_warm_up_is_cached_with_its_settings(tmp_path):
    options = dict(digits=dict(mean=1.5, high=2), batch=8, max_steps=4, eval_every=2, heldout=8, dtype="float32")
    first = warmup.warm_up(str(tmp_path), "tiny", 0.9, **options)
    actor = tmp_path / "models" / "actor" / "model.safetensors"
    assert first["steps"] == 4 and not first["reached_target"]  # 4 steps cannot reach 90%: stopped at max_steps
    assert set(first["accuracy_by_digits"]) == {"1-3"}  # sums of up to 2 digits
    assert [set(h["accuracy_by_digits"]) for h in first["history"]] == [{"1-3"}, {"1-3"}]
    # The wrong ones it shows are the saved model's greedy responses, after their prompts: 4 steps leave most wrong.
    wrong = first["wrong_by_digits"]["1-3"]
    assert wrong and len(wrong) <= 3
    for text in wrong:
        prompt, response = text[: text.index("=") + 1], text[text.index("=") + 1 :]
        a, b = addition.operands(prompt)
        assert addition.answer(response) != str(a + b)
    # Sampled as PPO samples: a sum with a right sample among 8 is at least as common as a right sample.
    assert 0 <= first["sampled_accuracy"] <= first["pass_at_samples"] <= 1
    assert set(first["sampled_accuracy_by_digits"]) == set(first["pass_at_samples_by_digits"]) == {"1-3"}
    assert first["settings"]["samples"] == 8
    assert (tmp_path / "models" / "reward" / "config.json").exists()
    saved_at = os.path.getmtime(actor)
    assert warmup.warm_up(str(tmp_path), "tiny", 0.9, **options) == first
    assert os.path.getmtime(actor) == saved_at  # reused, not trained again
    second = warmup.warm_up(str(tmp_path), "tiny", 0.9, **dict(options, max_steps=2))  # other settings: trained anew
    assert second["steps"] == 2


def _steps(rewards, seconds_per_step):
    return [
        {"step": i + 1, "start": i * seconds_per_step, "end": (i + 1) * seconds_per_step,
         "wall_s": seconds_per_step, "rollout/reward_mean": reward}
        for i, reward in enumerate(rewards)
    ]  # fmt: skip


def _results(curves):
    """Results as ``learning.run`` writes them, for curves {(system, seed): (rewards, seconds per step)}."""
    return dict(
        command="python -m openrlhf_oppo.bench --task addition",
        machine=dict(gpus=["NVIDIA H200"]),
        settings=dict(placement="split", shape="small", batch=32, n_samples=8, steps=10, warmup=0),
        task=dict(
            name="addition",
            target=0.75,
            warmup=dict(steps=1000, seconds=90, accuracy=0.3, device="NVIDIA H200"),
            prompts=dict(digits=dict(mean=6, high=20), mean_length=60, p90_length=121, max_length=202),
        ),
        systems={
            f"{system}-seed{seed}": dict(
                system=system, seed=seed, warmup_accuracy=0.3, steps=_steps(rewards, seconds), returncode=0
            )
            for (system, seed), (rewards, seconds) in curves.items()
        },
    )


RISING = [0.1 * i for i in range(1, 11)]  # its 3-step mean reaches the target, 0.75, at step 9 (0.8)


def test_convergence_table_times_the_target_and_checks_the_band(tmp_path):
    results = _results(
        {
            ("upstream-sync", 0): (RISING, 60),
            ("upstream-sync", 1): ([r + 0.02 for r in RISING], 60),  # the band: 0 to 0.02 above RISING
            ("oppo-both", 0): ([r + 0.01 for r in RISING], 30),  # in the band, twice as fast
            ("oppo-both", 1): ([r + 0.01 for r in RISING], 30),
            ("oppo-both-keep", 0): ([r / 2 for r in RISING], 30),  # below the band, never at the target
            ("oppo-both-keep", 1): ([], 30),  # failed
        }
    )
    failed = dict(system="upstream-async", seed=0, warmup_accuracy=0.3, steps=[], returncode=1)
    results["systems"]["upstream-async-seed0"] = failed
    lines = report.table(results).splitlines()
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | seeds | step (s) |")))
    # seeds, step (s), start, end, rise, seeds at target, step, minutes, vs sync, in sync's band
    assert rows["upstream-sync"] == [
        "2", "60.00 (60.00-60.00)", "21.0% (20.0%-22.0%)", "91.0% (90.0%-92.0%)", "+70.0", "2/2", "9 (9-9)",
        "9.0 (9.0-9.0)", "1.00x", "-",
    ]  # fmt: skip
    assert rows["oppo-both"][5:] == ["2/2", "9 (9-9)", "4.5 (4.5-4.5)", "0.50x", "100%"]
    assert rows["oppo-both-keep"][0] == "1 of 2" and rows["oppo-both-keep"][5:] == ["0/1", "-", "-", "-", "0%"]
    assert rows["upstream-async"][0] == "failed (rc 1)"
    assert report.is_convergence(results)

    report.write(results, str(tmp_path))
    assert (tmp_path / "table.md").read_text() == report.table(results)
    for plot in ("accuracy-by-step.png", "accuracy-by-time.png", "signals-by-step.png"):
        assert (tmp_path / plot).stat().st_size > 0


def _rows(lines: list, header: str) -> dict:
    start = lines.index(header)
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows[line.split("|")[1].strip()] = [cell.strip() for cell in line.split("|")[2:-1]]
    return rows


def test_short_of_the_target_systems_are_timed_to_upstream_syncs_end_accuracy():
    """No seed of upstream sync reached the target: each system is timed to the accuracy every sync seed ended
    at, the lowest of their last 3-step means. With one seed of sync there is no band to be in."""
    plateau = [0.2, 0.2, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5]  # 3-step mean 0.5 from step 8
    results = _results(
        {
            ("upstream-sync", 0): (plateau, 60),
            ("oppo-both", 0): ([0.2, 0.2, 0.2, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], 30),  # 0.5 from step 6
            ("oppo-both-keep", 0): ([0.2] * 10, 30),  # never there
        }
    )
    lines = report.table(results).splitlines()
    first = _rows(lines, next(line for line in lines if line.startswith("| system | seeds |")))
    assert first["oppo-both"][-1] == "-" and first["upstream-sync"][5:8] == ["0/1", "-", "-"]
    assert any(line.startswith("Time to upstream sync's end accuracy (50.0%, the lowest") for line in lines)
    rows = _rows(lines, "| system | seeds there | step there | minutes there | minutes vs sync |")
    # seeds there, step, minutes, vs sync
    assert rows["upstream-sync"] == ["1/1", "8", "8.0", "1.00x"]
    assert rows["oppo-both"] == ["1/1", "6", "3.0", "0.38x"]
    assert rows["oppo-both-keep"] == ["0/1", "-", "-", "-"]


def test_no_time_to_syncs_end_accuracy_where_sync_did_not_rise():
    """Where upstream sync ended no higher than it started, its end accuracy was there from the first steps."""
    falling = [0.5, 0.5, 0.5, 0.4, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2]
    results = _results({("upstream-sync", 0): (falling, 60), ("oppo-both", 0): (falling, 30)})
    assert "Time to upstream sync's end accuracy" not in report.table(results)


def test_runs_of_40_steps_or_more_also_get_the_rise_between_their_first_and_last_tenth():
    """One bad last step (a batch of long sums) drags the 3-step end down by a third of its fall; over the last
    tenth it weighs a tenth as much."""
    steady = [0.2] * 20 + [0.5] * 19 + [0.2]  # 40 steps: tenths of 4
    results = _results({("upstream-sync", 0): (steady, 60), ("oppo-both", 0): ([0.2] * 20 + [0.5] * 20, 30)})
    lines = report.table(results).splitlines()
    assert lines[lines.index("| system | accuracy, first tenth | accuracy, last tenth | rise (points) |") - 2] == (
        "Accuracy of the sampled responses over the first and the last tenth of each run's steps (4 steps), means"
        " over the seeds (lowest-highest)."
    )
    rows = _rows(lines, "| system | accuracy, first tenth | accuracy, last tenth | rise (points) |")
    assert rows["upstream-sync"] == ["20.0%", "42.5%", "+22.5"]
    assert rows["oppo-both"] == ["20.0%", "50.0%", "+30.0"]
    first = _rows(lines, next(line for line in lines if line.startswith("| system | seeds |")))
    assert first["upstream-sync"][4] == "+20.0"  # the 3-step end: (0.5 + 0.5 + 0.2) / 3
    # Shorter runs: the tenth is no longer than the first table's windows, and there is no such table.
    assert "first tenth" not in report.table(_results({("upstream-sync", 0): ([0.2] * 39, 60)}))


def test_the_accuracy_by_digits_has_its_own_table_and_plot(tmp_path):
    """Each band's accuracy is its right samples over its samples in the window, so a system that trains more
    short sums (OPPO trains each step's first groups to finish) is compared on equal sums."""
    results = _results({("upstream-sync", 0): ([0.5] * 4, 60), ("oppo-both", 0): ([0.5] * 4, 30)})
    short, middle, long = (addition.band_key(band, "share") for band in addition.DIGIT_BANDS)
    for name, right_short in (("upstream-sync-seed0", [0.2, 0.2, 0.2, 0.4]), ("oppo-both-seed0", [0.3] * 4)):
        for step, right in zip(results["systems"][name]["steps"], right_short):
            # Sync: half of its samples short, 40% and then 80% of them right; OPPO: 60% short, half right.
            step.update({short: 0.5 if name.startswith("upstream") else 0.6, middle: 0.4, long: 0.0})
            step.update({short.replace("share", "right"): right, middle.replace("share", "right"): 0.1})
    assert learning_report.band_accuracy(results["systems"]["upstream-sync-seed0"]["steps"], (1, 3)) == pytest.approx(
        [0.4, 0.4, 0.4, (0.2 + 0.2 + 0.4) / 1.5]
    )
    lines = report.table(results).splitlines()
    rows = _rows(lines, "| system | 1-3 digits | 4-6 digits | 7+ digits |")
    assert rows["upstream-sync"] == ["40.0% → 53.3% (50%)", "25.0% → 25.0% (40%)", "- → - (0%)"]
    assert rows["oppo-both"] == ["50.0% → 50.0% (60%)", "25.0% → 25.0% (40%)", "- → - (0%)"]
    report.write(results, str(tmp_path))
    assert (tmp_path / "accuracy-by-digits.png").stat().st_size > 0
    results["task"]["warmup"]["accuracy_by_digits"] = {"1-3": 0.41, "4-6": 0.0, "7+": 0.0}
    assert "(by the longer number's digits: 1-3 41%, 4-6 0%, 7+ 0%)" in report.table(results)
    # Runs from before the reward logged the bands have no such table, nor plot.
    older = _results({("upstream-sync", 0): ([0.5] * 4, 60)})
    assert "1-3 digits" not in report.table(older)
    report.write(older, str(tmp_path / "older"))
    assert not (tmp_path / "older" / "accuracy-by-digits.png").exists()


def test_accuracy_is_the_share_of_right_answers_whatever_the_reward():
    steps = [{"accuracy": 0.25, "rollout/reward_mean": 0.6}, {"accuracy": 0.5, "rollout/reward_mean": 0.7}]
    assert learning_report.accuracy(steps) == [0.25, 0.375]
    # Runs from before the reward logged it: their reward was 1 for a right answer.
    assert learning_report.accuracy([{"rollout/reward_mean": 0.5}]) == [0.5]


def test_the_band_is_the_baseline_seeds_range_step_by_step():
    baseline = [[0.1, 0.2, 0.3], [0.3, 0.4, 0.5]]
    assert learning_report.band(baseline) == ([0.1, 0.2, 0.3], pytest.approx([0.2, 0.3, 0.4]), [0.3, 0.4, 0.5])
    assert learning_report.share_in_band([[0.2, 0.5, 0.4]], baseline) == pytest.approx(2 / 3)
    assert learning_report.accuracy(_steps([0.0, 0.3, 0.6, 0.9], 1)) == pytest.approx([0.0, 0.15, 0.3, 0.6])


def test_a_mean_of_three_seeds_lies_in_a_band_of_three_at_about_63_percent_where_nothing_differs():
    """The yardstick of "steps in sync's band": two systems that learn alike, seed noise normal and independent.
    Every split of the six runs sees the same thing."""
    rng = random.Random(0)
    shares = []
    for _ in range(200):
        runs = [[rng.gauss(0.0, 1.0) for _ in range(100)] for _ in range(6)]
        shares.append(learning_report.share_in_band(runs[:3], runs[3:]))
        assert 0.4 < statistics.median(learning_report.shares_in_band_by_split(runs[:3], runs[3:])) < 0.85
    assert 0.60 < statistics.mean(shares) < 0.66


def test_held_out_accuracy_has_its_own_table_and_time_to_target(tmp_path):
    """Steps followed by an evaluation carry OpenRLHF's ``eval/eval_default_pass1``: the held-out table gives the
    accuracy at the first and last step evaluated in every run (upstream async's last evaluation can be missing)
    and the first evaluation at the target, over the seeds, against upstream sync's."""
    results = _results(
        {
            ("oppo-both", 0): (RISING, 30),  # OPPO ran first: sync's minutes are known only later
            ("upstream-sync", 0): (RISING, 60),
            ("upstream-sync", 1): (RISING, 60),
            ("oppo-both-keep", 0): (RISING, 30),
            ("upstream-async", 0): (RISING, 40),
        }
    )
    results["settings"]["eval_every"] = 2
    held_out = {"upstream-sync": [0.3, 0.5, 0.7, 0.8, 0.9], "oppo-both": [0.4, 0.6, 0.8, 0.9, 0.9]}
    held_out.update({"oppo-both-keep": [0.3, 0.4, 0.4, 0.5, 0.5], "upstream-async": [0.3, 0.5, 0.7, 0.8]})
    for run in results["systems"].values():
        for k, value in enumerate(held_out[run["system"]]):
            run["steps"][2 * k + 1].update({learning_report.HELDOUT: value, "eval/eval_num_samples": 256.0})
    lines = report.table(results).splitlines()
    assert any(
        line.startswith("Held-out accuracy (greedy, the same 256 sums for every system, every 2") for line in lines
    )
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | step 2 | step 8 |")))
    # step 2, step 8, seeds at target, step, minutes, vs sync
    assert rows["upstream-sync"] == [
        "30.0% (30.0%-30.0%)",
        "80.0% (80.0%-80.0%)",
        "2/2",
        "8 (8-8)",
        "8.0 (8.0-8.0)",
        "1.00x",
    ]
    assert rows["oppo-both"] == ["40.0%", "90.0%", "1/1", "6", "3.0", "0.38x"]
    assert rows["oppo-both-keep"] == ["30.0%", "50.0%", "0/1", "-", "-", "-"]
    assert rows["upstream-async"] == ["30.0%", "80.0%", "1/1", "8", "5.3", "0.67x"]
    report.write(results, str(tmp_path))  # the plots draw the held-out points
    assert (tmp_path / "accuracy-by-time.png").stat().st_size > 0


def test_time_in_the_loop_excludes_evaluations_only_where_they_paused_training():
    """Upstream sync and OPPO evaluate between a step's log and the next step: those seconds leave the next step's
    time and the minutes. Upstream async evaluates beside training and logs it after the next step: nothing leaves."""
    in_loop = [
        {"start": 0.0, "end": 10.0, "wall_s": 10.0, "eval_end": 13.0},  # 3 s of evaluation after step 1
        {"start": 10.0, "end": 23.0, "wall_s": 13.0},
        {"start": 23.0, "end": 33.0, "wall_s": 10.0, "eval_end": 35.0},  # after the last step: not in a step
    ]
    assert learning_report.in_loop_eval_s(in_loop) == [0.0, 3.0, 0.0]
    assert learning_report.step_seconds(in_loop) == [10.0, 10.0, 10.0]
    assert learning_report.minutes(in_loop) == pytest.approx([10 / 60, 20 / 60, 30 / 60])
    beside = [
        {"start": 0.0, "end": 10.0, "wall_s": 10.0, "eval_end": 21.0},  # logged after step 2's own log
        {"start": 10.0, "end": 20.0, "wall_s": 10.0},
    ]
    assert learning_report.in_loop_eval_s(beside) == [0.0, 0.0]
    assert learning_report.minutes(beside) == pytest.approx([10 / 60, 20 / 60])


def test_a_larger_digits_sigma_gives_the_same_mean_a_longer_tail(tmp_path, monkeypatch):
    """``--digits_sigma``: more short sums and more long ones at the same mean, in the prompts, the warm-up's settings
    and the report's line on the prompts; a negative one is refused."""
    args = learning.parse(["--task", "addition", "--out", "x", "--digits_mean", "2", "--digits_sigma", "1.5"])
    wide = addition.digit_counts(20000, 0, **dict(addition.DIGITS, mean=2, sigma=args.digits_sigma))
    narrow = addition.digit_counts(20000, 0, **dict(addition.DIGITS, mean=2))
    assert sorted(wide)[int(0.99 * len(wide))] > sorted(narrow)[int(0.99 * len(narrow))]
    assert wide.count(1) > narrow.count(1)
    assert abs(statistics.mean(wide) - statistics.mean(narrow)) < 0.3
    with pytest.raises(SystemExit):
        learning.parse(["--task", "addition", "--out", "x", "--digits_sigma", "-1"])
    monkeypatch.setattr("sys.argv", ["warmup", "--out", str(tmp_path / "warmup"), "--digits_sigma", "-1"])
    with pytest.raises(SystemExit):
        warmup.main()  # refused before it trains
    assert not (tmp_path / "warmup").exists()
    summary = addition.write_prompts(str(tmp_path / "prompts.jsonl"), 200, 0, mean=2, sigma=1.5, high=6)
    assert summary["digits"]["sigma"] == 1.5
    assert (
        learning_report.digits_sigma(summary["digits"]) == ", sigma 1.5"
        and learning_report.digits_sigma(addition.DIGITS) == ""
    )


def test_runs_are_evaluated_on_the_warm_ups_held_out_sums():
    args = learning.parse(["--task", "addition", "--out", "x"])
    flags = learning.eval_flags("/w", args.eval_every)
    assert flags == ["--eval.dataset", "/w/heldout.jsonl", "--eval.steps", "10", "--eval.temperature", "0",
                     "--eval.n_samples_per_prompt", "1", "--ckpt.best_metric_key", "none"]  # fmt: skip
    assert learning.eval_flags("/w", 0) == []


@pytest.mark.engine
def test_under_min_tokens_vllms_first_token_logprob_leaves_out_the_end_of_text(tmp_path):
    """Why the learning benchmark samples with ``--rollout.min_new_tokens 0`` (patch 0015): with upstream's
    min_tokens=1, vLLM masks the end of text at the first token, and its processed log-prob of the token it samples
    there (the importance correction's pi_rollout) is the policy's minus log(1 - p(eos)). With 0 the two agree."""
    import math
    import subprocess
    import sys

    helper = os.path.join(os.path.dirname(__file__), "first_token_logprob_helper.py")
    done = subprocess.run([sys.executable, helper, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    gap = -math.log(1 - result["p_eos"])
    assert gap > 0.1  # the model's first token is the end of text often enough to matter
    for token, vllm_logprob, policy_logprob in result["min_tokens_1"]:
        assert token != result["eos"]
        assert vllm_logprob - policy_logprob == pytest.approx(gap, abs=1e-3)
    for token, vllm_logprob, policy_logprob in result["min_tokens_0"]:
        assert vllm_logprob == pytest.approx(policy_logprob, abs=1e-3)
    assert any(token == result["eos"] for token, _, _ in result["min_tokens_0"])


def test_the_benchmark_lets_responses_end_at_their_first_token_where_the_patches_allow():
    for patched in (True, False):
        argv = ["--task", "addition", "--out", "OUT"] + (["--upstream_patches"] if patched else [])
        flags = learning.run_flags("W", "OUT", "n", "upstream-sync", 0, learning.parse(argv))
        assert ("--rollout.min_new_tokens" in flags) == patched
        if patched:
            assert flags[flags.index("--rollout.min_new_tokens") + 1] == "0"


def test_the_kl_is_a_loss_since_group_norm_leaves_a_kl_in_the_reward_without_baseline(bench_workdir):
    """Why the learning benchmark sets ``--algo.kl.use_loss``: OpenRLHF's group_norm normalises the task's reward
    within the prompt's samples, then adds the KL penalty per token with no baseline. For a group whose samples are
    all wrong, upstream's returns are then negative at every token, most at the first: each step pushes every
    sampled token down, the more so the longer the response."""
    from types import SimpleNamespace

    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from openrlhf_oppo.bench.driver import parse_args

    bench = learning.parse(["--task", "addition", "--out", "OUT", "--n_samples", "8"])
    args = parse_args(learning.run_flags(bench_workdir, f"{bench_workdir}/out", "n", "upstream-sync", 0, bench))
    assert args.algo.advantage.estimator == "group_norm"
    assert args.algo.kl.use_loss and args.algo.kl.estimator == "k3"

    # The KL in the reward instead (the benchmark's setting before): 8 wrong responses of 5 tokens, each token
    # sampled 0.1 nats more likely under the policy than under the reference.
    args.algo.kl.use_loss, args.algo.kl.estimator = False, "k1"
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.advantage_estimator = SimpleNamespace(args=args), "group_norm"
    maker.kl_ctl = SimpleNamespace(value=args.algo.kl.init_coef)
    group = Experience(
        rewards=torch.zeros(8), kl=torch.full((8, 5), 0.1), action_mask=torch.ones(8, 5, dtype=torch.bool),
        index=list(range(8)),
    )  # fmt: skip
    (experience,) = maker.compute_advantages_and_returns([group])
    coef = args.algo.kl.init_coef
    expected = torch.tensor([-coef * 0.1 * (5 - t) for t in range(5)]).expand(8, 5)
    assert torch.allclose(experience.advantages, expected)
    assert (experience.advantages < 0).all()


def test_delta_is_the_batch_split_and_an_eighth_of_it_colocated():
    """Colocated, the awake system tops up at the step's end and the small model decodes the next batch during
    training: a Delta of a whole batch would only make each step train samples a version older."""
    split = learning.parse(["--task", "addition", "--out", "x"])
    colocated = learning.parse(["--task", "addition", "--out", "x", "--gpus", "1", "--placement", "colocated"])
    given = learning.parse(["--task", "addition", "--out", "x", "--placement", "colocated", "--overcommit", "32"])
    assert (split.overcommit, colocated.overcommit, given.overcommit) == (32, 4, 32)
    flags = learning.run_flags("W", "OUT", "n", "oppo-both-awake", 0, colocated)
    assert flags[flags.index("--oppo.overcommit") + 1] == "4"


def test_the_warm_up_stops_where_pass_at_samples_leaves_room_above_the_sampled_accuracy():
    """With a headroom the greedy accuracy does not decide: the sampled accuracy must be low and pass@samples that
    much above it."""
    point = dict(accuracy=0.9, sampled_accuracy=0.10, pass_at_samples=0.40)
    assert warmup.stop_here(point, 0.3) and not warmup.stop_here(dict(point, accuracy=0.2), 0.3)
    assert not warmup.stop_here(point, 0.2, headroom=0.35)  # 30 points of room: train on
    assert warmup.stop_here(dict(point, pass_at_samples=0.46), 0.2, headroom=0.35)
    assert not warmup.stop_here(dict(sampled_accuracy=0.25, pass_at_samples=0.9), 0.2, headroom=0.35)  # too high


def test_the_warm_up_checks_every_step_once_its_sampled_accuracy_rises():
    """Sampled accuracy can go from 9% to 20% in 10 steps, past the steps where the headroom rule held: from a
    quarter of the target on, each step is checked; without the rule, or before any check, every ``eval_every``."""
    low, rising = dict(sampled_accuracy=0.01), dict(sampled_accuracy=0.087)
    assert warmup.steps_to_next_check([], 10, 0.2, headroom=0.35) == 10
    assert warmup.steps_to_next_check([low], 10, 0.2, headroom=0.35) == 10
    assert warmup.steps_to_next_check([low, rising], 10, 0.2, headroom=0.35) == 1
    assert warmup.steps_to_next_check([dict(rising, accuracy=0.3)], 10, 0.2) == 10


def test_runs_side_by_side_share_a_warm_up_made_before(tmp_path):
    """``--warmup_from``: the folder's summary as it is, refused for other sums or no warm-up at all; its weights'
    hash names the model every run started from."""
    options = dict(digits=dict(mean=1.5, high=2), batch=8, max_steps=2, eval_every=2, heldout=8, dtype="float32")
    made = warmup.warm_up(str(tmp_path), "tiny", 0.9, headroom=0.35, **options)
    assert made["settings"]["headroom"] == 0.35 and set(made["history"][0]) >= {"sampled_accuracy", "pass_at_samples"}
    assert warmup.made_before(str(tmp_path), "tiny", dict(mean=1.5, high=2)) == made
    with pytest.raises(ValueError, match="was made for"):
        warmup.made_before(str(tmp_path), "tiny", dict(mean=2, high=2))
    with pytest.raises(FileNotFoundError, match="no warm-up"):
        warmup.made_before(str(tmp_path / "none"), "tiny", {})
    digest = warmup.checkpoint_sha256(str(tmp_path))
    assert len(digest) == 64 and digest == warmup.checkpoint_sha256(str(tmp_path))


def test_runs_sharing_one_gpu_move_no_memory_and_take_a_small_share(bench_workdir):
    """``--sleep off``: no system sleeps (upstream sync and the flag swap alike); ``--vllm_share`` and
    ``--train_micro_batch`` reach every system's flags."""
    from openrlhf_oppo.bench.driver import parse_args

    argv = ["--task", "addition", "--out", "/o", "--gpus", "1", "--placement", "colocated"]
    shared = learning.parse(argv + ["--sleep", "off", "--vllm_share", "0.08", "--train_micro_batch", "16"])
    for system in ("upstream-sync", "oppo", "oppo-keep"):
        args = parse_args(learning.run_flags(bench_workdir, "/o", f"{system}-seed0", system, 0, shared))
        assert args.train.colocate_all and not args.vllm.enable_sleep and not args.ds.enable_sleep
        assert args.vllm.gpu_memory_utilization == 0.08
        assert (args.train.micro_batch_size, args.train.batch_size) == (16, 64)
    hybrid = parse_args(learning.run_flags(bench_workdir, "/o", "u", "upstream-sync", 0, learning.parse(argv)))
    assert hybrid.vllm.enable_sleep and hybrid.ds.enable_sleep and hybrid.vllm.gpu_memory_utilization == 0.45
    with pytest.raises(SystemExit):
        learning.parse(argv + ["--train_micro_batch", "24"])  # does not divide a policy update's 64 samples


LEARNING_CPU = os.path.join(os.path.dirname(__file__), "data", "learning-cpu")


def test_the_same_curve_report_comes_from_the_raw_results_of_runs_side_by_side(tmp_path):
    """The raw results of learning runs made one (system, seed) a process from one warm-up, and of the step times
    measured alone (``tests/learning_raw_helper.py`` made them on CPU), merged as docs/results keeps them: the
    tables say what the raw steps give."""
    for path in report.raw_files(LEARNING_CPU):  # published as they are: no folder of the machine that made them
        assert "learning-raw-" not in json.dumps(report.load(path))
    results = report.run_results(LEARNING_CPU)
    runs = learning_report.runs_by_system(results)
    assert {system: sorted(seeds) for system, seeds in runs.items()} == {"upstream-sync": [0, 1, 2], "oppo": [0, 1, 2]}
    # One warm-up: every run, the step times alone included, started from the same weights.
    assert len({r["warmup_sha256"] for r in results["systems"].values()}) == 1
    alone = learning_report.alone_step_seconds(results)
    for system in runs:
        (steps,) = [r["steps"] for r in results["systems"].values() if r.get("alone") and r["system"] == system]
        walls = [s["wall_s"] for s in steps[1:]]  # no evaluation runs alone
        assert alone[system] == pytest.approx(sum(walls) / len(walls))

    lines = report.table(results).splitlines()
    # The runs shared the machine: the first table's step and minutes are those of the step time alone too.
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | seeds | step (s) |")))
    for system in runs:
        assert rows[system][1] == f"{alone[system]:.2f}"
    header = next(line for line in lines if line.startswith("| system | seeds | rise (points) |"))
    rows = _rows(lines, header)
    base = runs["upstream-sync"]
    final = sum(learning_report.tenths(steps)[1] for steps in base.values()) / 3
    for system, seeds in runs.items():
        first, last = zip(*(learning_report.tenths(steps) for steps in seeds.values()))
        assert rows[system][1] == f"{(sum(last) - sum(first)) / 3 * 100:+.1f}"
        assert rows[system][4] == f"{(sum(last) / 3 - final) * 100:+.1f}"
        assert rows[system][5] == f"{alone[system]:.2f}"
        # The first step at which the seeds' mean curve reaches sync's final accuracy, at the step time alone.
        curves = [learning_report.accuracy(steps) for steps in seeds.values()]
        mean = [sum(c[i] for c in curves) / 3 for i in range(min(map(len, curves)))]
        step = next((i + 1 for i, value in enumerate(mean) if value >= final), None)
        assert rows[system][6] == ("-" if step is None else str(step))
        if step is not None:
            assert rows[system][7] == f"{step * alone[system] / 60:.1f}"
    in_band = learning_report.share_in_band(
        [learning_report.accuracy(s) for s in runs["oppo"].values()],
        [learning_report.accuracy(s) for s in base.values()],
    )
    assert rows["oppo"][2] == f"{in_band:.0%}" and rows["upstream-sync"][2] == "-"
    # Every split of the six runs into two groups of three, the actual one among them.
    splits = learning_report.shares_in_band_by_split(
        [learning_report.accuracy(s) for s in runs["oppo"].values()],
        [learning_report.accuracy(s) for s in base.values()],
    )
    assert len(splits) == 20 and in_band in splits
    median = sorted(splits)[9:11]
    assert rows["oppo"][3] == f"{sum(median) / 2:.0%} ({min(splits):.0%}-{max(splits):.0%})"

    # The settings are the learning runs', wherever the step times alone sort among the files.
    alone_file, *learning_files = sorted(report.raw_files(LEARNING_CPU), key=lambda path: "speed-alone" not in path)
    assert report.merge([alone_file, *learning_files])["settings"] == results["settings"]
    assert not results["settings"].get("speed_alone")

    # The policy lag: OPPO's only, from its steps.
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | lag, mean |")))
    oppo = [s for steps in runs["oppo"].values() for s in steps]
    assert list(rows) == ["oppo"]
    assert rows["oppo"][0] == f"{sum(s['oppo/policy_lag_mean'] for s in oppo) / len(oppo):.2f}"
    # The lag of the steps after one that carried no group: what no carried group made.
    after_none = [
        step["oppo/policy_lag_mean"]
        for steps in runs["oppo"].values()
        for before, step in zip(steps, steps[1:])
        if before["oppo/carried_groups"] == 0
    ]
    assert rows["oppo"][2] == (f"{statistics.mean(after_none):.2f}" if after_none else "-")
    carrying = sum(s["oppo/carried_groups"] > 0 for s in oppo) / len(oppo)
    assert rows["oppo"][3] == f"{carrying:.0%}"

    # The trained responses by length, in both systems: each bucket's share and reward over every step.
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | mean length |")))
    for system, seeds in runs.items():
        steps = [s for per_seed in seeds.values() for s in per_seed]
        mean_length = sum(s["rollout/response_length_mean"] for s in steps) / len(steps)
        assert rows[system][0].endswith(f"; {mean_length:.0f}")
        for (low, high), (share, mean_reward) in learning_report.reward_by_length(steps).items():
            shares = [s[lengths.key("share", low, high)] for s in steps]
            rewards = [s.get(lengths.key("reward", low, high), 0.0) for s in steps]
            assert share == pytest.approx(sum(shares) / len(steps))
            assert mean_reward == pytest.approx(sum(a * b for a, b in zip(shares, rewards)) / sum(shares))
            assert f"{share:.0%}: {mean_reward:.2f}" in rows[system]

    report.write(results, str(tmp_path))
    for plot in ("accuracy-by-step.png", "accuracy-by-time.png", "reward-by-step.png", "reward-by-time.png"):
        assert (tmp_path / plot).stat().st_size > 0
    assert (tmp_path / "lag-by-step.png").stat().st_size > 0


def test_the_lag_after_a_step_that_carried_no_group_is_what_the_top_up_made():
    """On one GPU with vLLM awake the flag swap starts the next step's prompts beside training: after a step that
    carried no group into the next, every sample trained is one version behind, so the lag of those steps is what
    the top-up makes, not the carried groups (the lag-0 control's is 0)."""
    folder = os.path.join(os.path.dirname(__file__), "..", "docs", "results")
    results = report.run_results(os.path.join(folder, "learning-1gpu-small-addition-digits-sigma1.6-lag-0-control"))
    runs = learning_report.runs_by_system(results)
    lines = learning_report.lag_table(runs)
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | lag, mean |")))
    after_none = [
        step["oppo/policy_lag_mean"]
        for steps in runs["oppo"].values()
        for before, step in zip(steps, steps[1:])
        if before["oppo/carried_groups"] == 0
    ]
    assert len(after_none) > len(runs["oppo"]) * 40  # most of the 80 steps of each seed
    assert rows["oppo"][2] == f"{statistics.mean(after_none):.2f}" == "1.00"
    assert rows["oppo-intra"][2] == "0.00" and rows["oppo-intra"][3] == "0%"


def test_each_seeds_mean_accuracy_and_the_phases_of_the_steps_alone_come_from_the_raw_steps():
    """Under upstream sync's band a curve can lie lower throughout: each seed's mean over its steps, against sync's
    lowest and highest seed, says so. The phases of a step are those of the runs that measured it alone."""
    results = report.run_results(LEARNING_CPU)
    runs = learning_report.runs_by_system(results)
    lines = report.table(results).splitlines()
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | all steps, each seed |")))
    means = {
        system: [
            (statistics.mean(raw), statistics.mean(raw[len(raw) // 4 :]))
            for raw in (learning_report.raw_accuracy(steps) for steps in seeds.values())
        ]
        for system, seeds in runs.items()
    }
    base = means["upstream-sync"]
    for system, per_seed in means.items():
        for column, i in ((0, 0), (3, 1)):
            values = sorted(m[i] for m in per_seed)
            assert rows[system][column] == ", ".join(f"{v:.1%}" for v in values)
            assert rows[system][column + 1] == f"{statistics.mean(values):.1%}"
            gap = statistics.mean(values) - statistics.mean(m[i] for m in base)
            assert rows[system][column + 2] == f"{gap * 100:+.1f}"
    under = sum(all(m[i] < min(b[i] for b in base) for i in range(2)) for m in means["oppo"])
    over = sum(all(m[i] > max(b[i] for b in base) for i in range(2)) for m in means["oppo"])
    assert rows["oppo"][6] == f"{under} / {over} of 3" and rows["upstream-sync"][6] == "-"

    header = next(line for line in lines if line.startswith("| system | generation |"))
    assert lines[lines.index(header) - 2].endswith("each system's step measured alone on the machine.")
    rows = _rows(lines, header)
    for system in runs:
        (steps,) = [r["steps"] for r in results["systems"].values() if r.get("alone") and r["system"] == system]
        for cell, phase in zip(rows[system], learning_report.PHASES):
            seconds = [s[f"timing/{phase}"] for s in steps[1:] if f"timing/{phase}" in s]
            assert cell == (f"{statistics.mean(seconds):.2f}" if seconds else "-")


def test_runs_cut_short_keep_their_per_step_logs_and_get_the_tables_they_give(tmp_path):
    """A learning run whose process ended before the benchmark wrote its results.json leaves OpenRLHF's tensorboard
    log: kept as per-step logs (``write_step_logs``), cut to the steps every run logged, they give the rise, the
    same curve without minutes, the phases of a step and the lag (``step_logs_table``)."""
    from torch.utils.tensorboard import SummaryWriter

    runs = learning_report.runs_by_system(report.run_results(LEARNING_CPU))
    tb_dirs = []
    for system, seeds in runs.items():
        for seed, steps in seeds.items():
            tb_dir = tmp_path / "tb" / f"{system}-seed{seed}"
            tb_dirs.append(str(tb_dir))
            logged = steps if (system, seed) != ("oppo", 0) else steps[:-1]  # this one stopped a step early
            with SummaryWriter(str(tb_dir)) as writer:
                for step in logged:
                    for key, value in step.items():
                        if key.startswith(("accuracy", "timing/", "oppo/", "rollout/", "trained_length/")):
                            writer.add_scalar(f"train/{key}", value, step["step"])
    folder = tmp_path / "folder"
    folder.mkdir()
    learning_report.write_step_logs(str(folder), tb_dirs)
    kept = learning_report.read_step_logs(str(folder))
    common = min(len(steps) for seeds in runs.values() for steps in seeds.values()) - 1
    assert list(kept) == ["upstream-sync", "oppo"]
    for system, seeds in runs.items():
        for seed, steps in seeds.items():
            assert len(kept[system][seed]) == common
            assert learning_report.raw_accuracy(kept[system][seed]) == pytest.approx(
                learning_report.raw_accuracy(steps[:common]), abs=1e-6
            )

    lines = learning_report.step_logs_table(str(folder)).splitlines()
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | seeds | rise (points) |")))
    for system, seeds in kept.items():
        assert rows[system][1] == f"{learning_report.seeds_tenths(seeds)[2]:+.1f}"
        assert rows[system][5] == rows[system][7] == rows[system][8] == "-"  # no step time alone, no minutes
    rows = _rows(lines, next(line for line in lines if line.startswith("| system | generation |")))
    oppo = [s for steps in kept["oppo"].values() for s in steps[5:]]
    assert rows["oppo"][1] == f"{statistics.mean(s['timing/end_of_generation'] for s in oppo):.2f}"
    assert rows["upstream-sync"][1] == "-"  # upstream's step has no such phase
    assert "| system | lag, mean |" in "\n".join(lines) and "lag-by-step.png" not in "\n".join(lines)

    with pytest.raises(ValueError, match="SYSTEM-seedN"):
        learning_report.write_step_logs(str(folder), [str(tmp_path / "tb" / "oppo")])
