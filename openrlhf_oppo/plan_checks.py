"""The checks of a combination of flags, before any Ray actor or GPU is touched: each raises ``OPPOConfigError``
with what is wrong and what to use instead.

``check_options`` runs on the options as given, before the plan resolves them (what the plan could not place);
``check_plan`` runs once on the resolved sub-plans (``plan.resolve``), which say what the run would do.
"""

import os

from openrlhf_oppo import topology
from openrlhf_oppo.config import ALL_OPTIONS, STREAMING_ONLY, WITHOUT_ENABLE, OPPOConfigError
from openrlhf_oppo.streaming.chunking import CANDIDATES as CHUNK_CANDIDATES

# vLLM's share of a GPU it shares with the frozen models; the rest holds their weights, KV caches and activations.
FROZEN_BESIDE_VLLM_MAX_UTILIZATION = 0.8


# -- the options as given ---------------------------------------------------------------------------------------


def check_options(args, opts) -> None:
    """``opts``: the options as given, else their defaults (``config.values``)."""
    if not opts.enable:
        stray = [name for name in opts.given if name not in WITHOUT_ENABLE]
        if stray:
            flags = ", ".join(f"--oppo.{name}" for name in stray)
            raise OPPOConfigError(f"{flags} given without --oppo.enable: add --oppo.enable or drop them.")
    if opts.frozen_scorers_on == "generation":
        check_frozen_beside_vllm(args, opts)
    if not opts.colocate_models:
        return
    if args.train.colocate_all:
        raise OPPOConfigError(
            "--oppo.colocate_models and --train.colocate_all are two different placements: with colocate_all the "
            "vLLM engines share the models' GPUs; with colocate_models they have GPUs of their own. Pick one."
        )
    if args.train.async_enable:
        raise OPPOConfigError(
            "--oppo.colocate_models is a synchronous placement. With --train.async_enable use --train.colocate_all, "
            "which in async mode already places only the DeepSpeed models together."
        )
    # The frozen models beside vLLM are checked against the engines' GPUs; under 'auto' that is decided once the
    # streamed roles are known, and check_plan checks them against the actor's if they stay.
    frozen_may_go = opts.enable and opts.frozen_scorers_on != "models"
    _check_on_the_actors_gpus(args, ("critic",) if frozen_may_go else ("critic", "reward", "ref"))
    if not args.vllm.num_engines:
        raise OPPOConfigError("--oppo.colocate_models places the vLLM engines apart: set --vllm.num_engines >= 1.")


def _check_on_the_actors_gpus(args, groups) -> None:
    actor = (args.actor.num_nodes, args.actor.num_gpus_per_node)
    for group in groups:
        other = (getattr(args, group).num_nodes, getattr(args, group).num_gpus_per_node)
        if other != actor:
            raise OPPOConfigError(
                f"--oppo.colocate_models puts every model on the actor's GPUs: set --{group}.num_nodes and "
                f"--{group}.num_gpus_per_node to the actor's ({actor[0]} and {actor[1]}), got {other}."
            )


def check_frozen_beside_vllm(args, opts) -> None:
    """The reward and reference models fit beside the engines (``--oppo.frozen_scorers_on generation``, or the
    plan's 'auto' asking whether they would)."""
    if not opts.colocate_models:
        raise OPPOConfigError(
            "--oppo.frozen_scorers_on generation places the reward and reference models on the vLLM engines' GPUs "
            "of the split placement: add --oppo.colocate_models, or use --oppo.frozen_scorers_on models."
        )
    engine_gpus = topology.ranks(args, topology.ENGINES)
    for role in topology.FROZEN:
        group, ranks = topology.FLAG_GROUP[role], topology.ranks(args, role)
        if ranks != engine_gpus:
            raise OPPOConfigError(
                f"--oppo.frozen_scorers_on generation puts one {group} rank on each vLLM GPU: set "
                f"--{group}.num_nodes and --{group}.num_gpus_per_node to {engine_gpus} GPUs in all "
                f"(--vllm.num_engines x --vllm.tensor_parallel_size), got {ranks}."
            )
    if args.vllm.gpu_memory_utilization > FROZEN_BESIDE_VLLM_MAX_UTILIZATION:
        raise OPPOConfigError(
            f"--oppo.frozen_scorers_on generation loads the reward and reference models beside vLLM, which takes "
            f"--vllm.gpu_memory_utilization {args.vllm.gpu_memory_utilization:g} of each GPU: set it to at most "
            f"{FROZEN_BESIDE_VLLM_MAX_UTILIZATION} (the KV cache shrinks accordingly), or use "
            "--oppo.frozen_scorers_on models."
        )


