"""The learning benchmark's table and plots, from its results: ``results.json`` as ``learning.py`` writes it, or
gzipped as docs/results keeps it (``report.run_results`` reads either).

Accuracy is the share of right answers among a step's sampled responses (``accuracy``, which the task's reward
logs; in runs from before it did, the mean reward ``rollout/reward_mean``, which was 1 for a right answer and 0
otherwise). Curves are smoothed with a 3-step moving mean, the same in the
table and the plots. A seed reaches the target at the first step whose smoothed accuracy is at or above it;
its minutes count from the start of its first step (the start-up of Ray, vLLM and the models is left out).
Upstream sync's seed band is, at each step, the lowest to the highest of its seeds' smoothed accuracies (with
one seed there is no band, and the table says nothing of it). Where upstream sync's seeds do not all reach the
target but all end above where they all started, a third table times each system to the accuracy they all
reached at the end (the lowest of their last smoothed accuracies): the minutes to one accuracy, compared all the
same. Runs of 40 steps or more also get the accuracy over the first and the last tenth of their steps
(``tenths_table``): its rise is less at the mercy of a few steps' prompts than the first table's. With two seeds
of upstream sync or more, each seed's mean over its steps against sync's lowest and highest (``seed_means_table``)
tells a curve that is lower throughout from one that only leaves the band at times; with step times measured alone,
their phases say where each system's step goes (``phase_table``).
That accuracy is over the samples each step trains, and OPPO trains each step's first groups to finish (the
short sums first); runs with evaluations also get the held-out accuracy: greedy, on one set of sums for every
system (OpenRLHF's ``--eval.*``), unsmoothed, with its own time to the target.
``report.write`` and ``report.table`` come here for a learning run. A run stopped before the benchmark wrote its
results keeps its per-step log (``write_step_logs``), whose tables ``step_logs_table`` makes (``python -m
openrlhf_oppo.bench.learning_report FOLDER``).
"""

import argparse
import glob
import gzip
import itertools
import json
import math
import os
import re
import statistics
import sys

from openrlhf_oppo import lengths
from openrlhf_oppo.bench import addition

SMOOTHING = 3  # steps in the moving mean
BASELINE = "upstream-sync"
# What the task's reward gave credit for (``addition.score``); runs from before the choice gave it for the answer.
CREDITS = dict(steps="the share of the chain's steps and the answer that are right", answer="1 for the right sum")
HELDOUT = "eval/eval_default_pass1"  # OpenRLHF's pass@1 on an eval set without a datasource column


def runs_by_system(results: dict) -> dict:
    """system -> {seed: steps}, for the runs that logged steps, systems in the order they ran (not the step times
    measured alone: ``alone_step_seconds``)."""
    runs = {}
    for result in results["systems"].values():
        if result.get("alone"):
            continue
        runs.setdefault(result["system"], {})
        if result.get("steps"):
            runs[result["system"]][result["seed"]] = result["steps"]
    return runs


def raw_accuracy(steps: list) -> list:
    """Each step's accuracy, unsmoothed."""
    return [s.get("accuracy", s.get("rollout/reward_mean", float("nan"))) for s in steps]


def accuracy(steps: list) -> list:
    """The smoothed accuracy at each step."""
    raw = raw_accuracy(steps)
    return [statistics.mean(raw[max(0, i - SMOOTHING + 1) : i + 1]) for i in range(len(raw))]


def in_loop_eval_s(steps: list) -> list:
    """Per step, the seconds of a held-out evaluation that ran in the training loop before it. Upstream sync and
    OPPO evaluate between a step's log and the next step, which the next step's wall time would count; upstream
    async evaluates in its generator beside training, logged after the next step, and is charged nothing."""
    charged = [0.0] * len(steps)
    for k in range(len(steps) - 1):
        done = steps[k].get("eval_end")
        if done is not None and done <= steps[k + 1]["end"]:
            charged[k + 1] = max(0.0, done - steps[k]["end"])
    return charged


def step_seconds(steps: list) -> list:
    """Each step's wall time, less a held-out evaluation run in the training loop before it."""
    return [s["wall_s"] - e for s, e in zip(steps, in_loop_eval_s(steps))]


def band_accuracy(steps: list, digits: tuple) -> list:
    """The smoothed accuracy at each step on the sums whose longer number has ``digits`` digits (an
    ``addition.DIGIT_BANDS`` band): the right ones among them over the moving window, NaN where the window has
    none. Each step's log is a mean over its samples (``addition.reward_func``), and a step's samples are as many
    whatever the system, so the window's sums weigh each sample alike."""
    share = [s.get(addition.band_key(digits, "share"), 0.0) for s in steps]
    right = [s.get(addition.band_key(digits, "right"), 0.0) for s in steps]
    smoothed = []
    for i in range(len(steps)):
        window = slice(max(0, i - SMOOTHING + 1), i + 1)
        total = sum(share[window])
        smoothed.append(sum(right[window]) / total if total else math.nan)
    return smoothed


def band_share(seeds: dict, digits: tuple) -> float:
    """The share of a system's samples, over its seeds and steps, whose longer number has ``digits`` digits."""
    return statistics.mean(s[addition.band_key(digits, "share")] for steps in seeds.values() for s in steps)


