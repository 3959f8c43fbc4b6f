"""Tables and plots from ``results.json`` (written by ``python -m openrlhf_oppo.bench``).

    python -m openrlhf_oppo.bench.report runs/2gpu/results.json [more results.json] --out docs/results/2gpu

Runs of 10 steps or more also get a convergence table (reward per step, time to a target reward) and
plot. A step's time is the wall time between its log and the previous step's (all phases, queue waits and
whatever else happened). The phases are OpenRLHF's own ``timing/*``; under OPPO's inter-step overlap
and upstream's async mode, generation overlaps training, so phases need not add up to the step.
"""

import argparse
import glob
import json
import os
import statistics

PHASES = ("generation", "make_experience", "ppo_train", "broadcast")
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
CONVERGENCE_MIN_STEPS = 10  # runs this long get the convergence table and plot


def read_steps(tb_dir: str) -> list:
    """One dict per logged step: its ``train/*`` scalars, and ``start``/``end`` wall times."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_step = {}
    for events in sorted(glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True)):
        accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            for event in accumulator.Scalars(tag):
                step = by_step.setdefault(event.step, {"step": event.step, "end": 0.0})
                step[tag.removeprefix("train/")] = event.value
                step["end"] = max(step["end"], event.wall_time)
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


def table(results: dict) -> str:
    systems = results["systems"]
    base = systems.get("upstream-sync", {}).get("summary", {})
    base_util = _mean(systems.get("upstream-sync", {}).get("gpu_utilization", []))
    lines = [
        f"GPUs: {', '.join(results['machine']['gpus']) or 'none'} · placement: {results['settings']['placement']}"
        f" · shape: {results['settings']['shape']} · batch: {results['settings']['batch']} prompts"
        f" x {results['settings']['n_samples']} · measured steps: {results['settings']['steps']}"
        f" (after {results['settings']['warmup']} warm-up) · workload: {results['workload']['distribution']}"
        f" mean {results['workload']['mean_length']:.0f}, max {results['workload']['max_length']} tokens"
        + (" · OpenRLHF with patches/openrlhf applied" if results.get("upstream_patches") else ""),
        "",
        "| system | step mean (s) | p50 | p90 | generation | make_exp | train | weight sync | other | tokens/s"
        " | GPU util % | speed-up vs sync | util vs sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in systems.items():
        s = result.get("summary") or {}
        if not s:
            lines.append(f"| {name} | failed (rc {result.get('returncode')}) |" + " |" * 11)
            continue
        util = result.get("gpu_utilization", [])
        speedup = f"{base['step_mean_s'] / s['step_mean_s']:.2f}x" if base else "-"
        util_ratio = f"{_mean(util) / base_util:.2f}x" if base_util and util else "-"
        lines.append(
            f"| {name} | {s['step_mean_s']:.2f} | {s['step_p50_s']:.2f} | {s['step_p90_s']:.2f}"
            f" | {s['generation_s']:.2f} | {s['make_experience_s']:.2f} | {s['ppo_train_s']:.2f}"
            f" | {s['broadcast_s']:.2f} | {s['other_s']:.2f} | {s['tokens_per_s']:.0f}"
            f" | {' / '.join(f'{u:.0f}' for u in util) or '-'} | {speedup} | {util_ratio} |"
        )
    oppo = [(n, r["summary"]) for n, r in systems.items() if r.get("summary") and n.startswith("oppo")]
    if oppo:
        lines += ["", "| OPPO system | " + " | ".join(OPPO_KEYS) + " |", "|---|" + "---|" * len(OPPO_KEYS)]
        for name, s in oppo:
            lines.append(f"| {name} | " + " | ".join(_fmt(s.get(k)) for k in OPPO_KEYS) + " |")
    if max(len(r.get("steps") or []) for r in systems.values()) >= CONVERGENCE_MIN_STEPS:
        lines += ["", *convergence_table(results)]
    return "\n".join(lines) + "\n"


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
        if max(len(r.get("steps") or []) for r in results["systems"].values()) >= CONVERGENCE_MIN_STEPS:
            plot_convergence(results, os.path.join(out, "convergence.png"))
    except ImportError:
        print("matplotlib is not installed: no plots")


def merge(paths: list) -> dict:
    """Results of several invocations on one machine, systems in order (later ones win a name clash)."""
    merged = None
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        if merged is None:
            merged = results
        else:
            merged["systems"].update(results["systems"])
            merged["command"] += " ; " + results["command"]
    return merged


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
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    write(merge(args.results), args.out)
    print(open(os.path.join(args.out, "table.md")).read())


if __name__ == "__main__":
    main()