# -- the resolved plan ------------------------------------------------------------------------------------------


def check_plan(args, opts, plan) -> None:
    """The resolved ``plan`` against the flags it was resolved from."""
    if opts.colocate_models and opts.frozen_scorers_on == "auto" and plan.stream.frozen_scorers_on == "models":
        _check_on_the_actors_gpus(args, ("reward", "ref"))
    if plan.memory.strict and not plan.memory.fits:
        raise OPPOConfigError(
            f"this run does not fit the GPU's {plan.memory.estimate.gpu_gib:.1f} GiB: {plan.memory.warning()}"
        )
    _check_lag(opts, plan)
    _check_combination(args, opts, plan)
    _check_streaming(args, opts, plan)
    _check_overcommit(args, opts, plan)
    _check_stream_interval(opts)


def _check_lag(opts, plan) -> None:
    """The lag bound against the options that would break it."""
    carry = plan.carry
    if not plan.inter_step:
        if "overcommit" in opts.given and opts.overcommit != 0 and opts.max_lag == 0:
            raise OPPOConfigError(
                f"--oppo.overcommit {opts.overcommit} carries groups into later steps, but --oppo.max_lag 0 trains "
                "every sample on the weights that generated it: drop one of them."
            )
        return
    extra = 1 if carry.top_up == "step_end" else 0
    if carry.max_defer_steps < 1:
        raise OPPOConfigError(
            f"--oppo.top_up step_end starts prompts a weight version early, so --oppo.max_lag {carry.max_lag} leaves "
            "them no step to be carried: use --oppo.max_lag 2 or more, or --oppo.top_up step_start."
        )
    if carry.max_defer_steps + extra > carry.max_lag:
        raise OPPOConfigError(
            f"--oppo.max_defer_steps {carry.max_defer_steps} lets a group train {carry.max_defer_steps + extra} "
            f"weight versions behind, above --oppo.max_lag {carry.max_lag}: raise --oppo.max_lag or drop "
            "--oppo.max_defer_steps."
        )
    if opts.overcommit_max != "auto" and opts.overcommit_min > opts.overcommit_max:
        raise OPPOConfigError(
            f"--oppo.overcommit_min ({opts.overcommit_min}) is above --oppo.overcommit_max ({opts.overcommit_max})."
        )


