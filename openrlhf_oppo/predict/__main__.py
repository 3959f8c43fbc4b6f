"""Know before you run: OPPO's and upstream async's PPO step, predicted from an OpenRLHF run's own logs.

    python -m openrlhf_oppo.predict RUN_FOLDER                     # a benchmark run folder (results.json)
    python -m openrlhf_oppo.predict TB_DIR -- <its train_ppo_ray flags>   # an OpenRLHF run's tensorboard logs
    python -m openrlhf_oppo.predict --shape qwen2.5-7b --gpus 8 --gpu h100 --batch 112 --mean 400 --high 1024
    python -m openrlhf_oppo.predict --calibrate docs/results       # fit openrlhf_oppo/predict/calibration.json
    python -m openrlhf_oppo.predict --validate docs/results        # write docs/prediction.md

From upstream's sync trainer's logged steps (generation, make_experience, training and weight sync times, the
responses' lengths) and its placement (its flags), a small simulation of requests and phases gives the step of
upstream's async trainer with partial rollout and of OPPO with the plan its options resolve to (``--oppo_extra``
adds ``--oppo.*`` flags to it), with each system's bound (the busiest set of GPUs' time) and what sets it. Without
logs, ``--shape`` with a GPU count and a length distribution predicts the benchmark's systems from the calibration.
The costs are the card's (``--gpu``, or the card a run folder recorded): its own calibrated runs where it has them,
else another card's scaled by their data sheets; the header says which, and what a shape without runs of its own
takes from the others.
"""

import argparse
import sys

from openrlhf_oppo import tiny
from openrlhf_oppo.bench import systems as bench_systems
from openrlhf_oppo.bench import workload
from openrlhf_oppo.predict import costs as costs_
from openrlhf_oppo.predict import model
from openrlhf_oppo.predict import runs as runs_
from openrlhf_oppo.predict import validate

FITTED = "\nThe sync run's own logs set the costs: its row shows the fit; the others are predictions.\n"
# The card of a prediction without a run folder that records one, and without --gpu.
DEFAULT_CARD = "h200"


