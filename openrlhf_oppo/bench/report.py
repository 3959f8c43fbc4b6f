"""Tables and plots from ``results.json`` (written by ``python -m openrlhf_oppo.bench``).

    python -m openrlhf_oppo.bench.report runs/2gpu/results.json [more results files or run folders] --out runs/2gpu
    python -m openrlhf_oppo.bench.report --pack docs/results/NAME/
    python -m openrlhf_oppo.bench.report --section docs/results/NAME/
    python -m openrlhf_oppo.bench.report --summary docs/results/*/ > docs/RESULTS.md

The first writes ``table.md`` and the plots of one run (several results files of one machine are merged).
``--pack`` stores a run folder as docs/results keeps it: its raw results gzipped (``results.json.gz``, the same
JSON), without ``table.md`` and the plots, which its README shows or ``--out`` redraws. ``--section`` prints a
run's README.md: a heading, a line to replace with what the run measures and shows, then the command that made
it, links to its files and its tables. ``--summary`` prints the results page: per placement, one row per speed
run (each system's step time and its ratios against upstream sync and async of the same run), then one per
learning run, and links to the other measurements.

Where an OPPO system and an upstream baseline trained the same samples at some measured steps, a table
compares their steps there (equal work; over all measured steps, OPPO with a large Delta trains the short
responses first). Runs of 10 steps or more also get a convergence table (reward per step, time to a target reward) and
plot; runs with the harness's NVML samples get each GPU's busy share before training, in training and in the
weight sync; runs that logged ``oppo/memory/*`` get a memory table and plot (every actor's memory per step), and
runs with host CPU samples or ``oppo/cpu/*`` a CPU table. Runs of the learning benchmark (``--task``) get
their own table and plots (``learning_report.py``).
A step's time is the wall time between its log and the previous step's (all phases, queue waits and
whatever else happened). The phases are OpenRLHF's own ``timing/*``; under OPPO's inter-step overlap
and upstream's async mode, generation overlaps training, so phases need not add up to the step.
"""

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys

from openrlhf_oppo.bench import learning_report

PHASES = ("generation", "make_experience", "ppo_train", "broadcast")
FIRST_STEP_OUTLIER = 1.5
OPPO_KEYS = (
    "prefill_hidden_fraction",
    "last_token_to_experience_s",
    "chunk_size",
    "overcommit",
    "carried_groups",
    "bth_group_done_s",
    "policy_lag_mean",
    "fallback_micro_batches",
)
# What ``write`` draws: ``pack`` leaves them out of a published run folder, ``--out`` redraws them.
PLOTS = (
    "breakdown.png",
    "timeline.png",
    "convergence.png",
    "memory.png",
    "accuracy-by-step.png",
    "accuracy-by-time.png",
    "signals-by-step.png",
    "accuracy-by-digits.png",
    "reward-by-step.png",
    "reward-by-time.png",
    "lag-by-step.png",
)


def read_steps(tb_dir: str) -> list:
    """One dict per logged step: its ``train/*`` scalars, ``eval/*`` ones where it was followed by an
    evaluation, and ``start``/``end`` wall times. A step ends with its training log; an evaluation's log time is
    ``eval_end`` (upstream async logs the evaluation of one step after the training log of the next)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_step = {}
    for events in sorted(glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True)):
        accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            end = "eval_end" if tag.startswith("eval/") else "end"
            for event in accumulator.Scalars(tag):
                step = by_step.setdefault(event.step, {"step": event.step, "end": 0.0})
                step[tag.removeprefix("train/")] = event.value
                step[end] = max(step.get(end, 0.0), event.wall_time)
    steps = [by_step[k] for k in sorted(by_step)]
    for previous, step in zip([None] + steps, steps):
        step["start"] = previous["end"] if previous else step["end"] - step.get("timing/step_total", 0.0)
        step["wall_s"] = step["end"] - step["start"]
    return steps


def summarize(steps: list) -> dict:
    if not steps:
        return {}
    walls = sorted(s["wall_s"] for s in steps)
    summary = dict(
        steps=len(steps),
        step_mean_s=statistics.mean(walls),
        step_p50_s=statistics.median(walls),
        step_p90_s=walls[min(len(walls) - 1, round(0.9 * (len(walls) - 1)))],
    )
    for phase in PHASES:
        summary[f"{phase}_s"] = statistics.mean(s.get(f"timing/{phase}", 0.0) for s in steps)
    summary["other_s"] = summary["step_mean_s"] - sum(summary[f"{p}_s"] for p in PHASES)
    tokens = sum(s.get("rollout/num_samples", 0) * s.get("rollout/response_length_mean", 0) for s in steps)
    summary["tokens_per_s"] = tokens / sum(walls)
    summary["reward_mean"] = statistics.mean(s.get("rollout/reward_mean", 0.0) for s in steps)
    for key in OPPO_KEYS:
        values = [s[f"oppo/{key}"] for s in steps if f"oppo/{key}" in s]
        if values:
            summary[key] = statistics.mean(values)
    return summary


def trained_tokens(summary: dict) -> float:
    """Response tokens trained in the measured steps. OPPO's inter-step overlap trains each step's first B
    groups to finish, so its first steps hold the short responses and later ones the long: over a few steps,
    two systems' windows can hold different work. Their tokens/s compares them at equal work."""
    return summary["tokens_per_s"] * summary["step_mean_s"] * summary["steps"]


def _speedup_cell(base: dict, summary: dict) -> str:
    return " / ".join(_speedups(base, summary)) if base else "-"