def _check_combination(args, opts, plan) -> None:
    """What OPPO does not run, and mechanisms whose conditions the run does not meet."""
    carry, stream, sync = plan.carry, plan.stream, plan.sync
    if not args.vllm.num_engines:
        raise OPPOConfigError("OPPO overlaps vLLM generation with the other stages: set --vllm.num_engines >= 1.")
    if args.train.async_enable:
        raise OPPOConfigError(
            "--oppo.enable with --train.async_enable is not supported: OPPO's inter-step overlap takes the place "
            "of the async trainer. Use one or the other (the benchmark runs both side by side)."
        )
    if plan.streams:
        unsupported = {
            "--ds.ring_attn_size > 1": args.ds.ring_attn_size > 1,
            "--ds.tensor_parallel_size > 1": args.ds.tensor_parallel_size > 1,
            "--ds.lora.rank > 0": args.ds.lora.rank > 0,
            "--data.max_images_per_prompt > 0 (VLM)": args.data.max_images_per_prompt > 0,
        }
        for what, hit in unsupported.items():
            if hit:
                raise OPPOConfigError(
                    f"Intra-step streaming does not support {what} yet: use --oppo.intra_step off (inter-step "
                    "overlap still works) or change that setting."
                )
    if carry.kv == "keep" and sync.vllm_sleeps:
        raise OPPOConfigError(
            "--oppo.carry_kv keep needs the KV cache to survive between steps, but --vllm.enable_sleep drops it: "
            "use --oppo.carry_kv recompute (carried requests are re-prefilled on wake) or drop --vllm.enable_sleep."
        )
    if "colocated_decode" in opts.given and not sync.colocate_all:
        raise OPPOConfigError(
            "--oppo.colocated_decode sets what the engines do while the models train on the same GPUs, but without "
            "--train.colocate_all they have GPUs of their own and decode through training anyway: drop it."
        )
    if "colocated_decode" in opts.given and sync.vllm_sleeps:
        raise OPPOConfigError(
            "--oppo.colocated_decode sets what the engines do while the models train, but --vllm.enable_sleep puts "
            "them to sleep then: drop --vllm.enable_sleep (the engines then keep their GPU memory through "
            "training; leave the models room with --vllm.gpu_memory_utilization) or the option."
        )
    pausing = sync.colocate_all and carry.colocated_decode == "pause"
    if carry.top_up == "step_end" and (pausing or not plan.inter_step):
        raise OPPOConfigError(
            "--oppo.top_up step_end starts the next step's prompts during training, so it needs inter-step overlap "
            "(--oppo.overcommit > 0 or auto) and vLLM engines that decode through training: on GPUs of their own, "
            "or under --train.colocate_all awake (no --vllm.enable_sleep) with --oppo.colocated_decode continue or "
            "during_training (otherwise they wait or sleep through training). Use --oppo.top_up step_start there."
        )
    if stream.critic_catches_up_after_fit and sync.ds_sleeps and sync.state_moves != "overlap":
        raise OPPOConfigError(
            f"--oppo.critic_catch_up {stream.critic_catch_up} sends the critic its held chunks as soon as its fit "
            "ends, but under --ds.enable_sleep upstream's training moves the models' states and trains them one "
            "after the other, with nothing between the two fits: add --oppo.state_moves overlap, whose training "
            "sends them there, or use --oppo.critic_catch_up next_step."
        )
    if sync.state_moves == "overlap" and not sync.ds_sleeps:
        raise OPPOConfigError(
            "--oppo.state_moves overlap moves DeepSpeed states that --ds.enable_sleep takes off the GPU between "
            "steps; without it they stay on the GPU and there is nothing to overlap: add --ds.enable_sleep or drop "
            "the option."
        )
    if sync.state_moves == "overlap" and args.algo.advantage.estimator != "gae":
        raise OPPOConfigError(
            "--oppo.state_moves overlap loads the policy's states while the critic trains, but "
            f"--algo.advantage.estimator {args.algo.advantage.estimator} trains no critic: drop the option."
        )
    if stream.policy_logprobs == "vllm" and (args.rollout.temperature != 1.0 or sync.vllm_sleeps):
        raise OPPOConfigError(
            "--oppo.policy_logprobs vllm takes vLLM's prompt log-probs, which come from the raw logits and need the "
            "engines awake after the weight sync: it needs --rollout.temperature 1.0 (given "
            f"{args.rollout.temperature:g}) and no --vllm.enable_sleep. Use --oppo.policy_logprobs policy there."
        )
    # Without inter-step overlap the rule has nothing to move: _check_overcommit names what turned it off.
    if plan.inter_step and opts.overcommit != "auto" and "overcommit_rule" in opts.given:
        raise OPPOConfigError(
            f"--oppo.overcommit_rule {opts.overcommit_rule} moves Delta under --oppo.overcommit auto, but "
            f"--oppo.overcommit {opts.overcommit} fixes it: use --oppo.overcommit auto or drop the rule."
        )
    trace_dir = plan.observe.trace_dir
    if trace_dir is not None and os.path.exists(trace_dir) and not os.path.isdir(trace_dir):
        raise OPPOConfigError(f"--oppo.trace_dir {trace_dir} is a file: give a folder for the traces.")
    if plan.observe.profile_step and trace_dir is None:
        raise OPPOConfigError(
            f"--oppo.profile_step {plan.observe.profile_step} writes its profiles into --oppo.trace_dir: add "
            "--oppo.trace_dir."
        )


def _unused(names, what: str, instead: str) -> OPPOConfigError:
    """The error for options given for a part of OPPO that this run does not use."""
    flags = ", ".join(f"--oppo.{name}" for name in names)
    verb, it = ("tunes", "it") if len(names) == 1 else ("tune", "them")
    return OPPOConfigError(f"{flags} {verb} {what}: drop {it}, or {instead}.")


def _check_streaming(args, opts, plan) -> None:
    """Streaming settings that would quietly undo what was asked for."""
    roles, intra_step = plan.stream.roles, plan.stream.intra_step
    if "policy_logprobs" in opts.given and "policy" not in roles:
        raise _unused(
            ["policy_logprobs"],
            "the streamed policy, and the policy does not stream here (intra-step streaming off, or vLLM on the "
            "models' GPUs: --train.colocate_all)",
            "stream the policy",
        )
    if not roles:
        if intra_step == "on":
            raise OPPOConfigError(
                "--oppo.intra_step on, but no model of this run can stream: the reward comes from "
                "--reward.remote_url or an agent, there is no critic (--algo.advantage.estimator is not gae), no "
                "reference (--algo.kl.init_coef 0), and the policy shares vLLM's GPUs (--train.colocate_all). "
                "Use --oppo.intra_step off."
            )
        unused = [name for name in STREAMING_ONLY if name in opts.given]
        if unused:
            why = "--oppo.intra_step off" if intra_step == "off" else "--oppo.intra_step auto under the hybrid engine"
            raise _unused(
                unused, f"intra-step streaming, which is off in this run ({why})", "stream with --oppo.intra_step on"
            )
        return
    longest, flag = (args.rollout.max_new_tokens, "--rollout.max_new_tokens")
    if longest is None:
        longest, flag = args.data.max_len, "--data.max_len"
    if opts.chunk_size != "auto" and opts.chunk_size >= longest:
        raise OPPOConfigError(
            f"--oppo.chunk_size {opts.chunk_size} is not below the longest response ({flag} {longest}): every "
            f"response would stream as one chunk, scored only when it ends. Use a chunk size below {longest}, or auto."
        )