def table(predictions: dict, measured: dict = None, baseline: str = None) -> str:
    """One row a system: its step, against the baseline's, its bound and what sets it, its plan."""
    measured = measured or {}
    base = predictions.get(baseline)
    lines = [
        "| system | predicted step (s) | measured (s) | vs sync | bound (s) | bound set by | wait for samples (s)"
        " | policy lag (mean / at most) | plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in predictions.items():
        seen = f"{measured[name]:.2f}" if name in measured else "-"
        if p.refused:
            lines.append(f"| {name} | - | {seen} | - | - | - | - | - | {p.refused} |")
            continue
        ratio = f"{base.step_s / p.step_s:.2f}x" if base and not base.refused else "-"
        lag = f"{p.mean('lag'):.2f} / {p.lag_bound}" if p.kind != "sync" else "0 / 0"
        wait = p.mean("generation_s")
        lines.append(
            f"| {name} | {p.step_s:.2f} | {seen} | {ratio} | {p.bound_s:.2f} | {p.set_by} | {wait:.2f} | {lag}"
            f" | {p.plan} |"
        )
    return "\n".join(lines) + "\n"


def _on_card(calibration: dict, card: str, shape: str) -> tuple:
    """The card's calibration and the lines that say where its costs come from."""
    calibration = costs_.for_card(calibration, card)
    notes = [f"Costs of {costs_.CARDS[card]['name']} GPUs"] + calibration["notes"]
    extrapolated = costs_.extrapolation(calibration, shape) if shape else None
    return calibration, "; ".join(notes + ([extrapolated] if extrapolated else [])) + ".\n\n"


def from_harness_folder(args, calibration: dict) -> str:
    runs = runs_.harness_runs(args.run)
    base = runs.get(args.system) or next((r for n, r in runs.items() if n.startswith("upstream-sync")), None)
    if base is None:
        sys.exit(f"{args.run}: no upstream sync system with measured steps (name one with --system)")
    if base.lengths is None:
        sys.exit(f"{args.run}: the run's prompt order was not seeded, so its steps' lengths are not known")
    calibration, notes = _on_card(calibration, args.gpu or base.card or DEFAULT_CARD, base.shape)
    flags = {
        "upstream sync": base.flags,
        "upstream async (derived)": model.async_flags(base.flags),
        "OPPO (derived)": model.oppo_flags(base.flags, args.oppo_extra),
    }
    measured = {"upstream sync": _measured(base)}
    for name, run in runs.items():
        if run is not base:
            flags[name], measured[name] = run.flags, _measured(run)
    predictions = model.from_sync_run(base, calibration, flags)
    head = f"Predicted from {args.run} ({base.name}: {base.measured} measured steps after {base.warmup})\n\n"
    return head + notes + table(predictions, measured, "upstream sync") + FITTED


def from_tensorboard(args, calibration: dict, flags: list) -> str:
    run = runs_.tensorboard_run(args.run, flags, sigma=args.sigma, warmup=args.warmup, shape=args.shape)
    calibration, notes = _on_card(calibration, args.gpu or DEFAULT_CARD, run.shape)
    systems = {
        "upstream sync": flags,
        "upstream async": model.async_flags(flags),
        "OPPO": model.oppo_flags(flags, args.oppo_extra),
    }
    predictions = model.from_sync_run(run, calibration, systems)
    head = (
        f"Predicted from {args.run} ({run.measured} steps after {run.warmup}; each step's lengths lognormal with"
        f" sigma {args.sigma:g} around its logged mean)\n\n"
    )
    return head + notes + table(predictions, {"upstream sync": _measured(run)}, "upstream sync") + FITTED


def from_shape(args, calibration: dict) -> str:
    """The benchmark's systems (``bench/systems.py``) for a shape, GPU count and lengths nobody ran yet."""
    sync_flags = bench_systems.common_flags(
        workdir="WORKDIR",
        out="OUT",
        system="upstream-sync",
        placement=args.placement,
        gpus=args.gpus,
        batch=args.batch,
        n_samples=args.n_samples,
        steps=args.warmup + args.steps,
        max_response=args.high,
        prompt_tokens=args.prompt_tokens,
        seed=args.seed,
        cache_budget_gb=2.0,
        rollout_micro_batch=args.rollout_micro_batch,
        train_micro_batch=args.train_micro_batch,
    ) + bench_systems.system_flags("upstream-sync", args.placement, 1)
    parsed = runs_.parse_flags(sync_flags)
    setup = runs_.setup_of(parsed, args.prompt_tokens)
    calibration, notes = _on_card(calibration, args.gpu or DEFAULT_CARD, args.shape)
    costs = costs_.from_calibration(calibration, args.shape, setup)
    count = args.batch * args.n_samples * (args.warmup + args.steps + 4)
    lengths = tiny.response_lengths(count, args.lengths, seed=args.seed, **workload.length_params(args))
    systems = {
        "upstream sync": sync_flags,
        "upstream async": model.async_flags(sync_flags),
        "OPPO": model.oppo_flags(sync_flags, args.oppo_extra),
    }
    predictions = model.predict_systems(costs, lengths, args.prompt_tokens, systems, args.warmup, args.steps)
    head = (
        f"Predicted from the calibration: {args.shape}, {args.gpus} GPUs {args.placement}, {args.batch} prompts x"
        f" {args.n_samples}, {args.lengths} lengths (mean {sum(lengths) / len(lengths):.0f}, at most {args.high})\n\n"
    )
    return head + notes + table(predictions, baseline="upstream sync")


def _measured(run) -> float:
    steps = run.measured_steps
    return sum(s["wall_s"] for s in steps) / len(steps)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    run_flags = argv[argv.index("--") + 1 :] if "--" in argv else None
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", help="a benchmark run folder (results.json) or a tensorboard folder")
    parser.add_argument("--system", default="", help="run folder: the sync system whose logs to use")
    parser.add_argument("--oppo_extra", action="append", default=[], help="an --oppo.* flag for OPPO (repeat it)")
    parser.add_argument("--shape", help="the model's shape (tensorboard logs whose model path names none; --gpus)")
    parser.add_argument(
        "--gpu",
        choices=sorted(costs_.CARDS),
        help=f"the card (default: the one a run folder recorded, else {DEFAULT_CARD})",
    )
    parser.add_argument("--gpus", type=int, help="predict from the calibration for this many GPUs")
    parser.add_argument("--placement", default="split", choices=["split", "colocated"])
    parser.add_argument("--batch", type=int, default=32, help="prompts a step")
    parser.add_argument("--n_samples", type=int, default=1)
    parser.add_argument("--rollout_micro_batch", type=int, default=8, help="--gpus: --rollout.micro_batch_size")
    parser.add_argument("--train_micro_batch", type=int, default=2, help="--gpus: --train.micro_batch_size")
    parser.add_argument("--steps", type=int, default=20, help="--gpus: steps to average over")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out first (default: 1 logged, 10 else)")
    parser.add_argument("--calibration", default=costs_.CALIBRATION, help="the calibration file")
    parser.add_argument("--calibrate", metavar="RESULTS_DIR", help="fit the calibration from the sync runs there")
    parser.add_argument("--validate", metavar="RESULTS_DIR", help="predict every paired run there (blind)")
    parser.add_argument("--out", default="docs/prediction.md", help="--validate: the page it writes")
    workload.add_workload_arguments(parser)  # with --gpus, the lengths; with tensorboard logs, --sigma
    args = parser.parse_args(argv)

    if args.calibrate:
        calibration = costs_.calibrate(args.calibrate)
        costs_.save(calibration, args.calibration)
        counts = ", ".join(f"{len(c['sync_runs'])} on {card}" for card, c in calibration["cards"].items())
        print(f"wrote {args.calibration} from the upstream sync runs ({counts})")
        return
    calibration = costs_.load(args.calibration)
    if args.validate:
        with open(args.out, "w") as f:
            f.write(validate.page(args.validate, calibration))
        print(f"wrote {args.out}")
        return
    if args.gpus:
        if args.shape not in tiny.SHAPES:
            parser.error(f"--gpus needs --shape, one of {', '.join(tiny.SHAPES)}")
        workload.check_workload_arguments(parser, args)
        args.warmup = 10 if args.warmup is None else args.warmup
        print(from_shape(args, calibration))
    elif args.run and run_flags is not None:
        args.warmup = 1 if args.warmup is None else args.warmup
        print(from_tensorboard(args, calibration, run_flags))
    elif args.run:
        print(from_harness_folder(args, calibration))
    else:
        parser.error("give a run folder, a tensorboard folder with -- and its flags, or --shape with --gpus")


if __name__ == "__main__":
    main()
