"""The cost model's figures: from a sync run's own logged steps, or from the calibration of every upstream sync
run in docs/results.

    python -m openrlhf_oppo.predict --calibrate docs/results    # writes openrlhf_oppo/predict/calibration.json

A sync step logs its generation, make_experience, training and weight sync times; the workload gives its
batch's lengths. The model of that step, per GPU (the busiest rank's share):

* generation: ``dispatch_s`` plus the engines' decoding (an iteration costs ``decode_s + decode_per_request_s *
  running``, so a batch that starts together takes ``decode_s * longest + decode_per_request_s * tokens``);
* make_experience: ``forward_s`` per padded token of every scoring model, calls and advantages included, of which
  ``call_s`` a call is fixed (the intercept over its calls): a model that streams still returns its scores in a
  call;
* training: ``train_s + train_per_token_s`` per padded token of every trained model;
* the weight sync and the rest of the step as logged.

The decoding and training slopes and ``forward_s``'s fixed part are pooled over the sync runs of a shape, from the
variation within each run (each run keeps its own intercepts: its dispatch, patches, micro-batches, state moves).
A run's own steps then set its intercepts and ``forward_s``.
"""

import glob
import json
import math
import os
import statistics
from dataclasses import replace
from typing import Dict, List, Optional

from openrlhf_oppo import tiny
from openrlhf_oppo.predict import runs as runs_
from openrlhf_oppo.predict import simulate
from openrlhf_oppo.predict.simulate import Cluster, Costs, Group, Request, Setup, padded_tokens

CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
CALIBRATE_COMMAND = "python -m openrlhf_oppo.predict --calibrate docs/results"
# Slopes where a shape has too few runs of its own: scaled from the calibrated shape nearest in parameters (by
# their ratio) by its parameters, the work of a token (decoding reads every weight once an iteration; forward and
# training compute per weight); the simulation multiplies them by the workload's tokens.
SCALED_FROM_PARAMETERS = ("decode_s", "decode_per_request_s", "forward_s", "forward_slope_s", "train_per_token_s")
# The cards the calibration knows, by their data sheets (SXM): memory bandwidth sets decoding, which reads every
# weight once an iteration; dense bf16 compute sets forward passes and training. A card without runs of its own
# takes the calibrated card's costs scaled by these.
CARDS = {
    "h100": dict(name="H100", memory_tbs=3.35, bf16_tflops=989.0),
    "h200": dict(name="H200", memory_tbs=4.8, bf16_tflops=989.0),
}
MEMORY_BOUND = ("decode_s", "decode_per_request_s")
COMPUTE_BOUND = ("forward_s", "forward_slope_s", "train_per_token_s")


def parameters(shape: str) -> float:
    s = tiny.SHAPES[shape]
    head = s["hidden_size"] // s["num_attention_heads"]
    attention = s["hidden_size"] * head * (s["num_attention_heads"] * 2 + s["num_key_value_heads"] * 2)
    mlp = 3 * s["hidden_size"] * s["intermediate_size"]
    return s["num_hidden_layers"] * (attention + mlp) + s["vocab_size"] * s["hidden_size"]


# -- one sync step's features ------------------------------------------------------------------------


def batches(run, setup: Setup) -> List[List[int]]:
    """Each logged step's responses' lengths, in dispatch order (upstream's sync trainer takes the prompts in
    order, ``batch`` groups a step)."""
    per_step = setup.batch * setup.n_samples
    return [run.lengths[i * per_step : (i + 1) * per_step] for i in range(len(run.steps))]


