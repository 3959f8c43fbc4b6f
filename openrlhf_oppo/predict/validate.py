"""The page docs/prediction.md: a blind check of the predictions against every paired run, and the paper's
settings predicted from the calibration.

    python -m openrlhf_oppo.predict --validate docs/results --out docs/prediction.md

Blind: each system of a run folder is predicted from the folder's upstream sync system alone (its logged steps
and workload) and the predicted system's own flags (its placement and plan); the predicted system's measurements
are read only to compare.
"""

import glob
import os
import statistics
import subprocess
import tempfile

from openrlhf_oppo import tiny
from openrlhf_oppo.bench import report
from openrlhf_oppo.predict import costs as costs_
from openrlhf_oppo.predict import model
from openrlhf_oppo.predict import runs as runs_

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(CHECKOUT, "examples", "scripts")
# The paper's settings (examples/scripts) with what their datasets' lengths are assumed to be: lognormal
# responses (sigma 1, clipped at the script's --rollout.max_new_tokens) of this mean, prompts of this length.
PAPER_SETTINGS = (
    ("Qwen2.5-7B, Stack-Exchange-Paired, reward model", "ppo_qwen2.5_7b_stackexchange.sh", 400, 200),
    ("Qwen2.5-3B, OpenCoder-SFT, reward model", "ppo_qwen2.5_3b_opencoder.sh", 600, 150),
    ("Qwen2.5-7B, GSM8K, rule reward", "ppo_qwen2.5_7b_gsm8k.sh", 250, 100),
)
PAPER_GPUS = (8, 16, 64)  # the first setting at more GPUs; the others at the scripts' 8
PAPER_WARMUP, PAPER_STEPS = 10, 20
SIGMA = 1.0  # the lognormal spread of a step's lengths where the logs give only their mean


# -- the paired runs ----------------------------------------------------------------------------------------


# The three ways a system is predicted: from the sync run's logs and lengths, from its logged mean lengths alone
# (as from a tensorboard folder), from the calibration alone (as for a setup nobody ran).
WAYS = {"logs": "", "means": ", from mean lengths only", "calibration": ", from the calibration alone"}


def paired(results_dir: str, calibration: dict):
    """(rows, left out): a row per predicted system of each run folder with an upstream sync system."""
    rows, left_out = [], []
    for folder in sorted(glob.glob(os.path.join(results_dir, "*", ""))):
        name = os.path.basename(os.path.normpath(folder))
        results = report.run_results(folder)
        if not results.get("systems"):
            continue  # a measurement of a part, not a PPO run
        if "task" in results:
            left_out.append((name, "the learning benchmark: its policy chose the responses' lengths"))
            continue
        runs = runs_.harness_runs(folder)
        failed = sorted(set(results["systems"]) - set(runs))
        base = next((r for n, r in runs.items() if n.startswith("upstream-sync")), None)
        if base is None:
            left_out.append((name, "no upstream sync system measured its steps"))
            continue
        if base.lengths is None:
            left_out.append((name, "prompt order not seeded: each system drew other prompts, of other lengths"))
            continue
        targets = {n: r for n, r in runs.items() if not n.startswith("upstream-sync")}
        if failed:
            left_out.append((name, f"failed, so not compared: {', '.join(failed)}"))
        if not targets:
            continue
        systems = dict({n: r.flags for n, r in targets.items()}, **{base.name: base.flags})
        setup = runs_.setup_of(runs_.parse_flags(base.flags), base.prompt_tokens)
        card = base.card or "h200"
        on_card = costs_.for_card(calibration, card)
        alone = costs_.from_calibration(on_card, base.shape, setup)
        ways = {
            "logs": model.from_sync_run(base, on_card, systems),
            "means": model.from_sync_run(runs_.with_lengths_from_means(base, SIGMA), on_card, systems),
            "calibration": model.predict_systems(
                alone, base.lengths, base.prompt_tokens, systems, base.warmup, base.measured
            ),
        }
        for system, run in targets.items():
            if ways["logs"][system].refused:
                left_out.append((name, f"{system}: {ways['logs'][system].refused}"))
                continue
            predicted = {way: (p[system].step_s, p[base.name].step_s) for way, p in ways.items()}
            rows.append(
                dict(
                    run=name,
                    card=card,
                    system=system,
                    kind=ways["logs"][system].kind,
                    measured=_mean_step(run),
                    sync_measured=_mean_step(base),
                    predicted=predicted,  # way: (the system's step, upstream sync's)
                )
            )
    return rows, left_out