def _baselines(systems: dict) -> dict:
    """Upstream sync's and async's summaries (empty where the run has none), the ratios' denominators."""
    bases = {kind: systems.get(f"upstream-{kind}", {}).get("summary") or {} for kind in ("sync", "async")}
    # Upstream sync with the states on the GPU is the stronger one where the run has it (on one GPU).
    states_on_gpu = systems.get("upstream-sync-states-on-gpu", {}).get("summary")
    if states_on_gpu and (not bases["sync"] or states_on_gpu["step_mean_s"] < bases["sync"]["step_mean_s"]):
        bases["sync"] = states_on_gpu
    return bases


def _speedups(base: dict, summary: dict) -> tuple:
    """Against ``base``: its step time over ``summary``'s, and ``summary``'s tokens/s over its."""
    return (
        _ratio_x(base.get("step_mean_s"), summary["step_mean_s"]),
        _ratio_x(summary["tokens_per_s"], base.get("tokens_per_s")),
    )


def _micro_batches(settings: dict) -> str:
    """Runs made before the micro-batch options existed used the benchmark's 8 (rollout) and 2 (training)."""
    if "train_micro_batch" not in settings:
        return ""
    return f" · micro-batches: {settings['rollout_micro_batch']} rollout, {settings['train_micro_batch']} training"