def _check_overcommit(args, opts, plan) -> None:
    """Inter-step settings that have no effect, undo the overlap, or put more groups in flight than make sense."""
    carry, sync = plan.carry, plan.sync
    auto_only = [name for name in ALL_OPTIONS if name.startswith("overcommit_") and name in opts.given]
    if not plan.inter_step:
        unused = auto_only + [
            name
            for name in ("max_defer_steps", "carry_kv", "top_up", "weight_sync", "critic_catch_up", "colocated_decode")
            if name in opts.given
        ]
        if unused:
            raise _unused(
                unused,
                "inter-step overlap, which --oppo.overcommit 0 or --oppo.max_lag 0 turns off",
                "allow a lag with --oppo.max_lag N",
            )
        return
    if "weight_sync" in opts.given and (sync.colocate_all or sync.vllm_sleeps):
        raise _unused(
            ["weight_sync"],
            "how engines that decode carried requests on GPUs of their own receive the new weights, and here they "
            "share the models' GPUs (--train.colocate_all) or sleep through the sync (--vllm.enable_sleep)",
            "place vLLM apart, awake",
        )
    if "critic_catch_up" in opts.given and "critic" not in plan.stream.roles:
        raise _unused(
            ["critic_catch_up"],
            "the streamed critic's held chunks, and no critic streams here (intra-step streaming off, or no critic: "
            "--algo.advantage.estimator is not gae)",
            "stream the critic",
        )
    if opts.overcommit != "auto" and auto_only:
        delta = opts.overcommit
        raise _unused(
            auto_only, f"--oppo.overcommit auto, and --oppo.overcommit {delta} keeps Delta at {delta}", "use auto"
        )
    if carry.overcommit.auto and carry.overcommit.maximum == 0:
        raise OPPOConfigError(
            "--oppo.overcommit auto with --oppo.overcommit_max 0 keeps Delta at 0: turn inter-step overlap off with "
            "--oppo.overcommit 0, or allow an --oppo.overcommit_max of 1 or more."
        )
    # With B + Delta groups in flight and B trained a step, a group waits about Delta / B steps: past
    # max_defer_steps most groups are overdue and every step waits for them.
    batch = args.rollout.batch_size
    limit = carry.max_defer_steps * batch
    bounds = {
        "overcommit": opts.overcommit,
        "overcommit_min": opts.overcommit_min,
        "overcommit_max": carry.overcommit.maximum if carry.overcommit.auto else opts.overcommit_max,
    }
    for name, value in bounds.items():
        if value != "auto" and value > limit:
            raise OPPOConfigError(
                f"--oppo.{name} {value} is above --oppo.max_defer_steps x --rollout.batch_size "
                f"({carry.max_defer_steps} x {batch} = {limit}): a group would wait about Delta / batch_size steps "
                f"to be trained, past max_defer_steps, and every step would wait for the overdue ones. Use at most "
                f"{limit}" + (", or --oppo.overcommit auto." if name == "overcommit" else ".")
            )
        if value != "auto" and name in opts.given and batch + value > args.data.max_samples:
            raise OPPOConfigError(
                f"--oppo.{name} {value} with --rollout.batch_size {batch} puts more prompt groups in flight than "
                f"there are prompts (--data.max_samples {args.data.max_samples}): use at most "
                f"{max(args.data.max_samples - batch, 0)}."
            )


def _check_stream_interval(opts) -> None:
    """Chunks are cut from the engine's outputs: an interval larger than the smallest chunk would grow it."""
    smallest_chunk = CHUNK_CANDIDATES[0] if opts.chunk_size == "auto" else opts.chunk_size
    if opts.stream_interval != "auto" and opts.stream_interval > smallest_chunk:
        raise OPPOConfigError(
            f"--oppo.stream_interval {opts.stream_interval} is larger than the smallest chunk (--oppo.chunk_size "
            f"{opts.chunk_size}: {smallest_chunk} tokens): chunks are cut from the engine's outputs, and would grow "
            f"to {opts.stream_interval} tokens. Use a stream interval of at most {smallest_chunk}, or auto."
        )