def digits_table(runs: dict) -> list:
    """Per system, the sampled accuracy on each band of the longer number's digits at the start and the end (the
    first and the last moving windows), and the band's share of the samples, means over the seeds: which sums a
    system learned, and, since OPPO trains each step's first groups to finish, its accuracy on equal sums."""
    names = [f"{addition.band_name(band)} digits" for band in addition.DIGIT_BANDS]
    lines = [
        f"Accuracy of the sampled responses by the digits of the sum's longer number ({SMOOTHING}-step windows,"
        " start → end), means over the seeds; in brackets, the band's share of the samples trained.",
        "",
        "| system | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for system, seeds in runs.items():
        if not seeds:
            continue  # failed: the first table says so
        cells = []
        for digits in addition.DIGIT_BANDS:
            curves = [band_accuracy(steps, digits) for steps in seeds.values()]
            start, end = (_mean_or_nan([c[k] for c in curves]) for k in (min(SMOOTHING, len(curves[0])) - 1, -1))
            share = band_share(seeds, digits)
            cells.append(f"{_percent(start)} → {_percent(end)} ({share:.0%})")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def _mean_or_nan(values: list) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.mean(known) if known else math.nan


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def logs_digits(runs: dict) -> bool:
    """Whether every run logged the accuracy by digits (runs from before the reward did, did not)."""
    key = addition.band_key(addition.DIGIT_BANDS[0], "share")
    return all(key in s for seeds in runs.values() for steps in seeds.values() for s in steps)


def minutes(steps: list) -> list:
    """Wall-clock minutes from the start of the first step to the end of each, less the held-out evaluations run
    in the training loop."""
    evaluations = itertools.accumulate(in_loop_eval_s(steps))
    return [(s["end"] - steps[0]["start"] - e) / 60 for s, e in zip(steps, evaluations)]


def reached(steps: list, target: float):
    """The index of the first step whose smoothed accuracy is at or above ``target``, or None."""
    return next((i for i, value in enumerate(accuracy(steps)) if value >= target), None)


def heldout(steps: list) -> list:
    """``(index of the step, held-out accuracy)`` at each step that was followed by an evaluation."""
    return [(i, step[HELDOUT]) for i, step in enumerate(steps) if HELDOUT in step]


def band(curves: list) -> tuple:
    """Lowest, mean and highest over the curves, step by step, as long as the shortest curve."""
    length = min(len(c) for c in curves)
    columns = [[c[i] for c in curves] for i in range(length)]
    return [min(c) for c in columns], [statistics.mean(c) for c in columns], [max(c) for c in columns]


def share_in_band(curves: list, baseline: list) -> float:
    """The share of steps at which the mean of ``curves`` lies in the band of the ``baseline`` curves."""
    low, _, high = band(baseline)
    _, mean, _ = band(curves)
    steps = min(len(mean), len(low))
    return sum(low[i] <= mean[i] <= high[i] for i in range(steps)) / steps


def shares_in_band_by_split(curves: list, baseline: list) -> list:
    """``share_in_band`` for every way of splitting the runs of both into groups of their sizes, the first group's
    mean against the second's band: what the share is when the two learn alike, so that only the seeds differ. With
    three seeds each, a mean lies in a band of three at about 63% of the steps for any two systems that learn alike
    (for seed noise normal and independent), the measured share's yardstick rather than 100%."""
    pooled = list(curves) + list(baseline)
    shares = []
    for picked in itertools.combinations(range(len(pooled)), len(curves)):
        rest = [pooled[i] for i in range(len(pooled)) if i not in picked]
        shares.append(share_in_band([pooled[i] for i in picked], rest))
    return shares


def table(results: dict) -> str:
    settings, task = results["settings"], results["task"]
    target, runs = task["target"], runs_by_system(results)
    warm, prompts = task["warmup"], task["prompts"]
    seeds = sorted({r["seed"] for r in results["systems"].values()})
    alone, (at_minutes, _) = alone_step_seconds(results), clock(results)
    # Results merged from several invocations on fresh machines may start from warm-ups trained anew.
    starts = sorted({f"{r['warmup_accuracy']:.1%}" for r in results["systems"].values()})
    lines = [
        f"Task: {task['name']} · GPUs: {', '.join(results['machine']['gpus']) or 'none'} · placement:"
        f" {settings['placement']} · shape: {settings['shape']} · batch: {settings['batch']} prompts x"
        f" {settings['n_samples']} · {settings['steps']} steps · seeds: {', '.join(map(str, seeds))}"
        + (" · OpenRLHF with patches/openrlhf applied" if results.get("upstream_patches") else ""),
        "",
        f"Warm-up: {warm['steps']} supervised steps ({warm['seconds'] / 60:.1f} min on {warm['device']}), greedy"
        f" accuracy {' / '.join(starts)} on held-out sums"
        + (" (the runs started from warm-ups trained separately)" if len(starts) > 1 else "")
        + _by_digits(warm)
        + _sampled(warm)
        + f". Prompts: digits up to {prompts['digits']['high']}"
        f" (lognormal, mean {prompts['digits']['mean']:g}{digits_sigma(prompts['digits'])}); right responses mean"
        f" {prompts['mean_length']:.0f}"
        f" tokens, p90 {prompts['p90_length']}, max {prompts['max_length']}. Reward: "
        + CREDITS[prompts.get("credit", "answer")]
        + ".",
        "",
        f"Accuracy of the sampled responses ({SMOOTHING}-step moving mean; start and end: the mean of the first and"
        f" of the last {SMOOTHING} steps), means over the seeds (lowest-highest); target {target:.0%}."
        + (
            " Step and minutes: each system's step time measured alone on the machine (the runs shared it)."
            if alone
            else ""
        ),
        "",
        "| system | seeds | step (s) | accuracy, start | accuracy, end | rise (points) | seeds at target"
        " | step to target | minutes to target | minutes vs sync | steps in sync's band |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_minutes = _minutes_to_target(runs.get(BASELINE, {}), target, at_minutes, BASELINE)
    for system, seeds in runs.items():
        attempted = [r for r in results["systems"].values() if r["system"] == system and not r.get("alone")]
        if not seeds:
            codes = sorted({str(r.get("returncode")) for r in attempted})
            lines.append(f"| {system} | failed (rc {', '.join(codes)}) |" + " |" * 9)
            continue
        curves = [accuracy(steps) for steps in seeds.values()]
        start, end = [accuracy(steps[:SMOOTHING])[-1] for steps in seeds.values()], [c[-1] for c in curves]
        if alone:  # one step time per system, measured alone
            step_s = [alone[system]] if system in alone else []
        else:
            step_s = [statistics.mean(step_seconds(steps)) for steps in seeds.values()]
        in_band = "-"
        if system != BASELINE and len(runs.get(BASELINE, {})) > 1:
            in_band = f"{share_in_band(curves, [accuracy(s) for s in runs[BASELINE].values()]):.0%}"
        lines.append(
            f"| {system} | {len(seeds)}{f' of {len(attempted)}' if len(attempted) > len(seeds) else ''}"
            f" | {_spread(step_s, '.2f')} | {_spread(start, '.1%')} | {_spread(end, '.1%')}"
            f" | {statistics.mean(end) * 100 - statistics.mean(start) * 100:+.1f}"
            f" | {_time_to(seeds, target, base_minutes, at_minutes, system)} | {in_band} |"
        )
    if any(len(steps) // 10 > SMOOTHING for seeds in runs.values() for steps in seeds.values()):
        lines += ["", *tenths_table(runs)]
    if any(heldout(steps) for seeds in runs.values() for steps in seeds.values()):
        lines += ["", *heldout_table(results)]
    if any(runs.values()) and logs_digits(runs):
        lines += ["", *digits_table(runs)]
    level = sync_end_level(runs)
    if base_minutes is None and level is not None:
        lines += ["", *sync_end_table(runs, level, at_minutes)]
    if alone and runs.get(BASELINE):
        lines += ["", *same_curve_table(runs, alone)]
    if len(runs.get(BASELINE, {})) > 1:
        lines += ["", *seed_means_table(runs)]
    if alone:
        lines += ["", *phase_table(alone_runs(results), skip=1, alone=True)]
    if logs_lag(runs):
        lines += ["", *lag_table(runs)]
    if any(logs_lengths(seeds) for seeds in runs.values()):
        lines += ["", *length_table(runs)]
    return "\n".join(lines) + "\n"


def alone_runs(results: dict) -> dict:
    """system -> {seed: steps} of the runs that measured a system's step time alone on the machine."""
    runs = {}
    for result in results["systems"].values():
        if result.get("alone") and result.get("steps"):
            runs.setdefault(result["system"], {})[result["seed"]] = result["steps"]
    return runs


def alone_step_seconds(results: dict) -> dict:
    """system -> the mean wall time of its steps measured alone on the machine (``learning.py --speed_alone``),
    over its runs there, each run's first step left out (the start-up's compiles, and no group carried yet)."""
    times = {}
    for result in results["systems"].values():
        if result.get("alone") and len(result.get("steps") or []) > 1:
            times.setdefault(result["system"], []).extend(step_seconds(result["steps"])[1:])
    return {system: statistics.mean(seconds) for system, seconds in times.items()}


def mean_curve(seeds: dict, curve=None) -> list:
    """The mean over the seeds of ``curve(steps)`` (default: the smoothed accuracy), step by step."""
    return band([(curve or accuracy)(steps) for steps in seeds.values()])[1]


def same_curve_table(runs: dict, alone: dict) -> list:
    """Per system: the rise (first tenth against last tenth), the share of steps at which its mean curve lies in
    upstream sync's seed band, its last tenth against sync's, and the step and wall-clock at which its mean curve
    first reaches sync's final accuracy (sync's last tenth), the minutes from the step times measured alone."""
    final = statistics.mean(tenths(steps)[1] for steps in runs[BASELINE].values())
    base_curves = [accuracy(steps) for steps in runs[BASELINE].values()]

    def reached_at(seeds):
        return next((i for i, value in enumerate(mean_curve(seeds)) if value >= final), None)

    base_step = reached_at(runs[BASELINE])
    base_minutes = (base_step + 1) * alone[BASELINE] / 60 if base_step is not None and BASELINE in alone else None
    timed = (
        " at each system's step time measured alone on the machine (the learning runs shared it)"
        if alone
        else " in steps (no step time was measured alone: no minutes)"
    )
    lines = [
        f"The same curve: each system's mean over its seeds against upstream sync's seed band (the {SMOOTHING}-step"
        f" means), and the time to sync's final accuracy ({final:.1%}, the mean of its seeds' last tenths),{timed}."
        " The runs split any way: the share in the band for every split of the system's and sync's runs into groups"
        " of their sizes, what it is where the two learn alike.",
        "",
        "| system | seeds | rise (points) | steps in sync's band | the runs split any way: median (range)"
        " | last tenth vs sync (points) | step alone (s) | step to sync's final | minutes to sync's final | vs sync |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, seeds in runs.items():
        if not seeds:
            continue  # failed: the first table says so
        first, last, rise = seeds_tenths(seeds)
        in_band = by_split = "-"
        if system != BASELINE:
            curves = [accuracy(s) for s in seeds.values()]
            in_band = f"{share_in_band(curves, base_curves):.0%}"
            if len(curves) > 1 and len(base_curves) > 1:
                splits = shares_in_band_by_split(curves, base_curves)
                by_split = f"{statistics.median(splits):.0%} ({min(splits):.0%}-{max(splits):.0%})"
        gap = statistics.mean(last) * 100 - final * 100
        step, step_s = reached_at(seeds), alone.get(system)
        minutes = (step + 1) * step_s / 60 if step is not None and step_s else None
        ratio = f"{minutes / base_minutes:.2f}x" if minutes and base_minutes else "-"
        lines.append(
            f"| {system} | {len(seeds)} | {rise:+.1f} | {in_band} | {by_split} | {gap:+.1f}"
            f" | {_or_dash(step_s, '.2f')} | {'-' if step is None else step + 1} | {_or_dash(minutes, '.1f')} | {ratio} |"
        )
    return lines


def seed_means_table(runs: dict) -> list:
    """Per system, each seed's mean accuracy over all its steps and over the steps after its first quarter, and how
    many seeds lie under upstream sync's lowest or over its highest. A step's accuracy moves by several points with
    its prompts, so the band can hold a curve that is lower throughout; the run's mean averages that away, and a
    system whose every seed is under every sync seed learns less per step."""
    base = [seed_means(steps) for steps in runs[BASELINE].values()]
    lowest, highest = [min(means) for means in zip(*base)], [max(means) for means in zip(*base)]
    lines = [
        "Mean accuracy of the sampled responses over each seed's steps: all of them, and those after the first"
        " quarter; the seeds under upstream sync's lowest seed and over its highest.",
        "",
        "| system | all steps, each seed | mean | vs sync (points) | after the first quarter, each seed | mean"
        " | vs sync (points) | seeds under sync's / over sync's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base_mean = [statistics.mean(means) for means in zip(*base)]
    for system, seeds in runs.items():
        if not seeds:
            continue  # failed: the first table says so
        per_seed = [seed_means(steps) for steps in seeds.values()]
        cells = []
        for i in range(2):
            values = sorted(means[i] for means in per_seed)
            mean = statistics.mean(values)
            cells.append(f"{', '.join(f'{v:.1%}' for v in values)} | {mean:.1%} | {(mean - base_mean[i]) * 100:+.1f}")
        under = sum(all(m < low for m, low in zip(means, lowest)) for means in per_seed)
        over = sum(all(m > high for m, high in zip(means, highest)) for means in per_seed)
        counts = "-" if system == BASELINE else f"{under} / {over} of {len(per_seed)}"
        lines.append(f"| {system} | {' | '.join(cells)} | {counts} |")
    return lines


def seed_means(steps: list) -> tuple:
    """A run's mean accuracy over all its steps and over the steps after its first quarter (unsmoothed)."""
    raw = raw_accuracy(steps)
    return statistics.mean(raw), statistics.mean(raw[len(raw) // 4 :])


def _or_dash(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


LAG = "oppo/policy_lag_mean"


def logs_lag(runs: dict) -> bool:
    """Whether a run of ``runs`` (system -> seed -> steps) logged the policy lag (OPPO's runs do)."""
    return any(LAG in s for seeds in runs.values() for steps in seeds.values() for s in steps)


def lag_table(runs: dict, plotted: bool = True) -> list:
    """Per system, how far behind its trained samples were and how often groups were carried, means over its
    seeds' steps: the policy lag (mean, and the most of any step), the steps that carried groups into the next, the
    groups carried a step and the carried groups trained. ``plotted``: the lag per step is drawn too. The lag of the
    steps after one that carried nothing is the lag no carried group made: the prompts started before the sync."""
    lines = [
        "Policy lag and carried groups per step, over every step of every seed"
        + (" (per step: lag-by-step.png)." if plotted else "."),
        "",
        "| system | lag, mean | lag, most | lag after a step carrying none | steps carrying groups | groups carried a"
        " step | carried groups trained a step |",
        "|---|---|---|---|---|---|---|",
    ]
    for system, seeds in runs.items():
        steps = [s for per_seed in seeds.values() for s in per_seed]
        if not any(LAG in s for s in steps):
            continue
        carried = [s.get("oppo/carried_groups", 0.0) for s in steps]
        uncarried = [
            step.get(LAG, 0.0)
            for per_seed in seeds.values()
            for before, step in zip(per_seed, per_seed[1:])
            if not before.get("oppo/carried_groups", 0.0)
        ]
        lines.append(
            f"| {system} | {statistics.mean(s.get(LAG, 0.0) for s in steps):.2f}"
            f" | {max(s.get('oppo/policy_lag_max', 0.0) for s in steps):.0f}"
            f" | {_or_dash(statistics.mean(uncarried) if uncarried else None, '.2f')}"
            f" | {sum(c > 0 for c in carried) / len(carried):.0%} | {statistics.mean(carried):.1f}"
            f" | {statistics.mean(s.get('oppo/deferred_groups_trained', 0.0) for s in steps):.1f} |"
        )
    return lines


def logs_lengths(seeds: dict) -> bool:
    """Whether every step of these runs logged the trained responses by length (``lengths.py``)."""
    first = lengths.key("share", *lengths.buckets()[0])
    return bool(seeds) and all(first in s for steps in seeds.values() for s in steps)


def reward_by_length(steps: list) -> dict:
    """``(low, high)`` -> ``(share of the trained responses, their mean reward)`` over ``steps``, each step's
    bucket reward weighted by its share (a step's responses are as many in every system); buckets with none left
    out."""
    found = {}
    for bucket in lengths.buckets():
        shares = [s.get(lengths.key("share", *bucket), 0.0) for s in steps]
        if sum(shares):
            rewards = [s.get(lengths.key("reward", *bucket), 0.0) for s in steps]
            weighted = sum(w * r for w, r in zip(shares, rewards)) / sum(shares)
            found[bucket] = (sum(shares) / len(steps), weighted)
    return found


def length_table(runs: dict) -> list:
    """Per system, the mean length of the responses trained (first tenth of the steps, last tenth, all) and, per
    length bucket, their share and mean reward, over every step of every seed: whether the systems train the same
    lengths, and how they are rewarded by length."""
    found = {system: seeds for system, seeds in runs.items() if logs_lengths(seeds)}
    used = [b for b in lengths.buckets() if any(b in reward_by_length(_all(seeds)) for seeds in found.values())]
    names = [f"{lengths.bucket_name(*b).replace('_up', '+').replace('_', '-')} tokens" for b in used]
    lines = [
        "Trained responses by length: mean length (first tenth → last tenth of the steps; all steps), and per length"
        " bucket the share of the responses trained and their mean reward (share: reward), over every step of"
        " every seed.",
        "",
        "| system | mean length | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for system, seeds in found.items():
        first, last = zip(*(_tenths(steps, "rollout/response_length_mean") for steps in seeds.values()))
        overall = statistics.mean(s["rollout/response_length_mean"] for s in _all(seeds))
        buckets = reward_by_length(_all(seeds))
        cells = [f"{buckets[b][0]:.0%}: {buckets[b][1]:.2f}" if b in buckets else "-" for b in used]
        lines.append(
            f"| {system} | {statistics.mean(first):.0f} → {statistics.mean(last):.0f}; {overall:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _all(seeds: dict) -> list:
    return [s for steps in seeds.values() for s in steps]


def _tenths(steps: list, key: str) -> tuple:
    values = [s[key] for s in steps]
    n = max(1, len(values) // 10)
    return statistics.mean(values[:n]), statistics.mean(values[-n:])


def tenths(steps: list) -> tuple:
    """The mean accuracy over the first and over the last tenth of a run's steps (unsmoothed)."""
    raw = raw_accuracy(steps)
    n = max(1, len(raw) // 10)
    return statistics.mean(raw[:n]), statistics.mean(raw[-n:])


def seeds_tenths(seeds: dict) -> tuple:
    """Each seed's accuracy over its first and its last tenth of steps (``tenths``), and the rise of their means in
    points."""
    first, last = zip(*(tenths(steps) for steps in seeds.values()))
    return first, last, statistics.mean(last) * 100 - statistics.mean(first) * 100


def tenths_table(runs: dict) -> list:
    """Per system, the sampled accuracy over the first and the last tenth of its steps and the rise between them,
    means over the seeds (lowest-highest). A step trains 32 prompts, and their mix of short and long sums moves its
    accuracy by several points from one step to the next: the first table's start and end, 3 steps each, carry
    that into the rise, which a longer run can average away."""
    counts = sorted({len(steps) // 10 for seeds in runs.values() for steps in seeds.values()})
    lines = [
        "Accuracy of the sampled responses over the first and the last tenth of each run's steps"
        f" ({'/'.join(map(str, counts))} steps), means over the seeds (lowest-highest).",
        "",
        "| system | accuracy, first tenth | accuracy, last tenth | rise (points) |",
        "|---|---|---|---|",
    ]
    for system, seeds in runs.items():
        if not seeds:
            continue  # failed: the first table says so
        first, last, rise = seeds_tenths(seeds)
        lines.append(f"| {system} | {_spread(first, '.1%')} | {_spread(last, '.1%')} | {rise:+.1f} |")
    return lines


def digits_sigma(digits: dict) -> str:
    """The lognormal's sigma where it is not the task's default."""
    sigma = digits.get("sigma", addition.DIGITS["sigma"])
    return "" if sigma == addition.DIGITS["sigma"] else f", sigma {sigma:g}"


def _by_digits(warm: dict) -> str:
    """The warm-up's held-out accuracy by the longer number's digits, where it was measured (warm-ups from before
    were not)."""
    bands = warm.get("accuracy_by_digits")
    if not bands:
        return ""
    return f" (by the longer number's digits: {_bands(bands)})"


def _bands(bands: dict) -> str:
    """Shares by the longer number's digits, as '1-3 54%, 4-6 0%'."""
    return ", ".join(f"{k} {v:.0%}" for k, v in bands.items())


def _sampled(warm: dict) -> str:
    """How often the warm-up's samples get the held-out sums right, where it was measured (warm-ups from before
    were not): the sums PPO can learn from are those with a right sample."""
    if "pass_at_samples" not in warm:
        return ""
    return (
        f"; sampled at temperature 1, {warm['sampled_accuracy']:.1%} of the responses are right and"
        f" {warm['pass_at_samples']:.1%} of the sums have one right in {warm['settings']['samples']}"
        f" ({_bands(warm['pass_at_samples_by_digits'])})"
    )


def _time_to(seeds: dict, level: float, base_minutes, at_minutes, system: str) -> str:
    """The cells seeds at ``level``, step, minutes (``at_minutes``, ``clock``'s) and minutes against upstream
    sync's ``base_minutes``."""
    hits = [(i, at_minutes(system, steps)[i]) for steps in seeds.values() if (i := reached(steps, level)) is not None]
    own = _minutes_to_target(seeds, level, at_minutes, system)
    return (
        f"{len(hits)}/{len(seeds)} | {_spread([i + 1 for i, _ in hits], '.0f')}"
        f" | {_spread([m for _, m in hits], '.1f')} | {f'{own / base_minutes:.2f}x' if own and base_minutes else '-'}"
    )


def sync_end_level(runs: dict):
    """The accuracy every seed of upstream sync ended at (the lowest of their last smoothed accuracies), or None
    where it is not above where every seed started: then it was there from the first steps, and reaching it says
    nothing."""
    seeds = runs.get(BASELINE, {}).values()
    if not seeds:
        return None
    level = min(accuracy(s)[-1] for s in seeds)
    return level if level > max(accuracy(s[:SMOOTHING])[-1] for s in seeds) else None


def sync_end_table(runs: dict, level: float, at_minutes) -> list:
    """Per system, the step and minutes (``at_minutes``, ``clock``'s) at which its seeds first reach upstream sync's
    end accuracy ``level`` (``sync_end_level``), means over the seeds (lowest-highest)."""
    base = _minutes_to_target(runs[BASELINE], level, at_minutes, BASELINE)
    lines = [
        f"Time to upstream sync's end accuracy ({level:.1%}, the lowest of its seeds' last {SMOOTHING}-step means;"
        " the sampled responses' accuracy as above), means over the seeds (lowest-highest).",
        "",
        "| system | seeds there | step there | minutes there | minutes vs sync |",
        "|---|---|---|---|---|",
    ]
    for system, seeds in runs.items():
        if seeds:  # a failed system: the first table says so
            lines.append(f"| {system} | {_time_to(seeds, level, base, at_minutes, system)} |")
    return lines


def heldout_table(results: dict) -> list:
    """Per system, the held-out accuracy at the first and the last step evaluated in every run (upstream async's
    last evaluation can fall after its run ends), and the first evaluation at or above the target (its step and
    minutes), means over the seeds (lowest-highest)."""
    target, runs = results["task"]["target"], runs_by_system(results)
    at_minutes, _ = clock(results)
    # Per system and seed: step index -> held-out accuracy.
    evaluations = {system: [dict(heldout(steps)) for steps in seeds.values()] for system, seeds in runs.items()}
    common = sorted(set.intersection(*(set(e) for per_seed in evaluations.values() for e in per_seed)))
    # The sums evaluated (OpenRLHF's --data.max_samples caps the eval set as well as the training set).
    evaluated = max(s.get("eval/eval_num_samples", 0) for seeds in runs.values() for r in seeds.values() for s in r)
    every = results["settings"].get("eval_every")
    lines = [
        f"Held-out accuracy (greedy, the same {evaluated:.0f} sums for every system"
        + (f", every {every} steps" if every else "")
        + f"), means over the seeds (lowest-highest); target {target:.0%}.",
        "",
        "| system | "
        + (f"step {common[0] + 1} | step {common[-1] + 1}" if common else "first evaluation | last evaluation")
        + " | seeds at target | step to target | minutes to target | minutes vs sync |",
        "|---|---|---|---|---|---|---|",
    ]

    def first_hit(evaluated):
        return next((i for i, value in evaluated.items() if value >= target), None)

    hits = {
        system: [
            (i, at_minutes(system, steps)[i])
            for steps, evaluated in zip(seeds.values(), evaluations[system])
            if (i := first_hit(evaluated)) is not None
        ]
        for system, seeds in runs.items()
    }
    minutes_to = {
        system: statistics.mean(m for _, m in hits[system])
        for system, seeds in runs.items()
        if seeds and len(hits[system]) == len(seeds)
    }
    base = minutes_to.get(BASELINE)
    for system, seeds in runs.items():
        if not seeds:
            continue  # failed: the first table says so
        first, last = ([e[common[k]] for e in evaluations[system]] for k in (0, -1)) if common else ([], [])
        own = minutes_to.get(system)
        lines.append(
            f"| {system} | {_spread(first, '.1%')} | {_spread(last, '.1%')} | {len(hits[system])}/{len(seeds)}"
            f" | {_spread([i + 1 for i, _ in hits[system]], '.0f')} | {_spread([m for _, m in hits[system]], '.1f')}"
            f" | {f'{own / base:.2f}x' if own and base else '-'} |"
        )
    return lines


def _minutes_to_target(seeds: dict, target: float, at_minutes, system: str):
    """The mean over the seeds of the minutes (``at_minutes``, ``clock``'s) to the target, if every seed reached
    it."""
    hits = [reached(steps, target) for steps in seeds.values()]
    if not seeds or None in hits:
        return None
    return statistics.mean(at_minutes(system, steps)[i] for steps, i in zip(seeds.values(), hits))


def _spread(values: list, spec: str) -> str:
    if not values:
        return "-"
    mean = format(statistics.mean(values), spec)
    if len(values) == 1:
        return mean
    return f"{mean} ({format(min(values), spec)}-{format(max(values), spec)})"


def reward(steps: list) -> list:
    """The smoothed mean reward at each step (``rollout/reward_mean``: the task's reward, before any KL penalty)."""
    raw = [s.get("rollout/reward_mean", float("nan")) for s in steps]
    return [statistics.mean(raw[max(0, i - SMOOTHING + 1) : i + 1]) for i in range(len(raw))]


def clock(results: dict) -> tuple:
    """``(minutes(system, steps), axis label)``: wall-clock minutes at the end of each step, from the step times
    measured alone where the results have them (runs that shared the machine), else as the run's steps took."""
    alone = alone_step_seconds(results)
    if alone:
        return (
            lambda system, steps: [(i + 1) * alone.get(system, math.nan) / 60 for i in range(len(steps))],
            "minutes at the step time measured alone",
        )
    return (lambda system, steps: minutes(steps)), "wall-clock minutes from the first step"


def plot(results: dict, by_step_path: str, by_time_path: str, curve=None, what: str = "accuracy") -> None:
    """``curve`` (default: the smoothed accuracy; ``reward``) against step and against wall-clock minutes
    (``clock``): per system the mean over the seeds, and a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = {system: seeds for system, seeds in runs_by_system(results).items() if seeds}
    target, curve = results["task"]["target"], curve or accuracy
    at_minutes, time_label = clock(results)
    for path, by_time in ((by_step_path, False), (by_time_path, True)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system, seeds in runs.items():
            curves = [curve(steps) for steps in seeds.values()]
            if by_time:
                # Seeds' steps end at different times: each curve on a common grid, where every seed has steps.
                ends = [at_minutes(system, steps) for steps in seeds.values()]
                if any(math.isnan(m[-1]) for m in ends):
                    continue  # no step time measured alone for this system
                grid = np.linspace(max(m[0] for m in ends), min(m[-1] for m in ends), 200)
                curves = [np.interp(grid, m, c) for m, c in zip(ends, curves)]
                x = grid
            else:
                x = np.arange(1, min(len(c) for c in curves) + 1)
            low, mean, high = band(curves)
            (line,) = ax.plot(x, mean, label=f"{system} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
            points = [heldout(steps) for steps in seeds.values()] if what == "accuracy" else [[]]
            count = min(len(p) for p in points)
            if count:  # the held-out accuracy, mean over the seeds, at each evaluation
                where = [
                    at_minutes(system, steps) if by_time else range(1, len(steps) + 1) for steps in seeds.values()
                ]
                at = [statistics.mean(w[p[k][0]] for w, p in zip(where, points)) for k in range(count)]
                values = [statistics.mean(p[k][1] for p in points) for k in range(count)]
                ax.plot(at, values, ls=":", marker="o", ms=3, color=line.get_color(), label=f"{system}, held-out")
        if what == "accuracy":
            ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.0%}")
            ax.set_ylabel(f"accuracy\nsampled ({SMOOTHING}-step mean); dotted: held-out, greedy")
        else:
            ax.set_ylabel(f"mean {what} of the trained responses\n({SMOOTHING}-step mean)")
        ax.set_xlabel(time_label if by_time else "PPO step")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(
            f"{_run_label(results)}, {results['settings']['placement']}: mean and range over seeds", fontsize=9
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def plot_lag(results: dict, path: str) -> None:
    """The policy lag (mean and most per step) and the groups carried into the next step, per step: per system the
    mean over the seeds, with a band from the lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = {system: seeds for system, seeds in runs_by_system(results).items() if seeds}
    keys = ((LAG, "policy lag, mean (versions)"), ("oppo/policy_lag_max", "policy lag, most (versions)"))
    keys += (("oppo/carried_groups", "groups carried into the next step"),)
    fig, axes = plt.subplots(1, len(keys), figsize=(14, 3.8), sharex=True)
    for ax, (key, label) in zip(axes, keys):
        for system, seeds in runs.items():
            curves = [[s.get(key, 0.0) for s in steps] for steps in seeds.values()]
            count = min(len(c) for c in curves)
            values = np.array([c[:count] for c in curves], dtype=float)
            x = np.arange(1, count + 1)
            (line,) = ax.plot(x, values.mean(axis=0), label=system, lw=1.2)
            if len(curves) > 1:
                ax.fill_between(x, values.min(axis=0), values.max(axis=0), color=line.get_color(), alpha=0.2)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel("PPO step")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{_run_label(results)}: how far behind the trained samples were, mean and range over seeds", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# What the policy does besides its accuracy, per step: (logged key, axis label, log scale).
SIGNALS = (
    ("rollout/reward_mean", "mean reward (what the policy\nlearns from; --credit)", False),
    ("group_reward_std", "reward's spread within a prompt's\nsamples (group_norm's signal)", False),
    ("response_length", "response length (tokens)", False),
    ("kl", "KL to the reference model\n(absolute value)", True),
    ("vllm_kl", "vllm_kl, absolute value (vLLM's\nlog-prob minus the policy's)", True),
    ("first_token_end", "share of responses that are\nthe end of text alone", False),
)


def plot_signals(results: dict, path: str) -> None:
    """The reward and its spread within each prompt's samples (what group_norm learns from), response length, KL
    to the reference, vLLM's log-probs against the policy's, and the responses that end at their first token,
    per step: a policy drifting away from the task shows here before its accuracy falls. Per system the mean over
    the seeds, with a band from the lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = {system: seeds for system, seeds in runs_by_system(results).items() if seeds}
    fig, axes = plt.subplots(2, 3, figsize=(14, 6), sharex=True)
    for ax, (key, label, log) in zip(axes.flat, SIGNALS):
        plotted = False
        for system, seeds in runs.items():
            curves = [[s.get(key, float("nan")) for s in steps] for steps in seeds.values()]
            count = min(len(c) for c in curves)
            values = np.array([c[:count] for c in curves], dtype=float)
            if np.isnan(values).all():  # not logged (older runs have no first_token_end)
                continue
            if log:  # a KL estimate can be slightly negative, or zero, where nothing moved
                values = np.clip(np.abs(values), 1e-6, None)
            plotted = True
            x = np.arange(1, count + 1)
            (line,) = ax.plot(x, np.nanmean(values, axis=0), label=system, lw=1.2)
            if len(curves) > 1:
                ax.fill_between(
                    x, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=line.get_color(), alpha=0.2
                )
        ax.set_ylabel(label, fontsize=8)
        if log and plotted:
            ax.set_yscale("log")
        if not plotted:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("PPO step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{_run_label(results)}: what the policy does, mean and range over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_digits(results: dict, path: str) -> None:
    """The sampled accuracy per step on each band of the longer number's digits (``band_accuracy``), and the band's
    share of the samples: which sums each system learned. Per system the mean over the seeds, with a band from the
    lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = {system: seeds for system, seeds in runs_by_system(results).items() if seeds}
    fig, axes = plt.subplots(1, len(addition.DIGIT_BANDS), figsize=(13, 3.8), sharey=True)
    for ax, digits in zip(axes, addition.DIGIT_BANDS):
        for system, seeds in runs.items():
            curves = [band_accuracy(steps, digits) for steps in seeds.values()]
            count = min(len(c) for c in curves)
            values = np.array([c[:count] for c in curves], dtype=float)
            x = np.arange(1, count + 1)
            share = band_share(seeds, digits)
            (line,) = ax.plot(x, np.nanmean(values, axis=0), label=f"{system} ({share:.0%} of the samples)", lw=1.2)
            if len(curves) > 1:
                ax.fill_between(
                    x, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=line.get_color(), alpha=0.2
                )
        ax.set_title(f"sums of {addition.band_name(digits)} digits")
        ax.set_xlabel("PPO step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel(f"accuracy of the sampled responses\n({SMOOTHING}-step window)")
    fig.suptitle(f"{_run_label(results)}: accuracy by the digits of the sum's longer number", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_label(results: dict) -> str:
    """The task, the model's shape and the GPUs, as the plots' titles name a run."""
    gpus = results["machine"]["gpus"]
    return f"{results['task']['name']}, {results['settings']['shape']}, {len(gpus)}x {gpus[0] if gpus else 'CPU'}"


# -- runs that ended before the benchmark wrote their results ------------------------------------------------------

STEP_LOGS = "steps-*.json.gz"


def write_step_logs(folder: str, tb_dirs: list) -> None:
    """Keep each run's per-step log, read from the tensorboard folder OpenRLHF's logger wrote (``report.read_steps``),
    as ``steps-SYSTEM-seedN.json.gz`` in ``folder``: what is left of a learning run whose process ended before the
    benchmark wrote its ``results.json``. Each tensorboard folder's name is the run's, ``SYSTEM-seedN``."""
    from openrlhf_oppo.bench.report import read_steps

    for tb_dir in tb_dirs:
        name = os.path.basename(os.path.normpath(tb_dir))
        _system_and_seed(name)  # refuse a name the tables could not read back
        path = os.path.join(folder, f"steps-{name}.json.gz")
        with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as packed:
            packed.write(json.dumps(read_steps(tb_dir)).encode())


def _system_and_seed(name: str) -> tuple:
    match = re.fullmatch(r"(.+)-seed(\d+)", name)
    if not match:
        raise ValueError(f"{name}: a run's per-step log is named SYSTEM-seedN")
    return match.group(1), int(match.group(2))


def read_step_logs(folder: str) -> dict:
    """system -> {seed: steps} from ``folder``'s per-step logs (``write_step_logs``), sync first, each run cut to
    the steps that every run logged, so that the first and the last tenth are the same steps in every run."""
    runs = {BASELINE: {}}
    for path in sorted(glob.glob(os.path.join(folder, STEP_LOGS))):
        system, seed = _system_and_seed(os.path.basename(path).removeprefix("steps-").removesuffix(".json.gz"))
        with gzip.open(path, "rt") as f:
            runs.setdefault(system, {})[seed] = json.load(f)
    common = min(len(steps) for seeds in runs.values() for steps in seeds.values())
    return {system: {seed: steps[:common] for seed, steps in seeds.items()} for system, seeds in runs.items()}


PHASES = ("generation", "end_of_generation", "make_experience", "ppo_train", "broadcast", "step_total")


def phase_table(runs: dict, skip: int = 5, alone: bool = False) -> list:
    """Per system, the mean seconds of each timed phase of a step (``timing/*``), over every seed's steps after the
    first ``skip`` (the plan's first window, while Delta comes down). With the runs side by side on one GPU, they
    say where a system's step goes, not how long it takes; ``alone``: the runs that measured the step alone."""
    where = "each system's step measured alone on the machine" if alone else "with the runs sharing the GPU"
    lines = [
        f"Seconds per step by phase (`timing/*`), means over every seed's steps"
        f" {'but the first' if skip == 1 else f'after the first {skip}'}, {where}.",
        "",
        "| system | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for system, seeds in runs.items():
        steps = [s for per_seed in seeds.values() for s in per_seed[skip:]]
        cells = []
        for phase in PHASES:
            seconds = [s[f"timing/{phase}"] for s in steps if f"timing/{phase}" in s]
            cells.append(f"{statistics.mean(seconds):.2f}" if seconds else "-")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def step_logs_table(folder: str) -> str:
    """The tables of a folder of per-step logs (``read_step_logs``): the rise, the same curve against upstream
    sync's band (no step times alone, so no minutes), the phases of a step, the lag and the lengths trained."""
    runs = read_step_logs(folder)
    lines = [*tenths_table(runs), "", *same_curve_table(runs, {}), "", *phase_table(runs)]
    if logs_lag(runs):
        lines += ["", *lag_table(runs, plotted=False)]
    if any(logs_lengths(seeds) for seeds in runs.values()):
        lines += ["", *length_table(runs)]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(
        description="The learning tables of a folder of per-step logs: runs that ended before the benchmark wrote"
        " their results.json."
    )
    parser.add_argument("folder")
    parser.add_argument(
        "--tensorboard",
        action="append",
        default=[],
        help="a run's tensorboard folder, named SYSTEM-seedN, to keep in the folder first (repeat)",
    )
    args = parser.parse_args()
    if args.tensorboard:
        write_step_logs(args.folder, args.tensorboard)
    sys.stdout.write(step_logs_table(args.folder))


if __name__ == "__main__":
    main()
