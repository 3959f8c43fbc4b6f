"""docs/results and docs/RESULTS.md are what bench.report makes of the committed raw results: each run's README
ends with its command, files and tables, and the results page is the summary of every run folder."""

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_oppo.bench import learning_report, report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
RUNS = sorted(p for p in RESULTS.iterdir() if p.is_dir() and report.raw_files(str(p)))
FOLDERS = sorted(str(p) + "/" for p in RESULTS.iterdir() if p.is_dir())


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_each_runs_readme_ends_with_what_its_raw_results_give(folder):
    results = report.run_results(str(folder))
    assert results["machine"]["gpus"] and results["command"].startswith("python -m openrlhf_oppo.bench")
    assert results["commit"], f"{folder.name}: no commit in the raw results and no commit.txt"
    readme = (folder / "README.md").read_text()
    assert readme.startswith(f"# {folder.name}\n") and readme.endswith(report.section(str(folder)))


STEP_LOGS = sorted(p for p in RESULTS.iterdir() if p.is_dir() and list(p.glob(learning_report.STEP_LOGS)))


@pytest.mark.parametrize("folder", STEP_LOGS, ids=[p.name for p in STEP_LOGS])
def test_each_folder_of_per_step_logs_ends_with_the_tables_they_give(folder):
    """Learning runs that ended before the benchmark wrote their results keep their per-step logs; the folder's
    README ends with what ``learning_report.step_logs_table`` makes of them."""
    assert not report.raw_files(str(folder))
    readme = (folder / "README.md").read_text()
    assert readme.startswith(f"# {folder.name}\n") and readme.endswith(learning_report.step_logs_table(str(folder)))


# A run of each kind whose plots report.write draws: by a predicate on its results, the plots expected.
PLOTTED_KINDS = {
    "speed": (
        lambda results: any(r.get("summary") for r in results["systems"].values()),
        ("breakdown.png", "timeline.png"),
    ),
    "learning": (
        lambda results: "task" in results,
        ("accuracy-by-step.png", "accuracy-by-time.png", "signals-by-step.png"),
    ),
    "convergence": (
        lambda results: report.is_convergence(results) and "task" not in results,
        ("convergence.png",),
    ),
    "memory": (lambda results: any(report.memory_keys(r) for r in results["systems"].values()), ("memory.png",)),
}


def test_report_writes_the_table_and_the_plots_of_each_kind_of_run(tmp_path):
    """``report --out`` on the first committed run of each kind: its table.md and its plots (drawing them for
    every run would repeat the same code for more than a minute on two cores)."""
    found = {}
    for folder in RUNS:
        results = report.run_results(str(folder))
        for kind, (is_kind, _) in PLOTTED_KINDS.items():
            if kind not in found and is_kind(results):
                found[kind] = results
        if len(found) == len(PLOTTED_KINDS):
            break
    assert set(found) == set(PLOTTED_KINDS), f"no committed run of these kinds: {set(PLOTTED_KINDS) - set(found)}"
    for kind, results in found.items():
        out = tmp_path / kind
        report.write(results, str(out))
        assert (out / "table.md").read_text() == report.table(results)
        for plot in PLOTTED_KINDS[kind][1]:
            assert (out / plot).stat().st_size > 0, (kind, plot)


