"""The learning benchmark: does each system learn a task as well per step, and how much sooner per hour?

    python -m openrlhf_oppo.bench --task addition --gpus 2 --placement split --upstream_patches --out runs/learning

1. Warm-up (``warmup.py``): a ``--shape`` model learns the addition task (``addition.py``) with supervised
   learning until its greedy accuracy on held-out sums reaches ``--warmup_target``; cached in the workload folder.
2. PPO from that checkpoint with the task's rule reward (``--credit``), for every system of ``--systems`` and
   every seed of ``--seeds`` (``--train.seed``: vLLM's sampling and the prompt order), one ``train_ppo_ray``
   process after the other as in the speed benchmark. Responses end where the model ends them. Every
   ``--eval_every`` steps each run is evaluated greedily on the warm-up's held-out sums (``eval_flags``).
3. ``results.json`` after each run, then ``table.md`` and the plots of accuracy against step and wall-clock
   time, with a band over the seeds (``learning_report.py``).

Runs side by side: one ``(system, seed)`` per process (``--systems S --seeds N``), every process on one warm-up made
before (``--warmup_from``, ``python -m openrlhf_oppo.bench.warmup``), each with its own Ray cluster, a small vLLM
share (``--vllm_share``) and no memory moved after the start (``--sleep off``); ``results.json`` records the
warm-up's checkpoint hash, so the merged runs can show they started from one model. How many steps a run makes
does not depend on what shares the GPU, its wall-clock does: ``--speed_alone`` runs a few steps of each system one
after the other, alone on the GPU, and the report times every system's curve by those step times.

The defaults are the GPU benchmark's; the CPU tests run the same function (``run``) scaled down, with a runner
that drives OpenRLHF's trainer in-process on CPU stand-ins.
"""

import argparse
import json
import os

from tqdm import tqdm

from openrlhf_oppo import tiny
from openrlhf_oppo.bench import addition, report, warmup
from openrlhf_oppo.bench.patched_upstream import make_patched_copy, patches
from openrlhf_oppo.bench.systems import (
    SYSTEMS,
    add_oppo_variant_arguments,
    cluster_flags,
    refuse_what_the_placement_cannot_run,
    system_flags,
)

