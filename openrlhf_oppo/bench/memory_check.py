"""The memory estimate (``openrlhf_oppo.memory``) against the peaks the benchmark measured.

    python -m openrlhf_oppo.bench.memory_check docs/results [--into docs/memory.md]

Every speed run in the folder (a ``results.json`` with NVML samples) is rebuilt from its recorded flags, with the
checkpoints' shape (``--shape``) and the workload's longest sequence (prompt and response) in place of
``--data.max_len``, since its labels fix every response's length. Each GPU's estimate is compared with the
largest sample of that GPU, in the order the placement asks Ray for them.
"""

import argparse
import contextlib
import glob
import io
import os
import re
import statistics
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from openrlhf_oppo import memory, plan, tiny, topology
from openrlhf_oppo.bench import report

TOLERANCE = 0.15
# The benchmark's GPUs, as NVML counts them (MiB).
GPU_MIB = {"NVIDIA H200": 143771, "NVIDIA H100 80GB HBM3": 81559}
TABLE_START = "<!-- validation: python -m openrlhf_oppo.bench.memory_check docs/results --into docs/memory.md -->"
TABLE_END = "<!-- end of validation -->"


@dataclass(frozen=True)
class Row:
    run: str
    card: str
    system: str
    gpu: int
    label: str
    phase: str
    measured_gib: float
    estimated_gib: float

    @property
    def error(self) -> float:
        return self.estimated_gib / self.measured_gib - 1


@lru_cache(maxsize=None)
def _parsed(flags: tuple, shape: str):
    from openrlhf_oppo.bench.driver import parse_args

    with contextlib.redirect_stdout(io.StringIO()):  # the plan's log line
        return parse_args([on_this_machine(flag, shape) for flag in flags])


@lru_cache(maxsize=None)
def _stand_in_folder(shape: str) -> str:
    """Where a stored run's ``WORKDIR`` and ``SCRATCH`` point here: its checkpoints' configs (the preflight looks
    for them, and the plan reads the shapes from them) and a prompt."""
    import json
    import tempfile

    folder = tempfile.mkdtemp(prefix="memory-check-")
    for model in ("actor", "reward"):
        tiny.qwen2_config(shape).save_pretrained(os.path.join(folder, "models", model))
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        f.write(json.dumps(dict(input="1 + 1 =", length=1, answer="2")) + "\n")
    return folder