@pytest.mark.process
def test_results_page_is_the_summary_of_the_run_folders():
    """``report --summary docs/results/*/ > docs/RESULTS.md`` gives the committed page, short enough to read."""
    made = subprocess.run(
        [sys.executable, "-m", "openrlhf_oppo.bench.report", "--summary", *FOLDERS],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    page = (ROOT / "docs" / "RESULTS.md").read_text()
    assert made == page
    assert len(page.splitlines()) <= 150
    # Every folder is linked, each run once; a table per placement, GPU count and shape; patched runs lead.
    for folder in FOLDERS:
        name = Path(folder).name
        assert page.count(f"[{name}](results/{name}/)") == 1, name
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[:5] == [
        "## Colocated, 1 GPU, qwen2.5-0.5b",
        "## Colocated, 1 GPU, qwen2.5-1.5b",
        "## Split, 2 GPUs, qwen2.5-1.5b",
        "## Split, 4 GPUs, qwen2.5-3b",
        "## Split, 4 GPUs, qwen2.5-7b",
    ]
    first_row = page.split(report.SPEED_HEADER)[1].splitlines()[2]
    assert first_row.split(" | ")[2] == "patched"


def test_every_folder_has_a_readme_and_every_link_resolves():
    """Each folder says what it holds; the links of the results page, the runs' READMEs and the docs lead to
    files that are there (the plots are not kept: ``report --out`` redraws them)."""
    assert all((Path(folder) / "README.md").exists() for folder in FOLDERS)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.glob("**/README.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"\w+://", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_committed_results_stay_small():
    """The raw results are kept packed (``report --pack``): docs/results stays a download of a few megabytes."""
    total = sum(path.stat().st_size for path in RESULTS.glob("**/*") if path.is_file())
    assert total <= 10 * 2**20
    assert not list(RESULTS.glob("*/results*.json")) and not list(RESULTS.glob("*/table.md"))
    assert not [path for path in RESULTS.glob("*/*.png") if path.name in report.PLOTS]


@pytest.mark.process
def test_pack_keeps_the_raw_results_and_drops_what_report_redraws(tmp_path):
    """``--pack`` gzips the JSON the benchmark wrote without its indentation (a plain results.json reads the
    same), and leaves out table.md and the plots; packing again changes nothing; a results.json written after
    packing is the one read."""
    source, folder = RESULTS / "split-2gpu-1.5b-lognormal-patched-top-up-at-step-end", tmp_path / "a-run"
    shutil.copytree(source, folder)
    packed = report.run_results(str(folder))
    (folder / "results.json.gz").unlink()
    (folder / "results.json").write_text(json.dumps(report.load(str(source / "results.json.gz"))))
    (folder / "table.md").write_text("old table\n")
    (folder / "timeline.png").write_bytes(b"png")
    assert report.raw_files(str(folder)) == [str(folder / "results.json")]
    assert report.run_results(str(folder)) == packed
    subprocess.run([sys.executable, "-m", "openrlhf_oppo.bench.report", "--pack", str(folder)], check=True, cwd=ROOT)
    assert sorted(p.name for p in folder.glob("results*")) == ["results.json.gz"]
    assert not (folder / "table.md").exists() and not (folder / "timeline.png").exists()
    assert report.run_results(str(folder)) == packed
    with gzip.open(folder / "results.json.gz", "rt") as f:
        assert json.load(f) == report.load(str(source / "results.json.gz"))
    indented = gzip.compress(json.dumps(packed, indent=1).encode(), compresslevel=9)
    assert (folder / "results.json.gz").stat().st_size < len(indented)
    once = (folder / "results.json.gz").read_bytes()
    report.pack(str(folder))
    assert (folder / "results.json.gz").read_bytes() == once
    newer = dict(packed, date="later")
    (folder / "results.json").write_text(json.dumps(newer))
    assert report.run_results(str(folder))["date"] == "later"


def test_gpu_memory_peaks_are_each_gpus_most_over_the_systems_samples():
    result = {"gpu_samples": [[0.0, [10, 90], [3.5, 70.25]], [0.1, [20, 80], [5.0, 60.0]], [0.2, [0, 0], [4.0, 71.0]]]}
    assert report.gpu_memory_peaks(result) == [5.0, 71.0]
    assert report.gpu_memory_peaks({"gpu_samples": []}) == [] and report.gpu_memory_peaks({}) == []
    run = report.run_results(str(RESULTS / "split-2gpu-1.5b-lognormal-patched-top-up-at-step-end"))
    for name, result in run["systems"].items():
        peaks = report.gpu_memory_peaks(result)
        assert len(peaks) == 2 and all(0 < peak <= 141 for peak in peaks), name  # two H200s, GiB
        assert peaks == [max(sample[2][gpu] for sample in result["gpu_samples"]) for gpu in range(2)]


def test_summary_ratios_and_failures(tmp_path):
    """Speed-ups are taken against upstream sync and async of the same run; a failed system shows its exit code,
    and one that failed after some measured steps shows how many, not a mean over them."""
    run = report.run_results(str(RESULTS / "split-2gpu-1.5b-lognormal-unpatched-repeat"))
    run["systems"]["oppo-intra"] = dict(returncode=1, steps=[])
    cut_short = json.loads(json.dumps(run["systems"]["oppo-both"]))
    cut_short["summary"]["steps"], cut_short["returncode"] = run["settings"]["steps"] - 3, 1
    run["systems"]["oppo-inter"] = cut_short
    del run["commit"]  # taken from commit.txt where the raw results have none
    folder = tmp_path / "a-run"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(run))  # as the benchmark writes it, not packed
    (folder / "commit.txt").write_text("abc1234\n")
    row = next(line for line in report.summary([str(folder)]).splitlines() if "[a-run](results/a-run/)" in line)
    cells = [cell.split("<br>") for cell in row[2:-2].split(" | ")]
    assert cells[4] == ["abc1234"] and cells[6:8] == [["16.99"], ["10.08"]]
    assert cells[8] == ["oppo-both", "oppo-intra", "oppo-inter"]
    assert cells[9] == ["7.32", "failed (exit 1)", "failed (exit 1, 2 of 5 steps)"]
    assert [column[0] for column in cells[10:]] == ["2.32x", "1.38x", "2.28x", "1.35x"]
    assert [column[1:] for column in cells[10:]] == [["-", "-"]] * 4
    assert "| oppo-inter | failed (exit 1, 2 of 5 steps) |" in report.table(report.run_results(str(folder)))


def test_tokens_trained_are_the_responses_of_the_measured_steps():
    """With Delta equal to the batch, OPPO's warm-up step trains the shortest responses and its measured steps
    more tokens than the baselines': the tokens/s ratios compare the systems at equal work."""
    run = report.run_results(str(RESULTS / "split-4gpu-3b-lognormal-patched-policy-logprobs-vllm"))
    warmup, count = run["settings"]["warmup"], run["settings"]["steps"]
    trained = {}
    for name, result in run["systems"].items():
        steps = result["steps"][warmup : warmup + count]
        responses = sum(s["rollout/num_samples"] * s["rollout/response_length_mean"] for s in steps)
        trained[name] = report.trained_tokens(result["summary"])
        assert trained[name] == pytest.approx(responses)
    assert trained["oppo-both-delta64-policy-logprobs-vllm"] > 1.1 * trained["upstream-async"]
    assert trained["upstream-sync"] == pytest.approx(trained["upstream-async"])
    row = next(
        line
        for line in report.table(run).splitlines()
        if line.startswith("| oppo-both-delta64-policy-logprobs-vllm |")
    )
    oppo, asynchronous = (
        run["systems"][n]["summary"] for n in ("oppo-both-delta64-policy-logprobs-vllm", "upstream-async")
    )
    by_step = asynchronous["step_mean_s"] / oppo["step_mean_s"]
    by_token = oppo["tokens_per_s"] / asynchronous["tokens_per_s"]
    assert f"| {by_step:.2f}x / {by_token:.2f}x |" in row and by_token > by_step


def test_same_samples_table_compares_only_the_steps_with_equal_work():
    """An OPPO step is set beside a baseline's step of the same global step only where both trained as many
    samples with the same mean length; the warm-up is left out, and each row averages its own steps."""

    def steps(*trained):
        return [
            {"step": i + 1, "wall_s": wall, "rollout/num_samples": 4, "rollout/response_length_mean": length}
            for i, (length, wall) in enumerate(trained)
        ]

    ok = {"summary": {"step_mean_s": 1.0}}
    run = {
        "settings": {"warmup": 1, "steps": 3},
        "systems": {
            "upstream-sync": {**ok, "steps": steps((10, 9.0), (10, 4.0), (30, 6.0), (50, 8.0))},
            "upstream-async": {**ok, "steps": steps((10, 9.0), (10, 3.0), (30, 3.0), (50, 3.0))},
            "oppo-both": {**ok, "steps": steps((10, 9.0), (5, 1.0), (30, 2.0), (50, 4.0))},
        },
    }
    rows = report.same_samples_table(run)[2:]
    assert rows == [
        "| oppo-both | upstream-sync | 2 of 3 (3, 4) | 3.00 | 7.00 | 2.33x |",
        "| oppo-both | upstream-async | 2 of 3 (3, 4) | 3.00 | 3.00 | 1.00x |",
    ]
    run["systems"]["oppo-both"]["steps"][1]["rollout/response_length_mean"] = 10
    assert report.same_samples_table(run)[2].startswith("| oppo-both | upstream-sync | all 3 | 2.33 | 6.00 |")
    for name in ("oppo-both", "upstream-sync"):  # a step that logged neither figure is not known to be equal
        for key in ("rollout/num_samples", "rollout/response_length_mean"):
            run["systems"][name]["steps"][2].pop(key)
    assert report.same_samples_table(run)[2] == "| oppo-both | upstream-sync | 2 of 3 (2, 4) | 2.50 | 6.00 | 2.40x |"
    del run["systems"]["oppo-both"]
    assert report.same_samples_table(run) == []  # no OPPO system, no table


def test_a_long_speed_run_gets_no_convergence_table():
    """Ten steps or more of the speed benchmark's random reward model say nothing about learning: the speed
    summary keeps the run, and only a rule reward (or the learning benchmark) makes it a convergence run."""
    folder = RESULTS / "split-2gpu-1.5b-lognormal-patched-policy-logprobs-vllm-delta32"
    run = report.run_results(str(folder))
    assert max(len(r["steps"]) for r in run["systems"].values()) >= 10
    assert not report.is_convergence(run)
    assert "Convergence" not in report.table(run)
    assert f"[{folder.name}](results/{folder.name}/)" in report.summary([str(folder)])
    run["settings"]["extra"] = ["--reward.remote_url=examples/reward/parity_reward.py"]
    assert report.is_convergence(run)
    assert "Convergence: target reward" in report.table(run)


def test_phase_bound_counts_the_models_phases_and_generation_only_where_it_shares_their_gpu():
    """The phase bound: make_experience + training + weight sync on the models' GPUs (generation too when
    colocated), or the busiest GPU's kernel time where that is longer."""
    summary = dict(generation_s=3.0, make_experience_s=0.5, ppo_train_s=5.0, broadcast_s=0.2)
    assert report.phase_bound_s(summary, 4.0, "split") == pytest.approx(5.7)
    assert report.phase_bound_s(summary, 4.0, "colocated") == pytest.approx(8.7)
    assert report.phase_bound_s(summary, 6.0, "split") == 6.0
    assert report.phase_bound_s(summary, None, "split") == pytest.approx(5.7)  # no NVML samples
    run = report.run_results(str(RESULTS / "split-2gpu-1.5b-lognormal-patched-policy-logprobs-vllm-delta32"))
    row = next(line for line in report.table(run).splitlines() if line.startswith("| upstream-sync |"))
    s = run["systems"]["upstream-sync"]["summary"]
    taken = s["make_experience_s"] + s["ppo_train_s"] + s["broadcast_s"]
    assert f"| {s['step_mean_s'] / taken:.2f} |" in row  # sync waits for generation: far from its bound


def test_gpu_busy_by_phase_counts_back_from_each_steps_end():
    """Each measured step splits, from its end back, into the weight sync, training and all before training;
    each GPU's NVML samples inside a span give its busy share there. Samples outside the measured steps (the
    warm-up) and in no step are not counted."""
    steps = [
        {"start": 0.0, "end": 10.0, "timing/ppo_train": 6.0, "timing/broadcast": 1.0},  # warm-up: not counted
        {"start": 10.0, "end": 20.0, "timing/ppo_train": 6.0, "timing/broadcast": 1.0},
        {"start": 20.0, "end": 30.0, "timing/ppo_train": 6.0, "timing/broadcast": 1.0},
    ]
    assert report.phase_spans(steps[1]) == {
        "before training": (10.0, 13.0),
        "training": (13.0, 19.0),
        "weight sync": (19.0, 20.0),
    }

    def util(t):  # GPU 0 trains (80% busy) and syncs (50%); GPU 1 decodes before training (90%)
        phase = (t % 10) // 1
        if phase < 3:
            return [10.0, 90.0]
        return [80.0, 0.0] if phase < 9 else [50.0, 20.0]

    samples = [[t / 10, util(t / 10), [1.0, 1.0]] for t in range(0, 300)]
    samples[:100] = [[t / 10, [100.0, 100.0], [1.0, 1.0]] for t in range(0, 100)]
    run = {
        "settings": {"warmup": 1, "steps": 2},
        "systems": {
            "oppo-both": {"steps": steps, "gpu_samples": samples, "summary": {"step_mean_s": 10.0}},
            "upstream-sync": {"steps": steps, "summary": {"step_mean_s": 12.0}},  # no NVML samples: no row
        },
    }
    assert report.phase_busy_table(run) == [
        "| system | GPU busy % before training | GPU busy % in training | GPU busy % in the weight sync |",
        "|---|---|---|---|",
        "| oppo-both | 10 / 90 | 80 / 0 | 50 / 20 |",
    ]
    # A step whose training took longer than its wall time (async: it began before the previous step's log).
    long = {"start": 10.0, "end": 20.0, "timing/ppo_train": 12.0, "timing/broadcast": 1.0}
    assert report.phase_spans(long)["before training"] == (10.0, 10.0)


def test_a_first_measured_step_far_above_the_others_is_noted():
    """A system whose first measured step took 1.5x or more the median of its other measured steps gets a line
    under the table: a one-time cost may weigh on its mean. The warm-up steps are not looked at."""

    def steps(walls):
        ends = [sum(walls[: i + 1]) for i in range(len(walls))]
        return [{"start": end - wall, "end": end, "wall_s": wall} for wall, end in zip(walls, ends)]

    run = {
        "settings": {"warmup": 1, "steps": 4},
        "systems": {
            "oppo-both": {"steps": steps([40.0, 18.0, 12.0, 11.0, 13.0]), "summary": {"step_mean_s": 13.5}},
            "upstream-sync": {"steps": steps([40.0, 17.0, 12.0, 11.0, 13.0]), "summary": {"step_mean_s": 13.2}},
        },
    }
    assert report.first_step_notes(run) == [
        "- oppo-both: the first measured step took 18.00 s, 1.5x the median of the others (12.00 s); a one-time cost"
        " may have fallen in it (more `--warmup` steps leave it out)."
    ]
    table = report.run_results(str(RESULTS / "colocated-1gpu-1.5b-lognormal-patched-state-moves-outside-training"))
    assert sum("the first measured step took" in line for line in report.table(table).splitlines()) == 2
    table = report.run_results(str(RESULTS / "colocated-1gpu-1.5b-lognormal-patched-two-warm-up-steps"))
    assert "the first measured step took" not in report.table(table)


def test_table_names_the_micro_batches_where_the_run_recorded_them():
    run = report.run_results(str(RESULTS / "split-4gpu-3b-lognormal-patched"))
    assert "micro-batches" not in report.table(run)  # made before the options: 8 and 2
    run["settings"].update(rollout_micro_batch=32, train_micro_batch=8)
    assert "batch: 64 prompts x 1 · micro-batches: 32 rollout, 8 training · measured steps: 5" in report.table(run)


def test_shown_command_leaves_out_the_machines_folders():
    command = (
        "python -m openrlhf_oppo.bench --gpus 2 --workdir /tmp/w --scratch /tmp/s --out /tmp/o"
        " --extra=--reward.remote_url=/home/me/oppo/examples/reward/parity_reward.py ; python -m x --out /o"
    )
    shown = report.shown_command({"command": command})
    assert shown.splitlines() == [
        "python -m openrlhf_oppo.bench --gpus 2 --out OUT \\",
        "    --extra=--reward.remote_url=$PWD/examples/reward/parity_reward.py",
        "python -m x --out OUT",
    ]


def test_raw_results_name_the_machines_folders_instead_of_giving_them():
    """What the harness writes to results.json: every whole path of its folders, in the command, the settings, the
    flags and the logs, as OUT, SCRATCH or WORKDIR; a path that only starts like one is left alone."""
    folders = dict(OUT="/m/run/o", SCRATCH="/m/run/s", WORKDIR="/m/run/s/workload")
    results = {
        "command": "python -m openrlhf_oppo.bench --workdir /m/run/s/workload --scratch /m/run/s --out /m/run/o",
        "settings": {"out": "/m/run/o", "scratch": "/m/run/s", "steps": 3},
        "systems": {"oppo-both": {"flags": ["--ckpt_path", "/m/run/s/ckpt/oppo-both", "--x=/m/run/ox"]}},
    }
    assert report.without_machine_folders(results, folders) == {
        "command": "python -m openrlhf_oppo.bench --workdir WORKDIR --scratch SCRATCH --out OUT",
        "settings": {"out": "OUT", "scratch": "SCRATCH", "steps": 3},
        "systems": {"oppo-both": {"flags": ["--ckpt_path", "SCRATCH/ckpt/oppo-both", "--x=/m/run/ox"]}},
    }
    # --scratch defaults to --out: the same folder is OUT.
    assert report.without_machine_folders("/m/o/tb", dict(OUT="/m/o", SCRATCH="/m/o")) == "OUT/tb"
    # The checkout the harness runs from: a reward function's path and a traceback's start at $PWD, an output
    # folder inside the checkout stays OUT.
    folders = report.machine_folders(str(ROOT / "runs" / "o"), None, "/m/w")
    flags = ["--reward.remote_url", f"{ROOT}/examples/reward/digit_reward.py", f"{ROOT}/runs/o/tb", f"{ROOT}x/y"]
    assert report.without_machine_folders(flags, folders) == [
        "--reward.remote_url",
        "$PWD/examples/reward/digit_reward.py",
        "OUT/tb",
        f"{ROOT}x/y",
    ]


def test_committed_raw_results_give_no_machine_folders():
    """The raw JSON in docs/results names the folders a run used (OUT, SCRATCH, WORKDIR, $PWD): no path into a
    checkout of this repository and nothing under /tmp, where every machine keeps different things."""
    into_checkout = re.compile(r"(?<![\w$.])/[\w./+-]*/(openrlhf_oppo|examples|tests)/")
    hits = []
    for path in sorted([*RESULTS.glob("**/*.json"), *RESULTS.glob("**/*.json.gz")]):
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        hits += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in into_checkout.finditer(text)]
        hits += [f"{path.relative_to(ROOT)}: /tmp/" for _ in re.finditer(r'"/tmp/', text)]
    assert not hits, "\n".join(hits[:20])
    assert into_checkout.search('"/m/checkout/openrlhf_oppo/trainer.py"')
    assert not into_checkout.search('"$PWD/openrlhf_oppo/trainer.py"')