def table(results: dict) -> str:
    if "task" in results:  # the learning benchmark
        return learning_report.table(results)
    systems = results["systems"]
    baselines = _baselines(systems)
    base_util = _mean(systems.get("upstream-sync", {}).get("gpu_utilization", []))
    lines = [
        f"GPUs: {', '.join(results['machine']['gpus']) or 'none'} · placement: {results['settings']['placement']}"
        f" · shape: {results['settings']['shape']} · batch: {results['settings']['batch']} prompts"
        f" x {results['settings']['n_samples']}{_micro_batches(results['settings'])}"
        f" · measured steps: {results['settings']['steps']}"
        f" (after {results['settings']['warmup']} warm-up) · workload: {results['workload']['distribution']}"
        f" mean {results['workload']['mean_length']:.0f}, max {results['workload']['max_length']} tokens"
        + (" · OpenRLHF with patches/openrlhf applied" if results.get("upstream_patches") else ""),
        "",
        "| system | step mean (s) | p50 | p90 | generation | make_exp | train | weight sync | other | tokens trained"
        " | tokens/s | GPU util % | busiest GPU busy (s) | step / bound | step / phase bound"
        " | vs sync (step / tokens/s) | vs async (step / tokens/s) | util vs sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in systems.items():
        s = result.get("summary") or {}
        if not s:
            lines.append(f"| {name} | {_failed(result, results['settings']['steps'])} |" + " |" * 16)
            continue
        util = result.get("gpu_utilization", [])
        util_ratio = f"{_mean(util) / base_util:.2f}x" if base_util and util else "-"
        bound = busiest_gpu_s(s, util)
        phases = phase_bound_s(s, bound, results["settings"]["placement"])
        lines.append(
            f"| {name} | {s['step_mean_s']:.2f} | {s['step_p50_s']:.2f} | {s['step_p90_s']:.2f}"
            f" | {s['generation_s']:.2f} | {s['make_experience_s']:.2f} | {s['ppo_train_s']:.2f}"
            f" | {s['broadcast_s']:.2f} | {s['other_s']:.2f} | {trained_tokens(s):.0f} | {s['tokens_per_s']:.0f}"
            f" | {' / '.join(f'{u:.0f}' for u in util) or '-'} | {_fmt(bound)} | {_ratio(s['step_mean_s'], bound)}"
            f" | {_ratio(s['step_mean_s'], phases)}"
            f" | {_speedup_cell(baselines['sync'], s)} | {_speedup_cell(baselines['async'], s)} | {util_ratio} |"
        )
    notes = first_step_notes(results)
    if notes:
        lines += ["", *notes]
    busy = phase_busy_table(results)
    if busy:
        lines += ["", *busy]
    oppo = [(n, r["summary"]) for n, r in systems.items() if r.get("summary") and n.startswith("oppo")]
    if oppo:
        lines += ["", "| OPPO system | " + " | ".join(OPPO_KEYS) + " |", "|---|" + "---|" * len(OPPO_KEYS)]
        for name, s in oppo:
            lines.append(f"| {name} | " + " | ".join(_fmt(s.get(k)) for k in OPPO_KEYS) + " |")
    same = same_samples_table(results)
    if same:
        lines += ["", *same]
    if is_convergence(results):
        lines += ["", *convergence_table(results)]
    if any(memory_keys(r) for r in systems.values()):
        lines += ["", *memory_table(results)]
    if any(r.get("cpu_samples") or cpu_keys(r) for r in systems.values()):
        lines += ["", *cpu_table(results)]
    return "\n".join(lines) + "\n"


def measured_steps(results: dict, result: dict) -> list:
    """A system's measured steps: those after the warm-up, as many as the run measured."""
    warmup, count = results["settings"]["warmup"], results["settings"]["steps"]
    return (result.get("steps") or [])[warmup : warmup + count]


def first_step_notes(results: dict) -> list:
    """A line for each system whose first measured step took at least ``FIRST_STEP_OUTLIER`` times the median of
    its other measured steps: a one-time cost (a first state offload, a compile) may have fallen in it and
    weighs on its mean."""
    notes = []
    for name, result in results["systems"].items():
        walls = [step["wall_s"] for step in measured_steps(results, result)]
        if len(walls) < 3 or not result.get("summary"):
            continue
        others = statistics.median(walls[1:])
        if walls[0] >= FIRST_STEP_OUTLIER * others:
            notes.append(
                f"- {name}: the first measured step took {walls[0]:.2f} s, {walls[0] / others:.1f}x the median of the"
                f" others ({others:.2f} s); a one-time cost may have fallen in it (more `--warmup` steps leave it out)."
            )
    return notes


def phase_spans(step: dict) -> dict:
    """A step's wall time in three spans, counted back from its end: the weight sync, training before it, and
    all before training (generation and make_experience, or whatever the trainer waited for where generation
    overlaps training)."""
    sync_start = step["end"] - step.get("timing/broadcast", 0.0)
    train_start = max(step["start"], sync_start - step.get("timing/ppo_train", 0.0))
    return {
        "before training": (step["start"], train_start),
        "training": (train_start, sync_start),
        "weight sync": (sync_start, step["end"]),
    }


def phase_busy_table(results: dict) -> list:
    """Per system, the share of each span of the measured steps (``phase_spans``) in which each GPU ran kernels,
    from the harness's NVML samples. Training's own share says how much of the gap between a step and its
    bound (the busiest GPU's kernel time) lies between training's kernels, where no overlap can reach."""
    rows = []
    for name, result in results["systems"].items():
        samples, steps = result.get("gpu_samples"), measured_steps(results, result)
        if not samples or not result.get("summary"):
            continue
        by_step = [phase_spans(step) for step in steps]
        cells = []
        for phase in ("before training", "training", "weight sync"):
            spans = [step_spans[phase] for step_spans in by_step]
            inside = [util for t, util, _ in samples if any(start <= t < end for start, end in spans)]
            cells.append(" / ".join(f"{sum(gpu) / len(inside):.0f}" for gpu in zip(*inside)) if inside else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "| system | GPU busy % before training | GPU busy % in training | GPU busy % in the weight sync |",
        "|---|---|---|---|",
        *rows,
    ]


def _trained(step: dict):
    """What a step trained, as far as the log tells: its sample count and mean response length (None where it
    did not log them). The benchmark's requests have fixed lengths and every system sees the prompts in one
    order, so two steps with equal figures trained the same samples."""
    if "rollout/num_samples" not in step or "rollout/response_length_mean" not in step:
        return None
    return step["rollout/num_samples"], round(step["rollout/response_length_mean"], 3)


def same_samples_table(results: dict) -> list:
    """For each OPPO system against each upstream baseline, the measured steps at which both trained the same
    samples, and the mean step of each over those steps. With a large Delta OPPO's first steps train the short
    responses and later ones the long, so the means over all measured steps compare different work; on these
    steps the work is equal."""
    measured = {name: measured_steps(results, r) for name, r in results["systems"].items() if r.get("summary")}
    rows = []
    for name, steps in measured.items():
        if not name.startswith("oppo"):
            continue
        for base in ("upstream-sync", "upstream-async"):
            pairs = [(o, b) for o, b in zip(steps, measured.get(base, [])) if (t := _trained(o)) and t == _trained(b)]
            if pairs:
                oppo_s = statistics.mean(o["wall_s"] for o, _ in pairs)
                base_s = statistics.mean(b["wall_s"] for _, b in pairs)
                which = f"all {len(steps)}" if len(pairs) == len(steps) else f"{len(pairs)} of {len(steps)}"
                if len(pairs) < len(steps):
                    which += " (" + ", ".join(str(o["step"]) for o, _ in pairs) + ")"
                rows.append(f"| {name} | {base} | {which} | {oppo_s:.2f} | {base_s:.2f} | {base_s / oppo_s:.2f}x |")
    if not rows:
        return []
    return [
        "| OPPO system | against | measured steps with the same samples (global step) | OPPO step (s)"
        " | its step (s) | speed-up |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def cpu_keys(result: dict) -> list:
    """The ``oppo/cpu/*`` metrics (CPU seconds an actor used in a step), ``oppo/<role>_fit_s`` (a model's own
    training), ``oppo/busy_s/<role>`` (a role's busiest scorer's time in prefill) and ``oppo/state_moves_wait_s``
    (training's wait on DeepSpeed's state moves, ``--oppo.state_moves overlap``) a system logged, in a stable
    order."""
    return sorted(
        {
            k
            for step in result.get("steps") or []
            for k in step
            if k.startswith(("oppo/cpu/", "oppo/busy_s/")) or k.endswith("_fit_s") or k == "oppo/state_moves_wait_s"
        }
    )


def _cpu_label(key: str) -> str:
    if key.startswith("oppo/cpu/"):
        return f"{key.removeprefix('oppo/cpu/').removesuffix('_s')} CPU s a step"
    if key.startswith("oppo/busy_s/"):
        return f"{key.removeprefix('oppo/busy_s/')} scoring (s)"
    if key == "oppo/state_moves_wait_s":
        return "wait on state moves (s)"
    return f"{key.removeprefix('oppo/').removesuffix('_fit_s')} fit (s)"


def _logged_by(result: dict, key: str) -> bool:
    """Whether the run's own flags log ``key``. A system run twice in one scratch folder under two tags shared
    one log folder before the harness emptied it first: the second run's steps then hold the keys that only the
    first logged (``oppo/state_moves_wait_s``, in the colocated runs with and without ``--oppo.state_moves``)."""
    if key != "oppo/state_moves_wait_s":
        return True
    flags = " ".join(result.get("flags") or []).replace("=", " ").split()
    return any(flag == "--oppo.state_moves" and value == "overlap" for flag, value in zip(flags, flags[1:]))


def cpu_table(results: dict) -> list:
    """Per system, how many of the host's cores were busy over the measured steps (the harness's samples), and
    for OPPO systems the CPU seconds each actor used a step (its busiest rank; the rollout actor's include its
    vLLM engine core), each model's own training time and each role's scoring time (its busiest rank's prefill
    calls): a host short of cores slows every process on it, training included, and the training phase is the
    longer of the two models' fits plus the calls."""
    keys = sorted({k for r in results["systems"].values() for k in cpu_keys(r)})
    header = ["system", "host cores busy, mean", "p90", *map(_cpu_label, keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, result in results["systems"].items():
        busy = sorted(cores for _, cores in result.get("cpu_samples") or [])
        steps = measured_steps(results, result)
        per_key = [[s[key] for s in steps if key in s and _logged_by(result, key)] for key in keys]
        cells = [
            name,
            _fmt(statistics.mean(busy) if busy else None),
            _fmt(busy[int(0.9 * (len(busy) - 1))] if busy else None),
            *(_fmt(statistics.mean(values) if values else None) for values in per_key),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_keys(result: dict) -> list:
    """The ``oppo/memory/*`` metrics (GiB) a system logged, in a stable order."""
    return sorted({k for step in result.get("steps") or [] for k in step if k.startswith("oppo/memory/")})


def memory_table(results: dict) -> list:
    """Per OPPO system and actor, its memory at the first measured step, the most over the run and at the
    last step: a long run with carried requests across every weight sync shows whether anything grows."""
    warmup = results["settings"]["warmup"]
    lines = [
        "| system | oppo/memory/* (GiB; retries: a count) | first measured step | max | last step | last - first |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results["systems"].items():
        steps = (result.get("steps") or [])[warmup:]
        for key in memory_keys(result):
            values = [step[key] for step in steps if key in step]
            if values:
                label = key.removeprefix("oppo/memory/")
                lines.append(
                    f"| {name} | {label} | {values[0]:.2f} | {max(values):.2f} | {values[-1]:.2f}"
                    f" | {values[-1] - values[0]:+.2f} |"
                )
    return lines


def busiest_gpu_s(summary: dict, utilization: list):
    """The step's bound: seconds per step that the busiest GPU ran kernels (NVML's busy fraction over the
    measured steps times the mean step). A step cannot be shorter; "step / bound" says how close it came."""
    if not utilization:
        return None
    return max(utilization) / 100 * summary["step_mean_s"]


def phase_bound_s(summary: dict, busiest_s, placement: str) -> float:
    """The step's bound from the time each GPU is taken by the step's work rather than by kernels alone: the
    models' GPUs are taken through make_experience, training and the weight sync (one after the other in every
    system; colocated, generation too), the vLLM GPUs at least for their kernel time. Training's own gaps
    between kernels count as taken, so "step / phase bound" is the slack that overlap can remove."""
    taken = summary["make_experience_s"] + summary["ppo_train_s"] + summary["broadcast_s"]
    if placement == "colocated":
        taken += summary["generation_s"]
    return max(taken, busiest_s or 0.0)


def _ratio(step_s: float, bound) -> str:
    return f"{step_s / bound:.2f}" if bound else "-"


def convergence_table(results: dict) -> list:
    """Reward per step against the upstream-sync run, and the time each system takes to a target reward.

    The target is halfway from upstream-sync's mean reward over its first 5 steps to that over its last 5
    (none if that rise is within twice the spread of the first 5); a system reaches it at the first step
    whose 3-step moving mean is at or above it. "gap to sync" is the mean over steps of |reward -
    upstream-sync's reward at that step|: for a second upstream seed it is the run-to-run noise that the
    OPPO systems' gaps are to be read against.
    """
    systems = {n: r["steps"] for n, r in results["systems"].items() if len(r.get("steps") or []) >= 5}
    rewards = {n: [s.get("rollout/reward_mean", float("nan")) for s in steps] for n, steps in systems.items()}
    base = rewards.get("upstream-sync")
    target = None
    if base:
        first, last = statistics.mean(base[:5]), statistics.mean(base[-5:])
        rose = last - first > 2 * statistics.pstdev(base[:5])  # a flat curve has no meaningful target
        target = first + (last - first) / 2 if rose else None
    lines = [
        f"Convergence: target reward {_fmt(target)} (halfway from upstream-sync's first 5 steps to its last 5;"
        " none where upstream-sync's reward did not rise)",
        "",
        "| system | steps | reward, first 5 | reward, last 5 | rise | step to target | minutes to target | gap to sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, steps in systems.items():
        curve = rewards[name]
        reached = None
        if target is not None:
            moving = [statistics.mean(curve[max(0, i - 2) : i + 1]) for i in range(len(curve))]
            reached = next((i for i, value in enumerate(moving) if value >= target), None)
        minutes = (steps[reached]["end"] - steps[0]["start"]) / 60 if reached is not None else None
        gap = statistics.mean(abs(a - b) for a, b in zip(curve, base)) if base else None
        first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
        lines.append(
            f"| {name} | {len(curve)} | {first:.4f} | {last:.4f} | {last - first:+.4f}"
            f" | {steps[reached]['step'] if reached is not None else '-'} | {_fmt(minutes)} | {_fmt(gap)} |"
        )
    return lines


def plot_breakdown(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results["systems"].items() if r.get("summary")]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.5))
    for i, name in enumerate(names):
        s, left = results["systems"][name]["summary"], 0.0
        for phase, color in zip(PHASES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52")):
            ax.barh(i, s[f"{phase}_s"], left=left, color=color, label=phase if i == 0 else None)
            left += s[f"{phase}_s"]
        ax.plot(
            [s["step_mean_s"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2, label="step (wall)" if i == 0 else None
        )
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds per step (phases as logged; they overlap under OPPO and async)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(_title(results))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(results: dict, path: str) -> None:
    """Per system, one measured step: each GPU's NVML utilization and the trainer's phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results["systems"].items() if r.get("summary") and r.get("gpu_samples")]
    if not names:
        return
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.8 * len(names) + 0.5), squeeze=False)
    warmup = results["settings"]["warmup"]
    for ax, name in zip(axes[:, 0], names):
        result = results["systems"][name]
        step = result["steps"][warmup]  # the first measured step
        samples = [s for s in result["gpu_samples"] if step["start"] <= s[0] <= step["end"]]
        for gpu in range(len(samples[0][1]) if samples else 0):
            ax.plot([s[0] - step["start"] for s in samples], [s[1][gpu] for s in samples], label=f"GPU {gpu}")
        # The trainer's phases, in the order they run, ending at the step's log.
        end = step["end"] - step["start"]
        for phase, color in reversed(list(zip(PHASES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52")))):
            duration = step.get(f"timing/{phase}", 0.0)
            ax.axvspan(end - duration, end, color=color, alpha=0.15, label=phase)
            end -= duration
        ax.set_ylim(0, 105)
        ax.set_xlim(0, step["end"] - step["start"])
        ax.set_ylabel(name, fontsize=8)
    axes[0, 0].legend(fontsize=7, ncol=6, loc="upper right")
    axes[-1, 0].set_xlabel("seconds into the step (GPU utilization %, NVML)")
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(results: dict, path: str) -> None:
    """Per OPPO system, every actor's memory (``oppo/memory/*``, GiB) against the step: one panel each for
    GPU memory allocated, GPU memory the allocator reserved and host memory (allocation retries, a count, are
    in the memory table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("GPU allocated", "_gpu_gb"), ("GPU reserved", "_gpu_reserved_gb"), ("host", "_host_gb")]
    names = [name for name, result in results["systems"].items() if memory_keys(result)]
    fig, axes = plt.subplots(len(names), 3, figsize=(13, 3 * len(names) + 0.5), squeeze=False)
    for row, name in zip(axes, names):
        steps = results["systems"][name]["steps"]
        for ax, (what, suffix) in zip(row, panels):
            for key in memory_keys(results["systems"][name]):
                if key.endswith(suffix):
                    points = [(s["step"], s[key]) for s in steps if key in s]
                    ax.plot(*zip(*points), label=key.removeprefix("oppo/memory/").removesuffix(suffix))
            ax.set_title(f"{name}: {what} (GiB)", fontsize=8)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("PPO step")
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_convergence(results: dict, path: str) -> None:
    """Mean reward against step and against wall-clock time, every system on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results["systems"].items():
        steps = result.get("steps") or []
        if not steps:
            continue
        rewards = [s.get("rollout/reward_mean", float("nan")) for s in steps]
        start = steps[0]["start"]
        by_step.plot([s["step"] for s in steps], rewards, label=name)
        by_time.plot([(s["end"] - start) / 60 for s in steps], rewards, label=name)
    by_step.set_xlabel("PPO step")
    by_time.set_xlabel("wall-clock minutes")
    by_step.set_ylabel("rollout/reward_mean")
    by_step.legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(results))
    try:
        plot_breakdown(results, os.path.join(out, "breakdown.png"))
        plot_timeline(results, os.path.join(out, "timeline.png"))
        if "task" in results:
            learning_report.plot(
                results, os.path.join(out, "accuracy-by-step.png"), os.path.join(out, "accuracy-by-time.png")
            )
            learning_report.plot(
                results, *(os.path.join(out, f"reward-by-{x}.png") for x in ("step", "time")),
                curve=learning_report.reward, what="reward",
            )  # fmt: skip
            learning_report.plot_signals(results, os.path.join(out, "signals-by-step.png"))
            runs = learning_report.runs_by_system(results)
            if learning_report.logs_lag(runs):
                learning_report.plot_lag(results, os.path.join(out, "lag-by-step.png"))
            if learning_report.logs_digits(runs):
                learning_report.plot_digits(results, os.path.join(out, "accuracy-by-digits.png"))
        elif is_convergence(results):
            plot_convergence(results, os.path.join(out, "convergence.png"))
        if any(memory_keys(r) for r in results["systems"].values()):
            plot_memory(results, os.path.join(out, "memory.png"))
    except ImportError:
        print("matplotlib is not installed: no plots")


def drop_cut_short(results: dict) -> dict:
    """Results as read from results.json, where a system that stopped before all its measured steps (it failed,
    or ran out of time) is shown as failed, with the steps it reached: a mean over those steps, or their memory
    and CPU figures, would be no comparison with systems that ran them all. The file keeps its raw steps. (The
    learning benchmark's table counts the runs of each system that reached their last step itself.)"""
    if "task" in results:
        return results
    for result in results["systems"].values():
        measured = (result.get("summary") or {}).get("steps", 0)
        if measured < results["settings"]["steps"]:
            result.update(summary={}, steps=[], gpu_samples=[], cpu_samples=[], measured_before_failing=measured)
    return results


def _failed(result: dict, steps: int) -> str:
    reached = result.get("measured_before_failing")
    return f"failed (exit {result.get('returncode')}" + (f", {reached} of {steps} steps)" if reached else ")")


def load(path: str) -> dict:
    """A results file: ``results.json`` as the benchmark writes it, or ``results.json.gz`` as ``pack`` stores it."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def raw_files(folder: str) -> list:
    """A run folder's raw results: ``results.json``, or its ``results-*.json`` (systems of one run measured side
    by side on one host), each plain or gzipped. Where a folder holds both forms of one file, the plain one: the
    benchmark wrote it after the folder was packed."""
    for pattern in ("results.json", "results-*.json"):
        found = {}
        for path in sorted(
            glob.glob(os.path.join(folder, pattern)) + glob.glob(os.path.join(folder, pattern + ".gz"))
        ):
            found.setdefault(path.removesuffix(".gz"), path)
        if found:
            return list(found.values())
    return []


def pack(folder: str) -> None:
    """Store a run folder as docs/results keeps it: each raw results file gzipped and without the benchmark's
    indentation (the same JSON, far smaller), and no ``table.md`` or plots, which the run's README shows
    or ``--out`` redraws from the raw results. A file packed already is packed again the same way."""
    for path in raw_files(folder):
        results = load(path)
        packed = path.removesuffix(".gz") + ".gz"
        with gzip.GzipFile(packed, "wb", compresslevel=9, mtime=0) as f:
            f.write(json.dumps(results).encode())
        if packed != path:
            os.remove(path)
    for name in ("table.md", *PLOTS):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))


def gpu_memory_peaks(result: dict) -> list:
    """Per GPU, the most memory in use (GiB, as NVML counts it) over a system's samples, which span from 5 s
    before its first measured step to the end of its last: what every process on the GPU held at the peak.
    Empty where the system has no samples (no NVML, or it stopped short: ``drop_cut_short``)."""
    memory = [used for _, _, used in result.get("gpu_samples") or []]
    return [max(gpu) for gpu in zip(*memory)]


def merge(paths: list) -> dict:
    """Results of several invocations on one machine, systems in order (later ones win a name clash). The
    settings are the first file's, and a learning benchmark's step times alone (``--speed_alone``, a few steps
    without evaluations) come after its learning runs, whatever their files' names, so that they are the runs'."""
    merged = None
    for results in sorted((drop_cut_short(load(path)) for path in paths), key=_speed_alone_only):
        if merged is None:
            merged = results
        else:
            merged["systems"].update(results["systems"])
            merged["command"] += " ; " + results["command"]
    return merged


def _speed_alone_only(results: dict) -> bool:
    return bool(results["systems"]) and all(result.get("alone") for result in results["systems"].values())


def run_results(folder: str) -> dict:
    """A run folder's results (``raw_files``, merged). The code's commit is ``commit.txt`` where the run's folder
    has one (a machine whose checkout lacks the repository's history records a wrong one), else what the results
    say."""
    paths = raw_files(folder)
    if not paths:
        return {}
    results = merge(paths)
    commit_file = os.path.join(folder, "commit.txt")
    if os.path.exists(commit_file):
        results["commit"] = open(commit_file).read().strip()
    return results


def is_convergence(results: dict) -> bool:
    """A run about learning: the learning benchmark, or a run scored by a rule (``--reward.remote_url``) rather
    than the speed benchmark's random reward model, whose reward says nothing however many steps it ran."""
    extra = results.get("settings", {}).get("extra") or []
    return "task" in results or any(flag.startswith("--reward.remote_url") for flag in extra)


PAGE_HEAD = """# Results

<!-- Made by: python -m openrlhf_oppo.bench.report --summary docs/results/*/ > docs/RESULTS.md
     tests/test_report.py checks that it is what the raw results in docs/results give. -->

Every figure here comes from the raw results in [results/](results/): one folder per run, whose README.md has
the command that made it, all its tables and what it shows. Speed runs are grouped by placement, GPUs and model
shape, one row per run; a step is the mean wall time of the measured steps, and each system's ratios are
against upstream sync and upstream async (with partial rollout) of the same run, per step and per trained
response token. *patched*: every system, upstream's included, ran on OpenRLHF with `patches/openrlhf` applied,
the fair comparison; *unpatched*: OpenRLHF as published, whose per-call tokenizer the ratios then include.
What the runs share, what they show together and what is not measured yet:
[results/README.md](results/README.md). Running the benchmark: [benchmark.md](benchmark.md)."""

SPEED_HEADER = (
    "| run | workload | OpenRLHF | card | commit | steps | upstream sync (s) | upstream async (s) | system"
    " | step (s) | vs sync | vs async | tokens/s vs sync | tokens/s vs async |"
)
LEARNING_HEADER = "| run | task | placement | card | commit | steps | system | start | end |"


def summary(folders: list) -> str:
    """The results page (docs/RESULTS.md) of the run folders given: a table of speed runs per placement, GPU
    count and shape, with the command they share; a table of learning runs (the learning benchmark, and speed
    runs scored by a rule); links to the folders measured by scripts of their own."""
    speed, learning, others = {}, [], []
    for folder in folders:
        name = os.path.basename(os.path.normpath(folder))
        results = run_results(folder)
        if not results:
            others.append(name)
        elif is_convergence(results):
            learning.append((name, results))
        else:
            settings = results["settings"]
            speed.setdefault((settings["gpus"], settings["placement"], settings["shape"]), []).append((name, results))
    lines = [PAGE_HEAD, ""]
    for (gpus, placement, shape), runs in sorted(speed.items()):
        lines += [
            f"## {placement.capitalize()}, {gpus} GPU{'s' if gpus > 1 else ''}, {shape}",
            "",
            f"Every run here: `{common_command(results for _, results in runs)}`.",
            "",
            SPEED_HEADER,
            "|---" * 14 + "|",
            *(_speed_row(name, results) for name, results in _newest_first(runs)),
            "",
        ]
    if learning:
        lines += [
            "## Learning",
            "",
            "Sampled accuracy (the learning benchmark: 3-step means at the start and the end, means over the seeds)"
            " or mean reward (a speed run scored by a rule: the first and the last 5 steps), per system.",
            "",
            LEARNING_HEADER,
            "|---" * 9 + "|",
            *(_learning_row(name, results) for name, results in _newest_first(learning)),
            "",
        ]
    if others:
        links = " · ".join(f"[{name}](results/{name}/)" for name in sorted(others))
        lines += ["## Other measurements", "", f"Each with its own script, named in its README: {links}", ""]
    return "\n".join(lines)


# The README's results: (run folder, OPPO system, the flags it was given besides OpenRLHF's own).
HEADLINE = (
    ("colocated-1gpu-1.5b-lognormal-mean700-patched-hybrid-engine-80gb-sync-and-flag-swap", "oppo", "`--oppo.enable`"),
    ("colocated-1gpu-0.5b-lognormal-mean700-patched-hybrid-engine-80gb-sync-and-flag-swap", "oppo", "`--oppo.enable`"),
    ("colocated-1gpu-1.5b-lognormal-mean700-patched-flag-swap", "oppo", "`--oppo.enable`"),
    (
        "split-2gpu-1.5b-lognormal-patched-policy-logprobs-vllm-delta64-defer4-critic-catch-up-next-batch",
        "oppo-both-delta64-defer4-policy-logprobs-vllm-critic-catch-up-next-batch",
        "`oppo-both` `--oppo.overcommit 64 --oppo.max_defer_steps 4 --oppo.policy_logprobs vllm "
        "--oppo.critic_catch_up next_batch`",
    ),
    (
        "split-4gpu-3b-lognormal-patched-8-steps",
        "oppo-both-delta64-policy-logprobs-vllm",
        "`oppo-both` `--oppo.overcommit 64 --oppo.policy_logprobs vllm`",
    ),
    (
        "split-4gpu-7b-lognormal-patched-zero3-offload",
        "oppo-both",
        "`oppo-both` `--oppo.overcommit 32 --oppo.policy_logprobs vllm`",
    ),
)


def headline(results_dir: str) -> str:
    """The README's results table, from the raw results of the runs in ``HEADLINE``."""
    lines = [
        "| run | card | shape | workload | OPPO given | step (s) | vs upstream sync | vs upstream async |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, system, flags in HEADLINE:
        results = run_results(os.path.join(results_dir, name))
        workload, base = results["workload"], _baselines(results["systems"])
        summary_ = results["systems"][system]["summary"]
        ratios = [f"{base[kind]['step_mean_s'] / summary_['step_mean_s']:.2f}x" if base[kind] else "-"
                  for kind in ("sync", "async")]  # fmt: skip
        lines.append(
            f"| [{results['settings']['placement']}](docs/results/{name}/) | {_card(results)} "
            f"| {results['settings']['shape']} | {workload['distribution']}, mean {workload['mean_length']:.0f}, "
            f"max {workload['max_length']} | {flags} | {summary_['step_mean_s']:.2f} | {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(lines)


def _newest_first(runs: list) -> list:
    """Runs against the patched upstream first, then the others, newest first; runs in which every system failed
    come last."""
    runs = sorted(runs, key=lambda run: run[0])
    runs.sort(key=lambda run: run[1].get("date", ""), reverse=True)
    runs.sort(key=lambda run: (not any(r.get("summary") for r in run[1]["systems"].values()), not _patched(run[1])))
    return runs


def _run_cell(name: str) -> str:
    """A link to the run's folder, with the anchor its heading on the page once had: links from before the page
    was a table still lead to its row."""
    anchor = re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")
    return f'<a id="{anchor}"></a>[{name}](results/{name}/)'


def _card(results: dict) -> str:
    gpus = results["machine"]["gpus"]
    return f"{len(gpus)}x {gpus[0].removeprefix('NVIDIA ') if gpus else 'CPU'}"


def _speed_row(name: str, results: dict) -> str:
    """A speed run's row: its settings and baselines' step times, then each other system's step and ratios, one
    line of the cell each."""
    settings, workload, systems = results["settings"], results["workload"], results["systems"]
    base = _baselines(systems)
    cells = [
        _run_cell(name),
        f"{workload['distribution']}, mean {workload['mean_length']:.0f}, max {workload['max_length']}",
        "patched" if _patched(results) else "unpatched",
        _card(results),
        results.get("commit") or "-",
        str(settings["steps"]),
    ]
    for kind in ("sync", "async"):
        result = systems.get(f"upstream-{kind}")
        s = (result or {}).get("summary")
        cells.append(f"{s['step_mean_s']:.2f}" if s else _failed(result, settings["steps"]) if result else "-")
    columns = [[] for _ in range(6)]
    for system, result in systems.items():
        if system in ("upstream-sync", "upstream-async"):
            continue
        s = result.get("summary") or {}
        if s:
            (sync_step, sync_token), (async_step, async_token) = (_speedups(base[k], s) for k in ("sync", "async"))
            values = [system, f"{s['step_mean_s']:.2f}", sync_step, async_step, sync_token, async_token]
        else:
            values = [system, _failed(result, settings["steps"]), "-", "-", "-", "-"]
        for column, value in zip(columns, values):
            column.append(value)
    cells += ["<br>".join(column) or "-" for column in columns]
    return "| " + " | ".join(cells) + " |"


def _learning_row(name: str, results: dict) -> str:
    """A learning run's row: per system (with its seeds), the sampled accuracy at the start and the end for the
    learning benchmark (``learning_report``'s smoothing, means over the seeds), or the mean reward of the first
    and the last 5 steps for a speed run scored by a rule."""
    settings = results["settings"]
    if "task" in results:
        digits = results["task"]["prompts"]["digits"]
        task = f"{results['task']['name']}, digits mean {digits['mean']:g}{learning_report.digits_sigma(digits)}"
        runs = learning_report.runs_by_system(results)

        def start_end(steps):
            return (
                learning_report.accuracy(steps[: learning_report.SMOOTHING])[-1],
                learning_report.accuracy(steps)[-1],
            )

        shown = "{:.1%}"
    else:
        reward = next(f for f in settings["extra"] if f.startswith("--reward.remote_url"))
        task = f"reward: `{os.path.basename(reward.split('=', 1)[1])}`"
        runs = {system: {0: r["steps"]} if r.get("steps") else {} for system, r in results["systems"].items()}

        def start_end(steps):
            rewards = [s.get("rollout/reward_mean", float("nan")) for s in steps]
            return statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])

        shown = "{:.3f}"
    names, starts, ends = [], [], []
    for system, seeds in runs.items():
        count = len(seeds)
        names.append(system + (f" ({count} seeds)" if count > 1 else ""))
        if not seeds:
            starts.append("failed")
            ends.append("-")
            continue
        start, end = zip(*(start_end(steps) for steps in seeds.values()))
        starts.append(shown.format(statistics.mean(start)))
        ends.append(shown.format(statistics.mean(end)))
    gpus = settings["gpus"]
    cells = [
        _run_cell(name),
        task,
        f"{settings['placement']}, {gpus} GPU{'s' if gpus > 1 else ''}",
        _card(results),
        results.get("commit") or "-",
        str(settings["steps"]),
        "<br>".join(names),
        "<br>".join(starts),
        "<br>".join(ends),
    ]
    return "| " + " | ".join(cells) + " |"


def _ratio_x(numerator, denominator) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"


def _patched(results: dict) -> bool:
    return bool(results.get("upstream_patches"))


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def machine_folders(out: str, scratch: str, workdir: str) -> dict:
    """The folders a run's results name instead of giving them (``without_machine_folders``): the harness's own,
    and the checkout it runs from, whose paths (a reward function's, a traceback's) are written from ``$PWD``.
    An installed package has no checkout: its folder is site-packages, which other packages' paths share."""
    folders = {"OUT": out, "SCRATCH": scratch, "WORKDIR": workdir}
    if os.path.exists(os.path.join(CHECKOUT, "pyproject.toml")):
        folders["$PWD"] = CHECKOUT
    return folders


def without_machine_folders(value, folders: dict):
    """``value`` (what results.json holds) with each of ``folders``' paths written as its name (``OUT``,
    ``SCRATCH``, ``WORKDIR``): where a machine kept a run's files says nothing about the run, and the raw JSON is
    published as it is. A path is replaced only whole, the longest first, as given and as an absolute path."""
    # The first name given wins where two folders are one (--scratch defaults to --out).
    names = {form: name for name, path in reversed(folders.items()) if path for form in (path, os.path.abspath(path))}
    if not names:
        return value
    longest_first = "|".join(re.escape(path) for path in sorted(names, key=len, reverse=True))
    pattern = re.compile(r"(?<![\w./-])(" + longest_first + r")(?![\w.-])")

    def named(item):
        if isinstance(item, dict):
            return {key: named(part) for key, part in item.items()}
        if isinstance(item, list):
            return [named(part) for part in item]
        return pattern.sub(lambda match: names[match.group(1)], item) if isinstance(item, str) else item

    return named(value)


def command_items(command: str) -> list:
    """One recorded command as its flags (each with its value) and lone words, without the machine's own
    folders: --workdir and --scratch are dropped, --out becomes OUT, and paths into this repository start at
    $PWD."""
    items = []
    for word in command.split():
        word = re.sub(r"=/\S*?/(examples|docs)/", r"=$PWD/\1/", word)
        if items and items[-1].startswith("--") and " " not in items[-1] and not word.startswith("--"):
            items[-1] += " " + word
        else:
            items.append(word)
    items = [item for item in items if item.split()[0] not in ("--workdir", "--scratch")]
    return ["--out OUT" if item.startswith("--out ") else item for item in items]


def shown_command(results: dict) -> str:
    """The recorded command(s) (``command_items``), one per line, wrapped at 100 characters."""
    commands = []
    for command in results["command"].split(" ; "):
        lines = [""]
        for item in command_items(command):
            if lines[-1] and len(lines[-1]) + len(item) > 100:
                lines.append("   ")
            lines[-1] += (" " if lines[-1] else "") + item
        commands.append(" \\\n".join(lines))
    return "\n".join(commands)


def common_command(runs) -> str:
    """The flags and words that every command of every run given has, in the first command's order."""
    commands = [command_items(c) for results in runs for c in results["command"].split(" ; ")]
    return " ".join(item for item in commands[0] if all(item in other for other in commands[1:]))


def section(folder: str) -> str:
    """What a run's README.md shows below its own text: the command that made it, links to its raw results and
    other files, and its tables, made from the raw results (``tests/test_report.py`` checks every README)."""
    results = run_results(folder)
    extra = sorted(
        os.path.basename(p)
        for pattern in ("*.png", "trace-*.json", "*.txt")
        for p in glob.glob(os.path.join(folder, pattern))
        if not p.endswith("commit.txt")
    )
    links = " · ".join(f"[{file}]({file})" for file in [os.path.basename(p) for p in raw_files(folder)] + extra)
    return f"```\n{shown_command(results)}\n```\n\n{links}\n\n{table(results)}"


def _title(results):
    settings = results["settings"]
    gpus = results["machine"]["gpus"]
    machine = f"{len(gpus)}x {gpus[0]}" if gpus else "CPU"
    return f"{machine}, {settings['placement']}, {settings['shape']}"


def _mean(values):
    return sum(values) / len(values) if values else 0.0


def _fmt(value):
    return "-" if value is None else f"{value:.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="results files or run folders")
    parser.add_argument("--out", help="where table.md and the plots go")
    parser.add_argument("--pack", action="store_true", help="store each run folder given as docs/results keeps it")
    parser.add_argument("--section", action="store_true", help="print each run folder's README.md")
    parser.add_argument("--summary", action="store_true", help="print the results page of the run folders given")
    parser.add_argument("--headline", action="store_true", help="print the README's results table (docs/results)")
    args = parser.parse_args()
    if args.headline:
        print(headline(args.paths[0]))
    elif args.summary:
        sys.stdout.write(summary(args.paths))
    elif args.section:
        for folder in args.paths:
            name = os.path.basename(os.path.normpath(folder))
            sys.stdout.write(f"# {name}\n\n(what the run measures, and what it shows)\n\n{section(folder)}")
    elif args.pack:
        for folder in args.paths:
            pack(folder)
    elif args.out:
        write(
            merge([file for path in args.paths for file in (raw_files(path) if os.path.isdir(path) else [path])]),
            args.out,
        )
        print(open(os.path.join(args.out, "table.md")).read())
    else:
        parser.error("give --out, --pack, --section or --summary")


if __name__ == "__main__":
    main()