TASKS = ("addition",)
LEARNING_SYSTEMS = dict(
    split=("upstream-sync", "upstream-async", "oppo-both", "oppo-both-keep"),
    # Upstream's async trainer needs vLLM on GPUs of its own; sleeping engines drop the KV that keep would keep.
    # ``oppo``, the flag swap, leaves the engines' sleep to the plan, which keeps them awake where they fit.
    colocated=("upstream-sync", "oppo", "oppo-both-awake", "oppo-both-awake-keep"),
)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, from {SYSTEMS} (default: {LEARNING_SYSTEMS['split']} split, "
        f"{LEARNING_SYSTEMS['colocated']} colocated)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated --train.seed values, one run each")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--placement", choices=["split", "colocated"], default="split")
    parser.add_argument("--shape", default="small", choices=sorted(tiny.SHAPES), help="the model's shape")
    parser.add_argument("--batch", type=int, default=32, help="--rollout.batch_size (prompt groups per step)")
    parser.add_argument("--n_samples", type=int, default=8, help="samples per prompt (group_norm's group)")
    parser.add_argument("--steps", type=int, default=80, help="PPO steps per run")
    parser.add_argument(
        "--overcommit",
        type=int,
        default=None,
        help="Delta for the OPPO systems (default: --batch in the split placement, an eighth of it colocated)",
    )
    parser.add_argument(
        "--credit",
        choices=addition.CREDITS,
        default="answer",
        help="what the reward gives credit for: the right answer (1, else 0), or the share of the chain's steps (and "
        "the answer) that are right. The held-out evaluation always scores the answer",
    )
    # Higher rates drive the policy away from the reference without more right answers (docs/benchmark.md).
    parser.add_argument("--lr", type=float, default=2e-5, help="the policy's learning rate in PPO")
    parser.add_argument(
        "--lr_scheduler",
        default="constant_with_warmup",
        help="the policy's learning-rate schedule (--actor.lr_scheduler). OpenRLHF's default, cosine_with_min_lr, "
        "falls to a tenth of --lr by a run's last step, while the accuracy may still be rising",
    )
    parser.add_argument(
        "--updates", type=int, default=4, help="policy updates a step, each on an equal share of its samples"
    )
    parser.add_argument("--target", type=float, default=0.8, help="the accuracy the convergence table times")
    parser.add_argument("--warmup_target", type=float, default=0.3, help="held-out greedy accuracy to stop at")
    parser.add_argument(
        "--warmup_headroom",
        type=float,
        default=None,
        help="stop the warm-up where its sampled accuracy is at most --warmup_target and the sums with a right "
        "sample among --n_samples are at least this much more (warmup.stop_here), not at a greedy accuracy",
    )
    parser.add_argument("--warmup_max_steps", type=int, default=5000)
    parser.add_argument(
        "--eval_every",
        type=int,
        default=10,
        help="PPO steps between greedy evaluations on the warm-up's held-out sums, the same prompts for every "
        "system (OpenRLHF's --eval.*); 0: none",
    )
    warmup.add_digits_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="the warm-up's and the prompts' seed")
    parser.add_argument("--cache_budget_gb", type=float, default=2.0)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run before it is stopped")
    parser.add_argument("--extra", action="append", default=[], help="a train_ppo_ray flag for every run (repeat)")
    add_oppo_variant_arguments(parser)
    parser.add_argument(
        "--upstream_patches", action="store_true", help="run every system on OpenRLHF with patches/openrlhf applied"
    )
    parser.add_argument(
        "--sleep",
        choices=["on", "off"],
        default="on",
        help="colocated: 'on', vLLM and the models' DeepSpeed states sleep in turn (OpenRLHF's hybrid engine); 'off', "
        "every system keeps them on the GPU, so that no memory moves after the start (runs sharing one GPU: vLLM "
        "sizes its KV cache from the memory that moves while it starts)",
    )
    parser.add_argument(
        "--vllm_share",
        type=float,
        default=None,
        help="--vllm.gpu_memory_utilization of every system (default: 0.45 colocated, 0.75 split); runs sharing one "
        "GPU each take a small share",
    )
    parser.add_argument(
        "--kv_cache_gb",
        type=float,
        default=None,
        help="every vLLM engine's KV cache in GiB (the driver's --bench.kv_cache_gb), not sized from the memory free "
        "as it starts: runs sharing one GPU start and free memory at any time",
    )
    parser.add_argument(
        "--train_micro_batch",
        type=int,
        default=None,
        help="--train.micro_batch_size (default: a policy update's samples in one micro-batch); a smaller one holds "
        "less memory at a peak, for runs sharing one GPU, and changes no update",
    )
    parser.add_argument(
        "--warmup_from",
        default=None,
        help="a warm-up folder made before (python -m openrlhf_oppo.bench.warmup: models/ and warmup.json), used as "
        "it is, so that runs side by side start from one model; its digits must be the run's",
    )
    parser.add_argument(
        "--speed_alone",
        action="store_true",
        help="measure step times: --steps steps of each system one after the other, without evaluations, to run "
        "alone on the machine; the report times the side-by-side learning runs by them",
    )
    parser.add_argument("--workdir", default=None, help="the warm-up's checkpoints and the prompts (OUT/workload)")
    parser.add_argument("--out", required=True, help="results.json, table.md and the plots")
    parser.add_argument("--scratch", default=None, help="logs, tensorboard, traces, checkpoints (default OUT)")
    args = parser.parse_args(argv)
    samples = args.batch * args.n_samples
    if args.updates < 1 or samples % args.updates:
        parser.error(f"--updates {args.updates} must divide the {samples} samples of a step (--batch x --n_samples)")
    args.systems = args.systems or ",".join(LEARNING_SYSTEMS[args.placement])
    refuse_what_the_placement_cannot_run(parser, args.systems, args.placement)
    if args.train_micro_batch is not None and (samples // args.updates) % args.train_micro_batch:
        parser.error(f"--train_micro_batch {args.train_micro_batch} must divide a policy update's samples")
    if args.speed_alone:
        args.eval_every = 0  # the step times alone, no evaluation between them
    args.warmup = 0  # every PPO step counts (``run_system`` reads it)
    # Split: Delta equal to the batch, so that the next step's groups decode while this one trains. Colocated, the
    # awake engines decode the next step's prompts during training anyway: a Delta as large would have each step
    # train groups two versions behind.
    if args.overcommit is None:
        args.overcommit = args.batch if args.placement == "split" else max(1, args.batch // 8)
    return args


def run(args, runner, header: dict, warmup_options=None) -> dict:
    """Warm up, then every system with every seed through ``runner(name, flags, args) -> result``.

    ``args``: ``parse``'s, which refused the systems the placement cannot run. ``header``: what results.json
    starts with (``__main__.header``). ``warmup_options``: ``warmup.warm_up`` settings besides the shape, target
    and digits (the CPU tests' smaller batch and evaluation). Returns the results, also written to
    ``OUT/results.json``.
    """
    systems = [s for s in args.systems.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    args.scratch = args.scratch or args.out
    workdir = args.workdir or os.path.join(args.scratch, "workload")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    if args.upstream_patches:
        patched = make_patched_copy(os.path.join(args.scratch, "openrlhf-patched"))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (patched, os.environ.get("PYTHONPATH")) if p)

    digits = warmup.digits_of(args)
    warm_dir = args.warmup_from or workdir
    if args.warmup_from:
        os.makedirs(workdir, exist_ok=True)
        warm = warmup.made_before(args.warmup_from, args.shape, digits)
    else:
        warm = warmup.warm_up(
            workdir, args.shape, args.warmup_target, args.seed, digits, max_steps=args.warmup_max_steps,
            samples=args.n_samples, headroom=args.warmup_headroom, **(warmup_options or {}),
        )  # fmt: skip
    checkpoint = warmup.checkpoint_sha256(warm_dir)
    prompts = addition.write_prompts(
        os.path.join(workdir, "prompts.jsonl"), args.batch * (args.steps + 2), args.seed, args.credit, **digits
    )
    # OPPO trains each step's first groups to finish (the short sums first), so the training accuracy depends on
    # the system: the held-out sums, the warm-up's, are the same for every system. Their labels credit the answer
    # alone, since OpenRLHF's pass@1 is the mean reward.
    heldout = addition.write_prompts(
        os.path.join(workdir, "heldout.jsonl"), warm["settings"]["heldout"], args.seed + warmup.HELDOUT_SEED, **digits
    )
    results = dict(
        **header,
        settings=dict(vars(args), systems=systems, seeds=seeds),
        task=dict(
            name=args.task, target=args.target, warmup=warm, warmup_sha256=checkpoint, prompts=prompts, heldout=heldout
        ),
        upstream_patches=[patch.name for patch in patches()] if args.upstream_patches else [],
        systems={},
    )
    path = os.path.join(args.out, "results.json")
    folders = report.machine_folders(args.out, args.scratch, workdir)
    if args.warmup_from:
        folders["WARMUP"] = args.warmup_from
    for seed in seeds:  # seed by seed, so that a run cut short has every system of its first seeds
        for system in tqdm(systems, desc=f"seed {seed}"):
            label = system + (args.oppo_tag if system.startswith("oppo") else "")
            name = f"{label}-{'alone' if args.speed_alone else 'seed'}{seed}"
            result = runner(name, run_flags(workdir, args.scratch, name, system, seed, args, warm_dir), args)
            results["systems"][name] = dict(
                result, system=label, seed=seed, warmup_accuracy=warm["accuracy"], warmup_sha256=checkpoint
            )
            if args.speed_alone:  # step times, not a curve (``learning_report.alone_step_seconds``)
                results["systems"][name]["alone"] = True
            with open(path, "w") as f:
                json.dump(report.without_machine_folders(results, folders), f, indent=1)
    report.write(results, args.out)
    print(open(os.path.join(args.out, "table.md")).read())
    return results


def run_flags(workdir: str, out: str, name: str, system: str, seed: int, args, warm_dir: str = None) -> list:
    """One run's ``train_ppo_ray`` flags: the cluster and the system as in the speed benchmark, the task's
    prompts (in ``workdir``), rule reward and response lengths, and the PPO settings of the learning benchmark. The
    models are the warm-up's in ``warm_dir`` (default ``workdir``)."""
    max_response = addition.max_response_tokens(args.digits_high)
    samples = args.batch * args.n_samples
    update = max(1, samples // args.updates)  # samples a policy update
    # No gradient checkpointing: the small model's activations are small, and recomputing them would only lengthen
    # every system's training, the part of the step that no system overlaps.
    cluster = cluster_flags(
        warm_dir or workdir, out, name, system, args.placement, args.gpus, seed, args.cache_budget_gb,
        gradient_checkpointing=False,
    )  # fmt: skip
    if args.vllm_share is not None:
        cluster[cluster.index("--vllm.gpu_memory_utilization") + 1] = str(args.vllm_share)
    return (
        cluster
        + [
            "--data.prompt_dataset", f"{workdir}/prompts.jsonl",
            "--data.input_key", "input",
            "--data.label_key", "answer",
            "--data.max_samples", str(args.batch * (args.steps + 2)),
            "--data.max_len", str(2 * args.digits_high + 2 + max_response),
            "--rollout.max_new_tokens", str(max_response),
            "--reward.remote_url", addition.__file__,
            "--rollout.batch_size", str(args.batch),
            "--rollout.n_samples_per_prompt", str(args.n_samples),
            "--rollout.micro_batch_size", str(min(32, samples)),
            # --updates policy updates a step, each on its share of the samples in one micro-batch: the small
            # model's training is bound by kernel launches, so fewer, larger micro-batches are faster.
            "--train.batch_size", str(update),
            "--train.micro_batch_size", str(args.train_micro_batch or update),
            "--train.max_epochs", "1",
            # Advantages against the other samples of the prompt: no critic to learn first.
            "--algo.advantage.estimator", "group_norm",
            # The KL as a loss (OpenRLHF's GRPO recipe), not in the reward: group_norm normalises the task's reward
            # only, so in a group whose samples are all wrong every token's return would be minus the KL summed
            # after it, pushing the sampled tokens down, the more so the longer the response.
            "--algo.kl.use_loss",
            "--algo.kl.estimator", "k3",
            "--algo.kl.init_coef", "0.01",
            # Samples decoded by older weights (upstream async's, OPPO's carried ones) are weighted by
            # pi_train/pi_rollout, clipped (OpenRLHF's TIS). Every system gets it; where nothing is stale it is ~1.
            "--algo.advantage.is_correction_level", "token",
            "--algo.advantage.is_correction_mode", "clip",
            "--actor.adam.lr", str(args.lr),
            "--actor.lr_scheduler", args.lr_scheduler,
        ]
        + (["--bench.kv_cache_gb", str(args.kv_cache_gb)] if args.kv_cache_gb is not None else [])
        + first_token_flags(args.upstream_patches)
        + eval_flags(workdir, args.eval_every)
        + system_flags(system, args.placement, args.overcommit, ds_sleep=args.sleep == "on", vllm_sleep=args.sleep == "on")
        + args.extra
        + (args.oppo_extra if system.startswith("oppo") else [])
    )  # fmt: skip


def first_token_flags(patched: bool) -> list:
    """Responses that may end at their first token, where the patches give upstream the flag (0015).

    Upstream samples with vLLM's min_tokens=1, which masks the end of text at the first token: the importance
    correction then takes a first-token log-prob without that probability, and a response ending there is never
    sampled, so never corrected. A policy can drift towards it unseen."""
    return ["--rollout.min_new_tokens", "0"] if patched else []


def eval_flags(workdir: str, every: int) -> list:
    """Greedy evaluation on the held-out sums every ``every`` steps (logged as ``eval/eval_default_pass1``). No
    best-checkpoint saving: OpenRLHF would otherwise save one at every improvement, inside the timed steps."""
    if not every:
        return []
    return [
        "--eval.dataset", f"{workdir}/heldout.jsonl",
        "--eval.steps", str(every),
        "--eval.temperature", "0",
        "--eval.n_samples_per_prompt", "1",
        "--ckpt.best_metric_key", "none",
    ]  # fmt: skip