@pytest.mark.process  # git
def test_results_record_the_commit_of_the_code():
    from openrlhf_oppo.bench.__main__ import _commit

    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    assert _commit().removesuffix("-dirty") == head.stdout.strip()


def test_memory_table_and_plot_from_logged_memory(tmp_path):
    """A run whose OPPO system logged ``oppo/memory/*`` gets a row per actor (first measured step, max, last)
    and memory.png; the systems without them get no rows."""
    run = report.run_results(str(RESULTS / "split-2gpu-1.5b-lognormal-patched-top-up-at-step-end"))
    steps = run["systems"]["oppo-both"]["steps"]
    for i, step in enumerate(steps):
        step["oppo/memory/policy_gpu_gb"] = 30.0 + (2.0 if i == 3 else 0.0)
        step["oppo/memory/rollout_host_gb"] = 4.0 + 0.25 * i
    report.write(run, str(tmp_path))
    rows = [line for line in (tmp_path / "table.md").read_text().splitlines() if "_gb |" in line]
    warmup, last = run["settings"]["warmup"], len(steps) - 1
    assert rows == [
        "| oppo-both | policy_gpu_gb | 30.00 | 32.00 | 30.00 | +0.00 |",
        f"| oppo-both | rollout_host_gb | {4 + 0.25 * warmup:.2f} | {4 + 0.25 * last:.2f} | {4 + 0.25 * last:.2f}"
        f" | {0.25 * (last - warmup):+.2f} |",
    ]
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_cpu_table_from_host_samples_and_logged_cpu_time():
    """A run with the harness's host CPU samples and OPPO's ``oppo/cpu/*``, ``oppo/<role>_fit_s`` and
    ``oppo/busy_s/<role>`` gets a row per system: the busy cores over the measured steps (mean and p90), each
    role's scoring time, each actor's CPU seconds a step and each model's fit, means over the measured steps; a
    system that logged none shows dashes."""
    run = report.run_results(str(RESULTS / "split-2gpu-1.5b-lognormal-patched-top-up-at-step-end"))
    warmup, count = run["settings"]["warmup"], run["settings"]["steps"]
    for i, step in enumerate(run["systems"]["oppo-both"]["steps"]):
        step["oppo/cpu/rollout_s"] = 2.0 if warmup <= i < warmup + count else 50.0  # outside: not counted
        step["oppo/cpu/policy_s"] = 0.5
        step["oppo/policy_fit_s"] = 4.25
        step["oppo/busy_s/critic"] = 0.75
    run["systems"]["oppo-both"]["cpu_samples"] = [[t, float(t % 10)] for t in range(10)]  # 0..9 cores
    lines = report.table(run).splitlines()
    header = lines.index(
        "| system | host cores busy, mean | p90 | critic scoring (s) | policy CPU s a step | rollout CPU s a step "
        "| policy fit (s) |"
    )
    rows = {line.split(" | ")[0][2:]: line for line in lines[header + 2 : header + 2 + len(run["systems"])]}
    assert rows["oppo-both"] == "| oppo-both | 4.5 | 8 | 0.75 | 0.5 | 2 | 4.25 |"
    assert rows["upstream-sync"] == "| upstream-sync | - | - | - | - | - | - |"


