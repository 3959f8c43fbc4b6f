"""The systems the benchmark compares, as ``train_ppo_ray`` flags, for each placement.

Every system runs through ``python -m openrlhf_oppo.cli.train_ppo_ray``, by way of the benchmark's driver
(``driver.py``), which takes the ``--bench.*`` flags off the command line; without ``--oppo.enable`` that is upstream
OpenRLHF (``--bench.lengths_from_label`` only fixes the response lengths).

* ``split``: half the GPUs for vLLM, half for the four models. Upstream's synchronous trainer cannot
  express this with fewer than three GPU groups, so the synchronous systems use
  ``--oppo.colocate_models`` (with OPPO off for the baseline); upstream's async trainer gets the same
  placement from ``--train.colocate_all``, which in async mode places only the DeepSpeed models together.
* ``colocated``: everything on every GPU, upstream's hybrid engine (vLLM and DeepSpeed sleep in turn). With
  ``ds_sleep=False`` the models' DeepSpeed states stay on the GPU in every system (no ``--ds.enable_sleep``);
  ``upstream-sync-states-on-gpu`` is upstream sync so whatever ``ds_sleep`` says.

``oppo`` is what a user runs: the upstream-sync system's flags plus ``--oppo.enable``, everything else the plan's;
``oppo-keep`` adds ``--oppo.carry_kv keep`` to it, the one user option besides the lag that changes what is trained.
The other OPPO systems pin mechanism flags, for ablations.

Variants of ``oppo-both``:

* ``-frozen-with-models`` (split): the reward and reference models stay with the other models, as upstream's;
  otherwise they go beside vLLM (``--oppo.frozen_scorers_on auto``).
* ``-early`` (split): ``--oppo.top_up step_end``, the next step's prompts decode during training.
* ``-keep`` (split; colocated engines sleep, which drops the KV): ``--oppo.carry_kv keep``, carried requests
  keep the KV cache of the previous weights.
* ``-awake`` (colocated): vLLM stays awake (no ``--vllm.enable_sleep``) and decodes beside training, not beside
  making experiences (``--oppo.colocated_decode during_training --oppo.top_up step_end``); ``-awake-keep`` adds
  ``--oppo.carry_kv keep``. ``oppo-inter-awake`` is ``-awake`` without intra-step streaming.

Every system gets the same vLLM memory share, small enough for the frozen models to fit beside the engines (the
awake systems may need a smaller one, through ``--oppo_extra``, to leave training its room).
"""

SYSTEMS = (
    "upstream-sync",
    "upstream-sync-states-on-gpu",
    "upstream-async",
    "oppo",
    "oppo-keep",
    "oppo-intra",
    "oppo-inter",
    "oppo-both",
    "oppo-both-early",
    "oppo-both-frozen-with-models",
    "oppo-both-keep",
    "oppo-both-awake",
    "oppo-both-awake-keep",
    "oppo-inter-awake",
)
SPLIT_ONLY = ("upstream-async", "oppo-both-early", "oppo-both-frozen-with-models", "oppo-both-keep")
# vLLM awake through training (colocated), its requests decoding beside the models' training.
AWAKE = ("oppo-both-awake", "oppo-both-awake-keep", "oppo-inter-awake")
# Carried requests keep the KV cache of the weights that decoded them (--oppo.carry_kv keep).
KEEP_KV = ("oppo-keep", "oppo-both-keep", "oppo-both-awake-keep")
# What a user runs: upstream sync's flags and --oppo.enable (and the user option --oppo.carry_kv), the rest the plan's.
FLAG_SWAP = ("oppo", "oppo-keep")
DECODE_BESIDE_TRAINING = ["--oppo.colocated_decode", "during_training", "--oppo.top_up", "step_end"]
COLOCATED_ONLY = AWAKE + ("upstream-sync-states-on-gpu",)
INTER_ONLY = ("oppo-inter", "oppo-inter-awake")  # no intra-step streaming
# The OPPO systems whose reward and reference models stay on the models' GPUs in the split placement: they do not
# stream, or are told to stay. Every other one streams them, and --oppo.frozen_scorers_on auto puts them beside vLLM.
FROZEN_WITH_MODELS = INTER_ONLY + ("oppo-both-frozen-with-models",)