def on_this_machine(flag: str, shape: str) -> str:
    for placeholder in ("WORKDIR", "SCRATCH"):
        flag = flag.replace(placeholder, _stand_in_folder(shape))
    return flag.replace("$PWD", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _args(flags: list, shape: str = "tiny"):
    """The namespace upstream's ``train`` would get for ``flags`` (parsed once; the estimate only reads it), its
    checkpoints of ``shape``."""
    return _parsed(tuple(flags), shape)


def card(results: dict) -> str:
    return results["machine"]["gpus"][0]


def gpu_gib(results: dict) -> float:
    return GPU_MIB[card(results)] / 1024


def run_estimate(results: dict, result: dict) -> memory.Estimate:
    """The estimate for one system of a run, from its flags, the run's shape and its longest sequence, in the
    layout the run had (``run_layout``)."""
    shape = memory.model_shape(tiny.qwen2_config(results["settings"]["shape"]))
    shapes = dict(policy=shape, reference=shape, critic=shape, reward=shape)
    longest = results["settings"]["prompt_tokens"] + results["workload"]["max_length"]
    args, layout = run_layout(results, result)
    return memory.estimate(args, layout, gpu_gib(results), shapes=shapes, longest=longest)


def run_layout(results: dict, result: dict):
    """The parsed flags of one system and the memory layout it ran with: its plan rebuilt on the run's GPU, with
    the scorers it streamed to where its steps record them (``streamed_roles``). A plan rebuilt with today's
    estimate may keep less streaming than the run's own plan did; the estimate is of what ran, so the rebuild then
    keeps streaming on (``--oppo.intra_step on``) to the roles the run streamed to. The run's cache budget is not
    recorded: the rebuild takes the largest the plan gives (``plan.CACHE_BUDGET_GB``), where the flags give none."""
    flags = result["flags"] + _plan_flags(result["flags"], gpu_gib(results))
    recorded = streamed_roles(result)
    shape = results["settings"]["shape"]
    args = _args(flags, shape)
    layout = plan.resolve(args).memory.layout
    if recorded is None or set(layout.streamed_roles) == recorded:
        return args, layout
    pins = [] if "--oppo.intra_step" in flags else ["--oppo.intra_step", "on"]
    pins += [] if "--oppo.cache_budget_gb" in flags else ["--oppo.cache_budget_gb", str(plan.CACHE_BUDGET_GB)]
    if pins:
        args = _args(flags + pins, shape)
        layout = plan.resolve(args).memory.layout
    roles = tuple(role for role in topology.models(args) if role in recorded)
    return args, replace(layout, streamed_roles=roles)


def streamed_roles(result: dict) -> Optional[set]:
    """The roles a system streamed to: its scorers report ``oppo/streaming_off/<role>`` every step, one per
    streamed role. None where no step has one: nothing streamed, or a run from before the metric."""
    prefix = "oppo/streaming_off/"
    roles = {key[len(prefix) :] for step in result.get("steps") or [] for key in step if key.startswith(prefix)}
    return roles or None


def _plan_flags(flags: list, gpu_gib: float) -> list:
    """A system given ``--oppo.enable`` alone ran the plan, which read its GPU's memory: the rebuild gives it that
    GPU's. The others pinned their mechanisms, as the plan's speed-for-memory choices keep them here."""
    if "--oppo.enable" not in flags:
        return []
    if {flag for flag in flags if flag.startswith("--oppo.")} <= {"--oppo.enable", "--oppo.colocate_models"}:
        return ["--oppo.gpu_memory_gb", f"{gpu_gib:.1f}"]
    return ["--oppo.memory_flags", "as_given"]


def speed_runs(results_dir: str):
    """(folder name, results) of every speed run in ``results_dir``."""
    for folder in sorted(glob.glob(os.path.join(results_dir, "*", ""))):
        results = report.run_results(folder)
        if results and "systems" in results and "task" not in results and "workload" in results:
            yield os.path.basename(os.path.normpath(folder)), results


def rows(results_dir: str) -> list:
    """One row per GPU of every system of every speed run in ``results_dir`` that sampled memory."""
    out = []
    for run, results in speed_runs(results_dir):
        for system, result in results["systems"].items():
            measured = report.gpu_memory_peaks(result)
            if not measured:
                continue
            estimate = run_estimate(results, result)
            for gpu, (peak, value) in enumerate(zip(estimate.per_gpu, measured)):
                out.append(Row(run, card(results), system, gpu, peak.label, peak.phase, value, peak.peak_gib))
    return out


# The phases the model actors record (``oppo/memory/<role>_<phase>_peak_gb``), by the estimate's names.
PHASES = {"generation": "generation", "make_experience": "make_experience", "training": "training"}
PHASES["weight_sync"] = "weight sync"
ROLE_PEAK = re.compile(r"^oppo/memory/(policy|critic|reward|reference)_(\w+?)_peak(_allocated)?_gb$")


@dataclass(frozen=True)
class RoleRow:
    """One role's process in one phase: the most its allocator reserved (and its tensors held) against the
    estimate's parts of that role in that phase, without the CUDA context (which no allocator counts)."""

    run: str
    card: str
    system: str
    role: str
    phase: str
    reserved_gib: float
    allocated_gib: float
    estimated_gib: float

    @property
    def error(self) -> float:
        return self.estimated_gib / self.reserved_gib - 1


def measured_role_peaks(result: dict) -> dict:
    """(role, phase) -> [reserved, allocated] GiB: the largest of the steps' readings (each is the most since the
    start)."""
    peaks = {}
    for step in result.get("steps") or []:
        for key, value in step.items():
            match = ROLE_PEAK.match(key)
            if match and match.group(2) in PHASES:
                entry = peaks.setdefault((match.group(1), match.group(2)), [0.0, 0.0])
                index = 1 if match.group(3) else 0
                entry[index] = max(entry[index], value)
    return peaks


def role_rows(results_dir: str) -> list:
    """One row per role and phase of every system that recorded its actors' peaks."""
    out = []
    for run, results in speed_runs(results_dir):
        for system, result in results["systems"].items():
            peaks = measured_role_peaks(result)
            if not peaks:
                continue
            estimate = run_estimate(results, result)
            for (role, phase), (reserved, allocated) in sorted(peaks.items()):
                if reserved <= 0:
                    continue
                estimated = max(gpu.role_gib(role, PHASES[phase]) for gpu in estimate.per_gpu)
                out.append(RoleRow(run, card(results), system, role, phase, reserved, allocated, estimated))
    return out


def role_table(all_rows: list) -> str:
    """Each role's process by phase: measured against estimated, and the summary line."""
    if not all_rows:
        return "No stored run recorded its actors' peaks by phase.\n"
    lines = []
    for name in sorted({row.card for row in all_rows}):
        errors = sorted(abs(row.error) for row in all_rows if row.card == name)
        within = sum(error <= TOLERANCE for error in errors)
        lines.append(
            f"- {name}: {len(errors)} role-phases, median error {100 * statistics.median(errors):.1f}%, largest "
            f"{100 * errors[-1]:.1f}%; {within} ({100 * within / len(errors):.0f}%) within {100 * TOLERANCE:.0f}%."
        )
    lines += [
        "",
        "| run | system | role | phase | reserved GiB | allocated GiB | estimated GiB | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in all_rows:
        mark = " **" if abs(r.error) > TOLERANCE else ""
        lines.append(
            f"| {r.run} | {r.system} | {r.role} | {r.phase} | {r.reserved_gib:.1f} | {r.allocated_gib:.1f} "
            f"| {r.estimated_gib:.1f} | {100 * r.error:+.1f}%{mark} |"
        )
    return "\n".join(lines) + "\n"


def ran_out_of_memory(result: dict) -> bool:
    return "out of memory" in (result.get("log_tail") or "").lower()


def refusals(results_dir: str) -> list:
    """(run, system, estimate) of every system that stopped with CUDA out of memory: the estimate should not fit."""
    return [
        (run, system, run_estimate(results, result))
        for run, results in speed_runs(results_dir)
        for system, result in results["systems"].items()
        if ran_out_of_memory(result)
    ]


def refusal_table(refused: list) -> str:
    lines = [
        "Systems that stopped with CUDA out of memory, and the estimate's line for them:",
        "",
        "| run | system | estimate |",
        "|---|---|---|",
    ]
    lines += [f"| {run} | {system} | {estimate.line()} |" for run, system, estimate in refused]
    return "\n".join(lines) + "\n"


def summary(all_rows: list) -> dict:
    errors = sorted(abs(row.error) for row in all_rows)
    return dict(
        gpus=len(all_rows),
        median=statistics.median(errors),
        max=errors[-1],
        within=sum(error <= TOLERANCE for error in errors),
    )


def _summary_line(some_rows: list, what: str) -> str:
    s = summary(some_rows)
    return (
        f"- {what}: {s['gpus']} GPUs in {len({(r.run, r.system) for r in some_rows})} systems: median error "
        f"{100 * s['median']:.1f}%, largest {100 * s['max']:.1f}%; {s['within']} GPUs "
        f"({100 * s['within'] / s['gpus']:.0f}%) within {100 * TOLERANCE:.0f}%."
    )


def table(all_rows: list) -> str:
    """The summary line, then one row per system: each GPU's measured and estimated peak, and the estimate's
    largest error (marked past the tolerance)."""
    lines = [_summary_line(all_rows, "All cards")]
    for name in sorted({row.card for row in all_rows}):
        lines.append(_summary_line([row for row in all_rows if row.card == name], name))
    lines += [
        "",
        "| run | system | measured GiB | estimated GiB | estimate's phase | largest error |",
        "|---|---|---|---|---|---|",
    ]
    systems = {}
    for row in all_rows:
        systems.setdefault((row.run, row.system), []).append(row)
    for (run, system), gpus in systems.items():
        worst = max(gpus, key=lambda row: abs(row.error))
        mark = " **" if abs(worst.error) > TOLERANCE else ""
        lines.append(
            f"| {run} | {system} | {' / '.join(f'{r.measured_gib:.1f}' for r in gpus)} "
            f"| {' / '.join(f'{r.estimated_gib:.1f}' for r in gpus)} | {worst.phase} ({worst.label}) "
            f"| {100 * worst.error:+.1f}%{mark} |"
        )
    return "\n".join(lines) + "\n"


def validation(results_dir: str) -> str:
    """docs/memory.md's validation block: each GPU against NVML, each role's process by phase against its
    allocator, and the runs that ran out of memory."""
    return "\n".join(
        [table(rows(results_dir)), role_table(role_rows(results_dir)), refusal_table(refusals(results_dir))]
    )


def replace_table(markdown: str, table_md: str) -> str:
    start, end = markdown.index(TABLE_START) + len(TABLE_START), markdown.index(TABLE_END)
    return markdown[:start] + "\n\n" + table_md + "\n" + markdown[end:]


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir")
    parser.add_argument("--into", help="replace the validation block of this markdown file")
    options = parser.parse_args(argv)
    table_md = validation(options.results_dir)
    if options.into:
        with open(options.into) as f:
            markdown = f.read()
        with open(options.into, "w") as f:
            f.write(replace_table(markdown, table_md))
    else:
        print(table_md)


if __name__ == "__main__":
    main()