def test_state_moves_wait_only_for_runs_that_overlap_the_moves():
    """``oppo/state_moves_wait_s`` shows for a run with ``--oppo.state_moves overlap`` in its flags; in another
    run it can only be an earlier run's key (one log folder for two tags of a system), and shows a dash."""
    run = report.run_results(str(RESULTS / "split-2gpu-1.5b-lognormal-patched-top-up-at-step-end"))
    for step in run["systems"]["oppo-both"]["steps"]:
        step["oppo/state_moves_wait_s"] = 1.25
    overlapped = json.loads(json.dumps(run["systems"]["oppo-both"]))
    overlapped["flags"] += ["--oppo.state_moves", "overlap"]
    run["systems"]["oppo-both-overlap"] = overlapped
    run["systems"]["oppo-both-overlap-one-word"] = dict(overlapped, flags=overlapped["flags"][:-2])
    run["systems"]["oppo-both-overlap-one-word"]["flags"].append("--oppo.state_moves=overlap")
    lines = report.table(run).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| system | host cores busy"))
    assert lines[header].endswith("| wait on state moves (s) |")
    rows = {line.split(" | ")[0][2:]: line for line in lines[header + 2 : header + 2 + len(run["systems"])]}
    assert rows["oppo-both-overlap"].endswith("| 1.25 |") and rows["oppo-both"].endswith("| - |")
    assert rows["oppo-both-overlap-one-word"].endswith("| 1.25 |")


def test_the_readme_results_table_is_what_the_raw_results_give():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- headline: python -m openrlhf_oppo.bench.report docs/results --headline -->\n")
    table = readme[readme.index("\n", start) + 1 : readme.index("\n<!-- /headline -->")]
    assert table == report.headline(str(RESULTS))
    assert table.count("\n") - 1 <= 6  # at most six rows