def decode_terms(lengths: List[int], setup: Setup) -> tuple:
    """(longest, tokens) of the engine with the longest response, as upstream's dispatch spreads the groups over
    the engines (in turn, where every engine starts empty)."""
    per_engine = [[] for _ in range(setup.engines)]
    n = setup.n_samples
    for g in range(len(lengths) // n):
        per_engine[g % setup.engines] += lengths[g * n : (g + 1) * n]
    return max((max(e), sum(e)) for e in per_engine if e)


def forward_tokens(lengths: List[int], setup: Setup) -> float:
    sequences = [setup.prompt_tokens + x for x in lengths]
    return len(setup.roles) * padded_tokens(sequences, setup.rollout_micro_batch, setup.model_gpus, False)


def forward_calls(setup: Setup) -> int:
    """make_experience's forward calls on a rank: every scoring model's micro-batches."""
    per_rank = -(-setup.batch * setup.n_samples // setup.model_gpus)
    return len(setup.roles) * -(-per_rank // setup.rollout_micro_batch)


def training_tokens(lengths: List[int], setup: Setup) -> float:
    sequences = [setup.prompt_tokens + x for x in lengths]
    return len(setup.trained) * padded_tokens(sequences, setup.train_micro_batch, setup.model_gpus, True)


def decode_seconds(lengths: List[int], setup: Setup, costs: Costs) -> float:
    """The sync trainer's decoding of one batch (without its dispatch), by the simulation's engines."""
    cluster = Cluster(replace(costs, dispatch_s=0.0), setup)
    n = setup.n_samples
    groups = []
    for index in range(len(lengths) // n):
        group = Group(index, [])
        group.requests = [Request(group, x) for x in lengths[index * n : (index + 1) * n]]
        groups.append(group)
        cluster.dispatch(group)
    simulate.wait_for(cluster, groups)
    return cluster.now


# -- GPU busy shares from the harness's NVML samples -----------------------------------------------------


def busy_shares(run) -> Optional[dict]:
    """The busiest GPU's share of time running kernels while the sync run decoded and while it trained."""
    if not run.gpu_samples:
        return None
    spans = {"decode_busy": [], "train_busy": []}
    for step in run.measured_steps:
        start, end = step["start"], step["end"]
        sync = end - step.get("timing/broadcast", 0.0)
        spans["decode_busy"].append((start, start + step.get("timing/generation", 0.0)))
        spans["train_busy"].append((sync - step.get("timing/ppo_train", 0.0), sync))
    shares = {}
    for key, windows in spans.items():
        inside = [util for t, util, _ in run.gpu_samples if any(a <= t < b for a, b in windows)]
        if not inside:
            return None
        shares[key] = max(sum(gpu) / len(inside) for gpu in zip(*inside)) / 100.0
    return shares


# -- a run's own figures ------------------------------------------------------------------------------


def from_sync_run(run, setup: Setup, slopes: dict, defaults: dict) -> Costs:
    """The costs of ``run`` (upstream sync): the shape's slopes, and the intercepts its measured steps leave.
    OPPO's samples generator sends the tokenizer once, so its dispatch is at most a patched upstream's
    (``defaults``, the calibration's median for the placement); where the NVML samples are missing, so are the
    GPU busy shares."""
    pairs = list(zip(run.steps, batches(run, setup)))[run.warmup : run.warmup + run.measured]
    pairs = [(s, b) for s, b in pairs if len(b) == setup.batch * setup.n_samples]
    steps, per_step = [s for s, _ in pairs], [b for _, b in pairs]
    base = Costs(
        decode_s=slopes["decode_s"],
        decode_per_request_s=slopes["decode_per_request_s"],
        dispatch_s=0.0,
        oppo_dispatch_s=0.0,
        forward_s=slopes["forward_s"],
        call_s=0.0,
        train_s=0.0,
        train_per_token_s=slopes["train_per_token_s"],
        sync_s=0.0,
    )
    generation = [s["timing/generation"] - decode_seconds(b, setup, base) for s, b in zip(steps, per_step)]
    scored = sum(forward_tokens(b, setup) for b in per_step)
    fixed = statistics.mean(
        s["timing/make_experience"] - slopes["forward_slope_s"] * forward_tokens(b, setup) for s, b in pairs
    )
    train = [
        s["timing/ppo_train"] - base.train_per_token_s * training_tokens(b, setup) for s, b in zip(steps, per_step)
    ]
    phases = ("generation", "make_experience", "ppo_train", "broadcast")
    other = [s["wall_s"] - sum(s.get(f"timing/{p}", 0.0) for p in phases) for s in steps]
    dispatch = max(0.0, statistics.mean(generation))
    shares = busy_shares(run) or {k: defaults[k] for k in ("decode_busy", "train_busy")}
    return replace(
        base,
        dispatch_s=dispatch,
        oppo_dispatch_s=min(dispatch, defaults["oppo_dispatch_s"]),
        forward_s=sum(s["timing/make_experience"] for s in steps) / scored,
        call_s=max(0.0, fixed) / forward_calls(setup),
        train_s=max(0.0, statistics.mean(train)),
        sync_s=statistics.mean(s.get("timing/broadcast", 0.0) for s in steps),
        other_s=max(0.0, statistics.median(other)),
        **shares,
    )


def from_calibration(calibration: dict, shape: str, setup: Setup) -> Costs:
    """Costs of a setup nobody ran: the shape's slopes and the medians of the sync runs' intercepts for its
    placement, the fixed ones per call and per micro-batch (so that they follow the batch and GPU count), from the
    shape's own runs or the nearest shape's scaled by parameters."""
    slopes = shape_slopes(calibration, shape)
    placement = "colocated" if setup.colocated else "split"
    defaults = calibration["intercepts"].get(placement) or next(iter(calibration["intercepts"].values()))
    nearest = _nearest(defaults["by_shape"], shape)
    scale = parameters(shape) / parameters(nearest)
    per_rank = -(-setup.batch * setup.n_samples // setup.model_gpus)
    train_batches = len(setup.trained) * -(-per_rank // setup.train_micro_batch)
    return Costs(
        decode_s=slopes["decode_s"],
        decode_per_request_s=slopes["decode_per_request_s"],
        dispatch_s=defaults["oppo_dispatch_s"],
        oppo_dispatch_s=defaults["oppo_dispatch_s"],
        forward_s=slopes["forward_s"],
        call_s=defaults["by_shape"][nearest]["call_s"] * scale,
        train_s=defaults["by_shape"][nearest]["train_per_micro_batch_s"] * train_batches * scale,
        train_per_token_s=slopes["train_per_token_s"],
        sync_s=defaults["sync_per_parameter_s"] * parameters(shape),
        other_s=defaults["other_s"],
        decode_busy=defaults["decode_busy"],
        train_busy=defaults["train_busy"],
    )


def shape_slopes(calibration: dict, shape: str) -> dict:
    """The shape's calibrated slopes, or the nearest calibrated shape's scaled by parameters."""
    shapes = calibration["shapes"]
    if shape in shapes and shapes[shape].get("runs", 0) >= calibration.get("min_runs", 2):
        return shapes[shape]
    known = [s for s in shapes if shapes[s].get("runs", 0) >= calibration.get("min_runs", 2)]
    nearest = _nearest(known, shape)
    ratio = parameters(shape) / parameters(nearest)
    scaled = {k: shapes[nearest][k] * ratio for k in SCALED_FROM_PARAMETERS}
    if shape in shapes:  # decoding was measured for the shape itself
        scaled.update({k: shapes[shape][k] for k in ("decode_s", "decode_per_request_s")})
    return dict(scaled, scaled_from=nearest, ratio=ratio)


def _nearest(shapes, shape: str) -> str:
    """The shape nearest ``shape`` by the ratio of their parameters (0.5B is nearer 1.5B than a 22M model)."""
    return min(shapes, key=lambda s: abs(math.log(parameters(s) / parameters(shape))))


def extrapolation(calibration: dict, shape: str) -> Optional[str]:
    """What a prediction of ``shape`` takes from other shapes, in a sentence; None where it has runs enough."""
    slopes = shape_slopes(calibration, shape)
    if "scaled_from" not in slopes:
        return None
    own = calibration["shapes"].get(shape, {}).get("runs", 0)
    decode = ", its decoding from its own run" if own else ""
    return (
        f"extrapolated: {shape} has {own} calibrated run{'s' * (own != 1)} on this card; its per-token costs are "
        f"{slopes['scaled_from']}'s scaled by parameters ({slopes['ratio']:.2f}x){decode}"
    )


# -- cards -----------------------------------------------------------------------------------------------------


def for_card(calibration: dict, card: str) -> dict:
    """The calibration of ``card``: its own runs' shapes and placements, and for what it has no runs of, the card
    with the most runs scaled by the two cards' data sheets (``CARDS``). ``notes`` says which is which."""
    cards = calibration["cards"]
    source = max(cards, key=lambda c: len(cards[c]["sync_runs"]))
    base = cards[source] if source == card else _scaled(cards[source], source, card)
    own = cards.get(card, dict(shapes={}, intercepts={}, sync_runs=[]))
    # A shape of its own with fewer runs than a slope needs keeps the other card's scaled slopes, not an
    # extrapolation from another shape.
    enough = {s: f for s, f in own["shapes"].items() if f.get("runs", 0) >= calibration.get("min_runs", 2)}
    shapes = dict(base["shapes"], **enough)
    intercepts = {}
    for placement in set(base["intercepts"]) | set(own["intercepts"]):
        mine, theirs = own["intercepts"].get(placement), base["intercepts"].get(placement)
        merged = dict(mine or theirs)
        merged["by_shape"] = dict((theirs or {}).get("by_shape", {}), **(mine or {}).get("by_shape", {}))
        intercepts[placement] = merged
    notes = []
    if source != card:
        a, b = CARDS[card], CARDS[source]
        scaled = (
            f"the {b['name']} calibration scaled by memory bandwidth for decoding ({a['memory_tbs']:g} vs "
            f"{b['memory_tbs']:g} TB/s) and by bf16 compute for the rest ({a['bf16_tflops']:g} vs "
            f"{b['bf16_tflops']:g} TFLOPS)"
        )
        mine = ", ".join(sorted(enough))
        runs = len(own["sync_runs"])
        if mine:
            note = f"{mine} from its own runs, the rest from {scaled}"
        elif runs:
            note = (
                f"{runs} run{'s' * (runs != 1)} of its own, too few for a shape's slopes (the fixed costs of its "
                f"placement come from {'them' if runs != 1 else 'it'}), the slopes from {scaled}"
            )
        else:
            note = f"no runs of its own, {scaled}"
        notes.append(f"{a['name']}: {note}")
    return dict(calibration, card=card, shapes=shapes, intercepts=intercepts, sync_runs=own["sync_runs"], notes=notes)


def _scaled(calibration: dict, source: str, target: str) -> dict:
    """``source``'s calibration as ``target``'s: decoding by memory bandwidth, forward passes and training by
    compute; the fixed costs (calls, dispatch, the weight sync over NVLink) as they are."""
    memory = CARDS[source]["memory_tbs"] / CARDS[target]["memory_tbs"]
    compute = CARDS[source]["bf16_tflops"] / CARDS[target]["bf16_tflops"]
    shapes = {}
    for shape, figures in calibration["shapes"].items():
        figures = dict(figures)
        figures.update({k: figures[k] * memory for k in MEMORY_BOUND})
        figures.update({k: figures[k] * compute for k in COMPUTE_BOUND})
        shapes[shape] = figures
    return dict(calibration, shapes=shapes)


# -- the calibration over every sync run ------------------------------------------------------------------


def sync_runs(results_dir: str):
    """(folder name, Run, Setup) of every upstream sync system with a known workload under ``results_dir``."""
    for folder in sorted(glob.glob(os.path.join(results_dir, "*", ""))):
        for name, run in runs_.harness_runs(folder).items():
            if not name.startswith("upstream-sync") or run.lengths is None or run.shape not in tiny.SHAPES:
                continue
            args = runs_.parse_flags(run.flags)
            if runs_.system_of(args) != "sync":
                continue
            yield os.path.basename(os.path.normpath(folder)), run, runs_.setup_of(args, run.prompt_tokens)


def _pooled_slope(samples: Dict[str, list]) -> float:
    """The slope of y on x from the variation within each group (each keeps its own intercept)."""
    num = den = 0.0
    for points in samples.values():
        if len(points) < 2:
            continue
        mx = statistics.mean(x for x, _ in points)
        my = statistics.mean(y for _, y in points)
        num += sum((x - mx) * (y - my) for x, y in points)
        den += sum((x - mx) ** 2 for x, _ in points)
    return num / den if den else 0.0


def _pooled_two(samples: Dict[str, list]) -> tuple:
    """The two slopes of y on (x1, x2), within each group."""
    sxx = [[0.0, 0.0], [0.0, 0.0]]
    sxy = [0.0, 0.0]
    for points in samples.values():
        if len(points) < 3:
            continue
        m = [statistics.mean(p[i] for p in points) for i in range(3)]
        for p in points:
            d = [p[i] - m[i] for i in range(3)]
            for i in range(2):
                sxy[i] += d[i] * d[2]
                for j in range(2):
                    sxx[i][j] += d[i] * d[j]
    det = sxx[0][0] * sxx[1][1] - sxx[0][1] * sxx[1][0]
    if abs(det) < 1e-30:
        return (_pooled_slope({k: [(p[0], p[2]) for p in v] for k, v in samples.items()}), 0.0)
    a = (sxy[0] * sxx[1][1] - sxy[1] * sxx[0][1]) / det
    b = (sxx[0][0] * sxy[1] - sxx[1][0] * sxy[0]) / det
    return a, b


def calibrate(results_dir: str) -> dict:
    """Per card, fit the slopes per shape and the intercepts' medians per placement from its upstream sync runs."""
    by_card: Dict[str, list] = {}
    for folder, run, setup in sync_runs(results_dir):
        if run.card in CARDS:
            by_card.setdefault(run.card, []).append((folder, run, setup))
    cards = {card: _calibrate_card(items) for card, items in sorted(by_card.items())}
    return dict(command=CALIBRATE_COMMAND, min_runs=2, cards=cards)


def _calibrate_card(runs: list) -> dict:
    by_shape: Dict[str, list] = {}
    for folder, run, setup in runs:
        by_shape.setdefault(run.shape, []).append((folder, run, setup))
    shapes, intercepts, used = {}, {}, []
    for shape, items in sorted(by_shape.items()):
        decode, forward, train = {}, {}, {}
        for folder, run, setup in items:
            key = f"{folder}/{run.name}"
            for step, lengths in list(zip(run.steps, batches(run, setup)))[run.warmup : run.warmup + run.measured]:
                if len(lengths) < setup.batch * setup.n_samples:
                    continue
                longest, tokens = decode_terms(lengths, setup)
                decode.setdefault(key, []).append((longest, tokens, step["timing/generation"]))
                forward.setdefault(key, []).append((forward_tokens(lengths, setup), step["timing/make_experience"]))
                train.setdefault(key, []).append((training_tokens(lengths, setup), step["timing/ppo_train"]))
        decode_s, per_request = _pooled_two(decode)
        shapes[shape] = dict(
            runs=len(items),
            steps=sum(len(v) for v in decode.values()),
            decode_s=max(decode_s, 1e-5),
            decode_per_request_s=max(per_request, 0.0),
            forward_s=statistics.median(sum(y for _, y in v) / sum(x for x, _ in v) for v in forward.values()),
            forward_slope_s=max(_pooled_slope(forward), 0.0),
            train_per_token_s=max(_pooled_slope(train), 0.0),
        )
        used += [f"{folder}/{run.name}" for folder, run, _ in items]
    # Intercepts: what each run's own steps leave past the slopes, per placement, for setups nobody ran.
    rows: Dict[str, list] = {}
    unused = dict(oppo_dispatch_s=0.0, decode_busy=0.0, train_busy=0.0)  # what from_sync_run takes as given
    for shape, items in by_shape.items():
        if shapes[shape]["runs"] < 2:
            continue
        for _, run, setup in items:
            costs = from_sync_run(run, setup, shapes[shape], unused)
            per_rank = -(-setup.batch * setup.n_samples // setup.model_gpus)
            placement = "colocated" if setup.colocated else "split"
            rows.setdefault(placement, []).append(
                dict(
                    shape=shape,
                    patched=run.patched,
                    dispatch_s=costs.dispatch_s,
                    call_s=costs.call_s,
                    train_per_micro_batch_s=costs.train_s
                    / (len(setup.trained) * -(-per_rank // setup.train_micro_batch)),
                    sync_per_parameter_s=costs.sync_s / parameters(shape),
                    other_s=costs.other_s,
                    **(busy_shares(run) or {}),
                )
            )
    for placement, items in rows.items():
        patched = [r for r in items if r["patched"]] or items
        by_shape = {}
        for shape in sorted({r["shape"] for r in patched}):
            own = [r for r in patched if r["shape"] == shape]
            by_shape[shape] = dict(
                runs=len(own),
                call_s=statistics.median(r["call_s"] for r in own),
                train_per_micro_batch_s=statistics.median(r["train_per_micro_batch_s"] for r in own),
            )
        intercepts[placement] = dict(
            runs=len(patched),
            by_shape=by_shape,
            oppo_dispatch_s=statistics.median(r["dispatch_s"] for r in patched),
            sync_per_parameter_s=statistics.median(r["sync_per_parameter_s"] for r in patched),
            other_s=statistics.median(r["other_s"] for r in patched),
            decode_busy=statistics.median(r["decode_busy"] for r in patched if "decode_busy" in r),
            train_busy=statistics.median(r["train_busy"] for r in patched if "train_busy" in r),
        )
    return dict(shapes=shapes, intercepts=intercepts, sync_runs=used)


def load(path: str = CALIBRATION) -> dict:
    with open(path) as f:
        return json.load(f)


def save(calibration: dict, path: str = CALIBRATION) -> None:
    with open(path, "w") as f:
        json.dump(calibration, f, indent=1, sort_keys=True)
        f.write("\n")