def system_flags(system: str, placement: str, overcommit: int, ds_sleep: bool = True, vllm_sleep: bool = True) -> list:
    """The system's own flags. Colocated, vLLM and the models' DeepSpeed states sleep in turn (OpenRLHF's hybrid
    engine) unless ``ds_sleep`` or ``vllm_sleep`` is off; the awake systems keep vLLM awake anyway."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    colocated = placement == "colocated"
    if colocated and system in SPLIT_ONLY:
        raise ValueError(f"{system} needs GPUs of its own for vLLM: use --placement split")
    if not colocated and system in COLOCATED_ONLY:
        raise ValueError(f"{system} decodes beside training on the models' GPUs: use --placement colocated")
    if system == "upstream-async":
        return ["--train.async_enable", "--train.partial_rollout_enable", "--train.colocate_all"]

    flags = ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"] if colocated else []
    if not ds_sleep or system == "upstream-sync-states-on-gpu":
        flags = _without(flags, "--ds.enable_sleep")
    if not vllm_sleep or system in AWAKE:
        flags = _without(flags, "--vllm.enable_sleep")
    if system.startswith("upstream-sync"):
        return flags + ([] if colocated else ["--oppo.colocate_models"])
    flags += ["--oppo.enable"] + ([] if colocated else ["--oppo.colocate_models"])
    if system in FLAG_SWAP:
        return flags + (["--oppo.carry_kv", "keep"] if system in KEEP_KV else [])
    if system == "oppo-intra":
        return flags + ["--oppo.intra_step", "on", "--oppo.overcommit", "0"]
    intra_step = "off" if system in INTER_ONLY else "on"
    flags += ["--oppo.intra_step", intra_step, "--oppo.overcommit", str(overcommit)]
    if system == "oppo-both-early":
        flags += ["--oppo.top_up", "step_end"]
    if system == "oppo-both-frozen-with-models":
        flags += ["--oppo.frozen_scorers_on", "models"]
    if system in KEEP_KV:
        flags += ["--oppo.carry_kv", "keep"]
    if system in AWAKE:
        flags += DECODE_BESIDE_TRAINING
    return flags


def add_oppo_variant_arguments(parser) -> None:
    """``--oppo_extra`` and ``--oppo_tag`` of both benchmarks: OPPO systems given more flags, under names of their
    own, beside upstream systems that do not get them."""
    parser.add_argument(
        "--oppo_extra", action="append", default=[], help="a train_ppo_ray flag for the OPPO systems only (repeat)"
    )
    parser.add_argument(
        "--oppo_tag",
        default="",
        help="appended to the OPPO systems' names only (after --tag in the speed benchmark): what --oppo_extra "
        "changes, which the upstream systems of the same run do not get; one that starts with a dash goes after an "
        "equals sign: --oppo_tag=-chunk32",
    )


def _without(flags: list, flag: str) -> list:
    return [f for f in flags if f != flag]


def refuse_what_the_placement_cannot_run(parser, systems: str, placement: str) -> None:
    """A parser error for the first of the comma-separated ``systems`` that ``placement`` cannot run (or that does
    not exist): before any system runs, not after the ones before it."""
    for system in systems.split(","):
        try:
            system_flags(system, placement, 1)
        except ValueError as error:
            parser.error(str(error))


def common_flags(
    workdir: str,
    out: str,
    system: str,
    placement: str,
    gpus: int,
    batch: int,
    n_samples: int,
    steps: int,
    max_response: int,
    prompt_tokens: int,
    seed: int,
    cache_budget_gb: float,
    rollout_micro_batch: int = 8,
    train_micro_batch: int = 2,
    model_gpus: int = None,
) -> list:
    """Everything but the system: same models, data, lengths, batch and seed for every system."""
    cluster = cluster_flags(
        workdir, out, system, system, placement, gpus, seed, cache_budget_gb, model_gpus=model_gpus
    )
    return cluster + [
        "--rollout.batch_size", str(batch),
        "--rollout.n_samples_per_prompt", str(n_samples),
        "--rollout.micro_batch_size", str(rollout_micro_batch),
        "--train.batch_size", str(batch * n_samples),
        "--train.micro_batch_size", str(train_micro_batch),
        "--train.max_epochs", "1",
        "--data.max_len", str(prompt_tokens + max_response + 8),
        "--rollout.max_new_tokens", str(max_response),
        "--data.max_samples", str(batch * steps),
        "--data.prompt_dataset", f"{workdir}/prompts.jsonl",
        "--data.input_key", "input",
        "--data.label_key", "length",
        "--bench.lengths_from_label",
        "--actor.adam.lr", "5e-7",
        "--critic.adam.lr", "9e-6",
        "--algo.kl.init_coef", "0.01",
        "--algo.advantage.estimator", "gae",
    ]  # fmt: skip


def cluster_flags(
    workdir: str,
    out: str,
    name: str,
    system: str,
    placement: str,
    gpus: int,
    seed: int,
    cache_budget_gb: float,
    gradient_checkpointing: bool = True,
    model_gpus: int = None,
) -> list:
    """Where the engines and models run, on which checkpoints (``workdir/models``), the seed and the prompt
    order it fixes, and where the run named ``name`` logs (tensorboard ``out/tb/name``), saves and traces.
    Split placement: ``model_gpus`` GPUs (default half) for the models, one vLLM engine on each of the others."""
    if placement == "colocated":
        model_gpus = engines = gpus
    else:
        model_gpus = model_gpus or gpus // 2
        engines = gpus - model_gpus
    beside_vllm = placement == "split" and system.startswith("oppo") and system not in FROZEN_WITH_MODELS
    frozen_gpus = engines if beside_vllm else model_gpus  # one reward and one reference rank beside each engine
    models = f"{workdir}/models"
    flags = [
        "--vllm.num_engines", str(engines),
        "--vllm.tensor_parallel_size", "1",
        "--vllm.gpu_memory_utilization", "0.45" if placement == "colocated" else "0.75",
        "--actor.model_name_or_path", f"{models}/actor",
        "--reward.model_name_or_path", f"{models}/reward",
        "--critic.model_name_or_path", f"{models}/reward",
        "--ckpt.output_dir", f"{out}/ckpt/{name}",
        "--ckpt.path", f"{out}/ckpt/{name}",
        "--train.seed", str(seed),
        "--bench.seed_prompt_order",
        "--ds.zero_stage", "2",
        "--ds.param_dtype", "bf16",
        "--ds.attn_implementation", "sdpa",
        "--logger.logging_steps", "1",
        "--logger.tensorboard_dir", f"{out}/tb",
        "--logger.wandb.run_name", name,
    ]  # fmt: skip
    if gradient_checkpointing:
        flags.append("--actor.gradient_checkpointing_enable")
    for role, role_gpus in (
        ("actor", model_gpus),
        ("critic", model_gpus),
        ("reward", frozen_gpus),
        ("ref", frozen_gpus),
    ):
        flags += [f"--{role}.num_nodes", "1", f"--{role}.num_gpus_per_node", str(role_gpus)]
    if system.startswith("oppo-") and system not in FLAG_SWAP:  # the ablations, not what a user runs
        flags += ["--oppo.trace_dir", f"{out}/trace/{name}"]
        if system not in INTER_ONLY:
            flags += ["--oppo.cache_budget_gb", str(cache_budget_gb)]
    return flags