def _mean_step(run) -> float:
    return statistics.mean(s["wall_s"] for s in run.measured_steps)


def _error(row, way: str = "logs") -> float:
    return row["predicted"][way][0] / row["measured"] - 1


def _sign_right(row, way: str = "logs") -> bool:
    """Faster or slower than upstream sync, as measured."""
    step, sync = row["predicted"][way]
    return (row["sync_measured"] > row["measured"]) == (sync > step)


def pairs_table(rows: list) -> list:
    lines = [
        "| run | card | system | measured step (s) | predicted (s) | error | vs sync measured / predicted | sign"
        " | from mean lengths only (s) | error | from the calibration alone (s) | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step, sync = r["predicted"]["logs"]
        cells = [
            f"[{r['run']}](results/{r['run']}/)",
            costs_.CARDS[r["card"]]["name"],
            r["system"],
            f"{r['measured']:.2f}",
            f"{step:.2f}",
            f"{_error(r):+.1%}",
            f"{r['sync_measured'] / r['measured']:.2f}x / {sync / step:.2f}x",
            "right" if _sign_right(r) else "WRONG",
        ]
        for way in ("means", "calibration"):
            cells += [f"{r['predicted'][way][0]:.2f}", f"{_error(r, way):+.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(rows: list) -> list:
    """The errors of each way and system, per card (each card's runs predicted with its own calibration)."""
    lines = [
        "| card | systems | predicted | median abs. error | largest abs. error | within 10% | speed-up sign right |",
        "|---|---|---|---|---|---|---|",
    ]
    for card in sorted({r["card"] for r in rows}):
        for way, what in WAYS.items():
            for label, kind in (("OPPO", "oppo"), ("upstream async", "async")):
                chosen = [r for r in rows if r["kind"] == kind and r["card"] == card]
                if not chosen:
                    continue
                errors = [abs(_error(r, way)) for r in chosen]
                right = sum(_sign_right(r, way) for r in chosen)
                lines.append(
                    f"| {costs_.CARDS[card]['name']} | {label}{what} | {len(chosen)} | {statistics.median(errors):.1%}"
                    f" | {max(errors):.1%} | {sum(e <= 0.1 for e in errors)} | {right} of {len(chosen)} |"
                )
    return lines


def against_async(rows: list) -> list:
    """Where a run measured OPPO and upstream async: which one was faster, as measured and as predicted."""
    by_run = {}
    for r in rows:
        by_run.setdefault(r["run"], []).append(r)
    right = total = 0
    for items in by_run.values():
        upstream = next((r for r in items if r["kind"] == "async"), None)
        for r in items:
            if upstream is None or r["kind"] != "oppo":
                continue
            total += 1
            faster = r["predicted"]["logs"][0] < upstream["predicted"]["logs"][0]
            right += (r["measured"] < upstream["measured"]) == faster
    return [f"OPPO against upstream async in the same run: faster or slower as measured in {right} of {total}."]


# -- the paper's settings on paper ----------------------------------------------------------------------------


def script_flags(script: str, system: str) -> list:
    """The ``train_ppo_ray`` flags an example script runs with (``SYSTEM=oppo`` or ``upstream``), read by running it
    with a ``python3`` that only writes down its arguments."""
    with tempfile.TemporaryDirectory() as stub:
        out = os.path.join(stub, "argv")
        with open(os.path.join(stub, "python3"), "w") as f:
            f.write(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {out}\n")
        os.chmod(os.path.join(stub, "python3"), 0o755)
        env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", SYSTEM=system, REWARD_MODEL="reward-model")
        subprocess.run(["bash", os.path.join(SCRIPTS, script)], env=env, check=True, capture_output=True)
        with open(out) as f:
            words = f.read().split("\0")[:-1]
    return words[words.index("openrlhf_oppo.cli.train_ppo_ray") + 1 :]


def with_gpus(flags: list, gpus: int) -> list:
    """The split placement at ``gpus`` GPUs: half for the engines, half for the models (8 a node), the batch
    scaled with them."""
    flags, half = list(flags), gpus // 2
    nodes, per_node = -(-half // 8), min(half, 8)
    batch = int(flags[flags.index("--rollout.batch_size") + 1]) * gpus // 8
    values = {"--vllm.num_engines": half, "--rollout.batch_size": batch, "--train.batch_size": batch}
    for role in ("actor", "critic", "reward", "ref"):
        values.update({f"--{role}.num_nodes": nodes, f"--{role}.num_gpus_per_node": per_node})
    for flag, value in values.items():
        flags[flags.index(flag) + 1] = str(value)
    return flags


def paper_rows(calibration: dict) -> list:
    rows = []
    for label, script, mean, prompt_tokens in PAPER_SETTINGS:
        upstream, oppo = script_flags(script, "upstream"), script_flags(script, "oppo")
        for gpus in PAPER_GPUS if script == PAPER_SETTINGS[0][1] else PAPER_GPUS[:1]:
            sync_flags, oppo_flags = with_gpus(upstream, gpus), with_gpus(oppo, gpus)
            args = runs_.parse_flags(sync_flags)
            setup = runs_.setup_of(args, prompt_tokens)
            shape = runs_.shape_of(args.actor.model_name_or_path)
            costs = costs_.from_calibration(calibration, shape, setup)
            per_step = setup.batch * setup.n_samples
            count = per_step * (PAPER_WARMUP + PAPER_STEPS + 4)
            high = args.rollout.max_new_tokens
            lengths = tiny.response_lengths(count, "lognormal", seed=0, mean=mean, sigma=1.0, low=1, high=high)
            systems = {
                "upstream sync": sync_flags,
                "upstream async": model.async_flags(sync_flags),
                "OPPO": oppo_flags,
            }
            predictions = model.predict_systems(costs, lengths, prompt_tokens, systems, PAPER_WARMUP, PAPER_STEPS)
            rows.append((label, gpus, setup, shape, high, mean, predictions))
    return rows


def paper_table(calibration: dict) -> list:
    lines = [
        "| setting | GPUs (engines + models) | batch | system | predicted step (s) | vs sync | bound (s)"
        " | bound set by | wait for samples (s) | plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, gpus, setup, shape, high, mean, predictions in paper_rows(costs_.for_card(calibration, "h200")):
        sync = predictions["upstream sync"]
        for system, p in predictions.items():
            head = f"| {label} | {gpus} ({setup.engines} + {setup.model_gpus}) | {setup.batch} | {system}"
            if p.refused:
                lines.append(f"{head} | - | - | - | - | - | {p.refused} |")
                continue
            lines.append(
                f"{head} | {p.step_s:.1f} | {sync.step_s / p.step_s:.2f}x | {p.bound_s:.1f} | {p.set_by}"
                f" | {p.mean('generation_s'):.1f} | {p.plan} |"
            )
    return lines


# -- the page -----------------------------------------------------------------------------------------------------


def page(results_dir: str, calibration: dict) -> str:
    return page_of(*paired(results_dir, calibration), calibration)


def _calibrated_shapes(calibration: dict) -> str:
    """Each card's calibrated shapes and their runs, and where a card without runs of a shape takes it from."""
    parts = []
    for card, figures in sorted(calibration["cards"].items()):
        shapes = ", ".join(f"{s} ({v['runs']} runs)" for s, v in sorted(figures["shapes"].items()))
        parts.append(f"{costs_.CARDS[card]['name']}: {shapes}")
    notes = [note for card in costs_.CARDS for note in costs_.for_card(calibration, card)["notes"]]
    return "; ".join(parts) + "".join(f". {note}" for note in notes)


def page_of(rows: list, left_out: list, calibration: dict) -> str:
    """docs/prediction.md from ``paired``'s rows and the runs it left out."""
    oppo = [r for r in rows if r["kind"] == "oppo"]
    asyncs = [r for r in rows if r["kind"] == "async"]
    shapes = _calibrated_shapes(calibration)
    parts = [
        "# Predicting the step before running it",
        "",
        "<!-- generated by: python -m openrlhf_oppo.predict --validate docs/results"
        " (tests/test_predict.py checks that it is current) -->",
        "",
        "`python -m openrlhf_oppo.predict` predicts OPPO's and upstream async's PPO step from an OpenRLHF run's own",
        "logs (upstream's sync trainer: a benchmark run folder, or a tensorboard folder with the run's flags) and",
        "its placement, or from a model shape, GPU count and length distribution. A small simulation runs the",
        "requests on the engines (an iteration costs a fixed time plus a time per running request), the scorers'",
        "prefill while they decode, make_experience, training and the weight sync, in each system's order",
        "(`openrlhf_oppo/predict/simulate.py`). Its costs are the sync run's own (the generation, make_experience,",
        "training and weight sync times it logged), with per-token slopes calibrated, per card, on every upstream",
        f"sync run in docs/results (`{calibration['command']}`; {shapes}).",
        "",
        "## Blind check against the measured runs",
        "",
        "Every system of a run folder is predicted from that folder's upstream sync system only (its logged steps",
        "and its workload's lengths) and the predicted system's own flags (placement and plan); its own",
        "measurements are not read. The step is the mean wall time of the measured steps, as in RESULTS.md. Two",
        "more ways each: from the sync run's logged mean lengths only, each step's lengths drawn lognormal (sigma",
        f"{SIGMA:g}) around its mean, as from a tensorboard folder; and from the calibration alone, with the run's",
        "workload, as for a setup nobody ran (that calibration holds the sync runs' steps, this one's too). Each",
        "run is predicted with the calibration of the card it ran on, and the errors are given per card.",
        "",
        *summary_table(rows),
        "",
        *against_async(rows),
        "",
        *pairs_table(rows),
        "",
        f"{len(oppo)} OPPO and {len(asyncs)} upstream async systems in {len({r['run'] for r in rows})} run folders.",
        "Not predicted:",
        "",
        *[f"- {name}: {why}" for name, why in left_out],
        "",
        "Where the errors come from, as far as the phases logged beside the steps tell:",
        "",
        "- training beside decoding: in most paired runs upstream async's and OPPO's training took a few per cent",
        "  longer than upstream sync's on the same tokens, with the engines decoding on other GPUs of the host; sync",
        "  runs never overlap the two, so the calibration has no term for it and both are predicted a little short;",
        "- OPPO's staged weight sync and async's paused one took longer than sync's plain one, which the model",
        "  takes for all three;",
        "- one GPU (colocated): the scorers are costed at upstream's make_experience rate per token with no cost per",
        "  chunk call, so where they share the GPU with decoding their calls slow it more than the model has; and",
        "  where decoding shares it with training the two take turns by the GPU busy shares NVML logged for the",
        "  sync run, not measured side by side;",
        "- the sync run's own variation from run to run carries into every prediction made from it.",
        "",
        "## The paper's settings, on paper",
        "",
        "Predictions from the calibration alone (no run of these exists), for upstream sync, upstream async with",
        "partial rollout and OPPO with the scripts' plan (`--oppo.overcommit auto`: the Delta its throughput rule",
        f"holds; each system runs {PAPER_WARMUP} steps before the {PAPER_STEPS} it averages). Assumptions:",
        "",
        "- flags: examples/scripts as they are (`SYSTEM=upstream` for the sync twin; async is the same placement",
        "  with `--train.async_enable --train.partial_rollout_enable`); at 16 and 64 GPUs half the GPUs run engines,",
        "  half the models, and the batch grows with them (112 prompts per 8 GPUs);",
        "- lengths: lognormal responses (sigma 1) clipped at the script's `--rollout.max_new_tokens`, of mean "
        + ", ".join(f"{m} tokens ({label.split(', ')[1]})" for label, _, m, _ in PAPER_SETTINGS)
        + ", and prompts of "
        + ", ".join(f"{p}" for _, _, _, p in PAPER_SETTINGS)
        + " tokens;",
        "- costs: H200 GPUs. A shape with fewer than two calibrated runs takes its per-token costs from the",
        "  calibrated shape nearest in parameters scaled by its parameters (the 7B shape's one run",
        "  trained under ZeRO-3 with offload, the scripts' ZeRO-2 does not), its decoding from its own run where it",
        "  has one; the fixed costs per call and per training micro-batch are the medians of the shape's split runs",
        "  (or the nearest shape's, scaled), the weight sync per parameter, the dispatch and the GPU busy shares",
        "  those of every calibrated split run. The weight sync is taken not to grow with the engines, and every",
        "  part of a step to scale with the batch per GPU.",
        "",
        "The bound is the busiest set of GPUs' time a step (the engines decoding, or the models' GPUs making",
        "experiences, training and syncing), the wait for samples the time a step waits for its batch after it",
        "starts (upstream sync: all of its generation).",
        "",
        *paper_table(calibration),
        "",
    ]
    return "\n".join(parts)
