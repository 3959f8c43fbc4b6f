"""Each GPU's peak memory for an OpenRLHF PPO run, with or without OPPO, estimated from the flags alone.

``estimate(args, layout, gpu_gib)`` places the processes as upstream's ``train`` (or ``--oppo.colocate_models``)
does, and sums, per GPU and per phase of a step (generation, make_experience, training, weight sync), what each
process holds there:

* a CUDA context per process (with NCCL's and cuBLAS's buffers);
* vLLM: its share of the GPU (``--vllm.gpu_memory_utilization``) while awake, a little while asleep
  (``--vllm.enable_sleep``), its weights alone in the hybrid engine's weight sync;
* the models' residents: bf16 weights (2 bytes a parameter, sharded under ZeRO-3), and for the policy and the
  critic their DeepSpeed states (fp32 master and Adam, 12 bytes, sharded from ZeRO-1; bf16 gradients in their own
  fit) while on the GPU, and the fp32 gradient partition (4 bytes) that the first optimizer step leaves cached
  there (the process's other transients are cut from it outside its fit);
* transients: the logits of a forward pass (upstream's log-probs: bf16 and float32 copies) and of a training
  micro-batch (with their gradients, and the caching allocator's share of freed blocks that later, larger
  micro-batches cannot reuse), the layers' activations, DeepSpeed's gradient reduction bucket in a fit, and OPPO's
  streamed scorers: the KV cache their live sequences hold (within ``--oppo.cache_budget_gb``) and a prefill pass
  of ``--oppo.max_prefill_tokens``, more for the frozen ones, whose CUDA cache is never emptied.

Which processes overlap follows upstream: make_experience runs the forward passes one at a time where upstream
waits for each (``--train.colocate_all``, ``colocate_actor_ref``, ``colocate_critic_reward``) and together
otherwise, and a forward whose CUDA cache upstream never empties keeps it through training; the policy and the
critic train one after the other under ``--ds.enable_sleep`` (states moved on and off the GPU around each fit)
and at once without it. The sequences are taken at their longest (``--data.max_len``).

The constants are NVML and allocator readings of H200 and H100 runs (the memory each process reserves, not what its
tensors use): docs/memory.md lists the parts and compares the estimate with every stored run.
"""

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, Optional, Tuple

from openrlhf_oppo import config, topology
from openrlhf_oppo.topology import FROZEN, LOG_PROBS

GIB = 2**30

# Per process on a GPU: the CUDA context, NCCL's and cuBLAS's buffers, the allocator's small-block pools.
PROCESS_GIB = 1.2
# vLLM beyond its share of the GPU (its CUDA context and graphs are outside gpu_memory_utilization), and what an
# engine keeps asleep (--vllm.enable_sleep drops the KV cache and moves the weights to the host).
VLLM_OVER_SHARE_GIB = 2.6
VLLM_ASLEEP_GIB = 3.1
# Bytes per logit: upstream's forward keeps the bf16 logits and their float32 copy; a training micro-batch adds the
# float32 gradients of the log-softmax and the gather (what its tensors use at the longest length).
FORWARD_BYTES_PER_LOGIT = 6.5
TRAIN_BYTES_PER_LOGIT = 15.0
# A fit's micro-batches differ in length: the caching allocator keeps blocks that later ones cannot reuse. What a
# fit reserves beyond one micro-batch at the longest length is about this many sequences' worth of it.
TRAIN_SLACK_SEQUENCES = 2.1
# One prefill pass of a streamed scorer: its activations, the gathered cache and float32 logit rows, with the
# allocator's slack (the cache of different lengths each pass).
PREFILL_SLACK = 0.8
SCORER_LOGIT_ROWS = 2048  # ChunkScorer's max_logit_rows
# A frozen scorer's process (reward, reference) never empties its CUDA cache: no fit does it for it, so the blocks
# that prefills of other shapes freed stay reserved beside its KV cache and prefill, step after step. The critic's
# fit empties its cache every step.
FROZEN_SCORER_RESERVE = 1.3
# DeepSpeed's gradient reduction bucket (``reduce_bucket_size``, which OpenRLHF leaves at DeepSpeed's default), in
# the model's dtype: the backward of each micro-batch of a fit fills one.
REDUCE_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: from its config.json (``model_shape``)."""

    params: int  # every parameter, tied embeddings once
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    head_params: int  # the output layer's parameters that are not the input embeddings' (0 when tied)

    @property
    def value_params(self) -> int:
        """The critic's and the reward model's: the same body with a one-output value head instead."""
        return self.params - self.head_params + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * 2  # keys and values, bf16

    @property
    def layer_bytes_per_token(self) -> int:
        """A decoder layer's activations per token, all kept for its backward (bf16)."""
        return 2 * (18 * self.hidden_size + 6 * self.intermediate_size)

    @property
    def forward_bytes_per_token(self) -> int:
        """A decoder layer's intermediates per token in a forward pass without gradients: attention's and the MLP's
        (bf16), the residual stream in and out (bf16), and the RMSNorm's float32 copies of the hidden state."""
        return (
            2 * (4 * self.hidden_size + 3 * self.intermediate_size)
            + 2 * 2 * self.hidden_size
            + 2 * 4 * self.hidden_size
        )


def model_shape(source) -> Optional[ModelShape]:
    """The shape of a model from a local folder, a hub name already in the cache or a ``PretrainedConfig``; None
    when no config.json can be read without the network (the planner then keeps the user's flags)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        config = source
    else:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=True)
        except (OSError, ValueError):
            return None
    return _shape_of(json.dumps(config.to_dict(), sort_keys=True, default=str))


@lru_cache(maxsize=None)
def _shape_of(config_json: str) -> Optional[ModelShape]:
    """Counts the parameters of the config's causal LM built on the meta device (no memory, any architecture)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = json.loads(config_json)
    config = AutoConfig.for_model(**values)
    text = getattr(config, "text_config", None) or config
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):
        return None
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    heads = text.num_attention_heads
    return ModelShape(
        params=params,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        head_params=0 if tied else head.weight.numel(),
    )


def shapes_from_args(args) -> Optional[Dict[str, ModelShape]]:
    """Every model's shape, by role, or None if one cannot be read."""
    paths = {role: path for role, path in topology.checkpoints(args).items() if path}
    shapes = {role: model_shape(path) for role, path in paths.items()}
    return None if any(shape is None for shape in shapes.values()) else shapes


@dataclass(frozen=True)
class Layout:
    """The memory-relevant choices of a run, which the planner may change (``Plan.memory.layout``: a run's, as its
    plan resolved them)."""

    vllm_awake: bool  # the engines keep their share through training (no --vllm.enable_sleep)
    ds_sleep: bool  # --ds.enable_sleep: the policy's and critic's DeepSpeed states leave the GPU between fits
    state_moves: str = "serial"  # "overlap": one more model's states are on the GPU while the other trains
    vllm_share: float = 0.9  # --vllm.gpu_memory_utilization
    streamed_roles: tuple = ()  # roles whose scorer keeps a KV cache during generation
    cache_budget_gb: float = 0.0  # per streamed scorer (--oppo.cache_budget_gb)
    frozen_beside_vllm: bool = False  # reward and reference on the engines' GPUs (--oppo.frozen_scorers_on)
    colocated_decode: bool = False  # engines decode during training under colocate_all (awake through it)
    staged_weights: bool = False  # each engine GPU receives the new weights into a copy (--oppo.weight_sync)

    def upstream(self) -> "Layout":
        """The same run without OPPO's parts: what OpenRLHF's synchronous trainer holds with these flags."""
        return replace(
            self,
            state_moves="serial",
            streamed_roles=(),
            cache_budget_gb=0.0,
            frozen_beside_vllm=False,
            colocated_decode=False,
            staged_weights=False,
        )


@dataclass(frozen=True)
class GPUPeak:
    label: str
    peak_gib: float
    phase: str
    parts: tuple  # (name, GiB) of the peak phase, largest first
    phases: dict = field(default_factory=dict, compare=False)  # every phase's (name, GiB) parts

    def role_gib(self, role: str, phase: str) -> float:
        """What one role's process holds on this GPU in a phase (its parts, without its CUDA context): what the
        process's caching allocator reserves there. Where a phase runs the roles one after the other (the fits
        under --ds.enable_sleep, the forwards upstream waits for), a role's is its own part of it."""
        own = f"{phase} ({role})"
        rows = self.phases.get(own) or self.phases.get(phase, ())
        return sum(gib for name, gib in rows if name.startswith(f"{role} "))


@dataclass(frozen=True)
class Estimate:
    per_gpu: tuple
    fits: bool
    worst: GPUPeak
    gpu_gib: float
    flag: str = ""  # the flag that shrinks the worst GPU's largest adjustable part

    def line(self) -> str:
        worst = self.worst
        top = ", ".join(f"{name} {gib:.1f}" for name, gib in worst.parts[:4])
        head = (
            f"{worst.peak_gib:.1f} of {self.gpu_gib:.1f} GiB on GPU {worst.label} in {worst.phase} ({top})"
            if self.fits
            else f"needs {worst.peak_gib:.1f} of {self.gpu_gib:.1f} GiB on GPU {worst.label} in {worst.phase} "
            f"({top}): change {self.flag}"
        )
        return f"memory: {'fits, ' if self.fits else 'does not fit: '}{head}"


TRAINABLE = ("critic", "policy")  # upstream's order of the fits under --ds.enable_sleep
# Which flag shrinks each kind of part (by the end of its name), for the refusal's line; None: no flag does.
FLAGS = {
    "vLLM share": "--vllm.gpu_memory_utilization",
    "vLLM weights": None,
    "vLLM asleep": None,
    "staged weights": "--oppo.weight_sync",
    "states": "--ds.enable_sleep",
    "training": "--train.micro_batch_size",
    "forward": "--rollout.micro_batch_size",
    "scorer cache": "--oppo.cache_budget_gb",
    "scorer prefill": "--oppo.max_prefill_tokens",
    "fp32 grads": "--ds.zero_stage",
    "reduce bucket": None,
    "weights": "--ds.zero_stage",
}


class _Sizes:
    """Per-role byte counts for one run (one rank on one GPU)."""

    def __init__(self, args, shapes: Dict[str, ModelShape], longest: int):
        self.args, self.shapes, self.longest = args, shapes, longest
        self.zero = args.ds.zero_stage
        self.adam_offload = args.ds.adam_offload
        self.options = config.values(args.oppo)  # the prefill's size, as given or its default

    def params(self, role: str) -> int:
        shape = self.shapes[role]
        return shape.params if role in LOG_PROBS else shape.value_params

    def shard(self, role: str, stage_from: int) -> int:
        """How many ways ZeRO splits what it partitions from ``stage_from`` on: the group's world size."""
        return topology.ranks(self.args, role) if self.zero >= stage_from else 1

    def weights(self, role: str) -> float:
        offload = role in FROZEN and getattr(self.args, topology.FLAG_GROUP[role]).offload
        return 0.0 if offload else 2 * self.params(role) / self.shard(role, 3)

    def states(self, role: str, fitting: bool = True) -> float:
        """DeepSpeed's states that --ds.enable_sleep moves: fp32 master and Adam (none under --ds.adam_offload),
        and, in the model's own fit, the bf16 gradient partition (ZeRO-1/2 frees it after the optimizer step)."""
        p = self.params(role)
        optimizer = 0 if self.adam_offload else 12 * p / self.shard(role, 1)
        return optimizer + (2 * p / self.shard(role, 2) if fitting else 0)

    def fp32_grads(self, role: str) -> float:
        """The fp32 gradient partition the optimizer step builds and leaves cached (on the host with CPU Adam)."""
        return 0.0 if self.adam_offload else 4 * self.params(role) / self.shard(role, 2)

    def sync_buffer(self) -> float:
        """The policy's copy of what it sends to the engines at once: a bucket (``--vllm.sync_bucket_mb``, where
        patches/openrlhf is applied, its default as the plan takes it) or one tensor, the largest being the
        embeddings. Engines on the policy's GPUs (CUDA IPC) keep a bucket's memory alive until they have loaded it,
        while the policy packs the next one: two at once."""
        shape = self.shapes["policy"]
        bucket = getattr(self.args.vllm, "sync_bucket_mb", config.SYNC_BUCKET_MB) * 2**20
        at_once = 2 if self.args.train.colocate_all else 1
        return at_once * max(bucket, 2 * shape.vocab_size * shape.hidden_size)

    def reduce_bucket(self) -> float:
        """The bf16 bucket DeepSpeed's backward reduces the gradients through, whatever the model's size."""
        return 2 * REDUCE_BUCKET_ELEMENTS

    def gathered(self, role: str) -> float:
        """ZeRO-3 gathers a few layers' weights around the one it computes."""
        return 4 * 2 * self.params(role) / self.shapes[role].num_layers if self.zero == 3 else 0.0

    def tokens(self, micro_batch: int, max_tokens: Optional[int]) -> int:
        if self.args.train.dynamic_batch_enable and max_tokens:
            return max_tokens
        return micro_batch * self.longest

    def forward(self, role: str) -> float:
        """make_experience's forward pass of one rollout micro-batch."""
        shape = self.shapes[role]
        n = self.tokens(self.args.rollout.micro_batch_size, self.args.rollout.max_tokens_per_gpu)
        logits = FORWARD_BYTES_PER_LOGIT * n * shape.vocab_size if role in LOG_PROBS else 0
        return logits + n * shape.forward_bytes_per_token + self.gathered(role)

    def training(self, role: str) -> float:
        """A fit's micro-batches: logits with their gradients (policy), activations kept for the backward, and the
        allocator's slack."""
        n = self.tokens(self.args.train.micro_batch_size, self.args.train.max_tokens_per_gpu)
        return self._training_bytes(role, n + TRAIN_SLACK_SEQUENCES * self.longest) + self.gathered(role)

    def _training_bytes(self, role: str, n: float) -> float:
        shape = self.shapes[role]
        logits = TRAIN_BYTES_PER_LOGIT * n * shape.vocab_size if role == "policy" else 0
        if self.args.actor.gradient_checkpointing_enable:  # upstream checkpoints the critic by the actor's flag
            return logits + n * (shape.num_layers * 2 * shape.hidden_size + shape.layer_bytes_per_token)
        return logits + n * shape.num_layers * shape.layer_bytes_per_token

    def cached(self, role: str, budget_gib: float) -> float:
        """What a streamed scorer's live sequences hold in its KV cache, within ``--oppo.cache_budget_gb``. A step
        completes rollout batch x n_samples sequences, shared among the role's ranks; each one's cache grows from
        nothing to its length while it decodes and is dropped when it ends, so on average the live ones hold half of
        theirs (at the longest)."""
        shape = self.shapes[role]
        sequences = (
            self.args.rollout.batch_size * self.args.rollout.n_samples_per_prompt / topology.ranks(self.args, role)
        )
        return min(budget_gib * GIB, sequences * self.longest / 2 * shape.kv_bytes_per_token)

    def scorer_cache(self, role: str, budget_gib: float) -> float:
        return self.cached(role, budget_gib) * self._reserve(role)

    def prefill(self, role: str, budget_gib: float) -> float:
        """One streamed prefill pass: ``--oppo.max_prefill_tokens`` new tokens over the gathered cache (at most
        ``--oppo.max_prefill_cached_tokens``, at most what the scorer holds: the gathered copy and the copy the
        model's cache concatenates with the new keys and values), and the logit rows of the log-prob roles."""
        shape = self.shapes[role]
        kv = shape.kv_bytes_per_token
        gathered = min(self.options.max_prefill_cached_tokens, self.cached(role, budget_gib) / kv)
        work = self.options.max_prefill_tokens * (shape.forward_bytes_per_token + 2 * kv) + gathered * 2 * kv
        if role in LOG_PROBS:
            # bf16 rows from the head and their float32 copy; the log-softmax is fused (flash-attn's cross-entropy,
            # or upstream's chunked logsumexp), with no full-size copy.
            work += SCORER_LOGIT_ROWS * shape.vocab_size * 6
        return PREFILL_SLACK * work * self._reserve(role) + self.gathered(role)

    @staticmethod
    def _reserve(role: str) -> float:
        return FROZEN_SCORER_RESERVE if role in FROZEN else 1.0


def _experience_waves(args, roles: tuple, streamed: tuple) -> Tuple[list, set]:
    """The roles whose forward passes (or their cached memory) are on the GPUs together during make_experience,
    each wave in upstream's dispatch order, and the roles whose cache is never emptied afterwards.

    Upstream waits for a forward and empties its cache where the placement colocates it (``_dispatch_forward``);
    under ``colocate_critic_reward`` the critic's dispatch first waits for the reward's. A streamed role's scores
    are ready: it runs no forward there."""
    train = args.train
    waits = {
        "reward": train.colocate_all,
        "policy": train.colocate_all or train.colocate_actor_ref,
        "critic": train.colocate_all or train.colocate_critic_reward,
        "reference": train.colocate_all or train.colocate_actor_ref,
    }
    running, waves = [], []
    for role in ("reward", "policy", "critic", "reference"):
        if role not in roles or role in streamed:
            continue
        if role == "critic" and train.colocate_critic_reward and "reward" in running:
            running.remove("reward")
        running.append(role)
        waves.append(tuple(running))  # the role dispatched last, last
        if waits[role]:
            running.remove(role)
    return waves, set(running)


def _gpu_phases(
    sizes: _Sizes, layout: Layout, group: topology.GPUGroup, index: int, gpu_gib: float
) -> Dict[str, list]:
    """Each phase's parts (name, bytes) on one GPU of ``group``."""
    args = sizes.args
    here = tuple(role for role in group.roles if topology.ranks(args, role) > index)
    models = tuple(role for role in here if role != "vllm")
    streamed = tuple(role for role in models if role in layout.streamed_roles)
    parts = {}

    def base(trainables_on: tuple, fitting: tuple = ()) -> list:
        """What the models hold in any phase: contexts, weights, the states of ``trainables_on`` (with their
        gradients for the models in ``fitting``), OPPO's caches."""
        rows = [("CUDA contexts", len(models) * PROCESS_GIB * GIB)] if models else []
        for role in models:
            rows.append((f"{role} weights", sizes.weights(role)))
            if role in trainables_on:  # --ds.enable_sleep moves the fp32 gradients with the states
                rows.append((f"{role} states", sizes.states(role, fitting=role in fitting)))
                rows.append((f"{role} fp32 grads", sizes.fp32_grads(role)))
            if role in streamed:
                rows.append((f"{role} scorer cache", sizes.scorer_cache(role, layout.cache_budget_gb)))
        return rows

    def engine(awake: bool, weights_only: bool = False) -> list:
        if "vllm" not in here:
            return []
        if awake:
            rows = [("vLLM share", layout.vllm_share * gpu_gib * GIB + VLLM_OVER_SHARE_GIB * GIB)]
        elif weights_only:
            rows = [
                ("vLLM weights", VLLM_ASLEEP_GIB * GIB + 2 * sizes.params("policy") / args.vllm.tensor_parallel_size)
            ]
        else:
            rows = [("vLLM asleep", VLLM_ASLEEP_GIB * GIB)]
        if layout.staged_weights:
            rows.append(("staged weights", 2 * sizes.params("policy") / args.vllm.tensor_parallel_size))
        return rows

    def prefill(roles) -> list:
        return [
            (f"{role} scorer prefill", sizes.prefill(role, layout.cache_budget_gb))
            for role in roles
            if role in streamed
        ]

    between = () if layout.ds_sleep else TRAINABLE
    frozen_streamed = tuple(role for role in streamed if role in FROZEN)
    parts["generation"] = engine(True) + base(between) + prefill(streamed)

    waves, kept = _experience_waves(args, models, streamed)
    awake_after_generation = layout.vllm_awake or layout.colocated_decode
    experience = engine(awake_after_generation) + base(between) + prefill(streamed)
    # Each forward that upstream waits for is a phase of its own, named by its role as the fits are: what each
    # role's process holds is then its own forward's phase, whichever forward is the GPU's largest.
    for wave in waves or [()]:
        name = f"make_experience ({wave[-1]})" if len(waves) > 1 else "make_experience"
        parts[name] = experience + [(f"{role} forward", sizes.forward(role)) for role in wave]

    trainables = tuple(role for role in TRAINABLE if role in models)
    kept_rows = [(f"{role} forward", sizes.forward(role)) for role in kept] + prefill(frozen_streamed)
    if layout.ds_sleep:
        fits = [(role,) for role in trainables]  # one fit at a time, its states moved on and off around it
    else:
        fits = [trainables] if trainables else []
    fitting = {}  # phase -> the models whose fit it is: their cached fp32 gradients are in use there
    for fit in fits:
        on = trainables if (not layout.ds_sleep or layout.state_moves == "overlap") else fit
        name = "training" if len(fits) == 1 else f"training ({fit[0]})"
        fitting[name] = set(fit)
        parts[name] = (
            engine(awake_after_generation)
            + base(on, fitting=fit)
            + kept_rows
            + [(f"{role} training", sizes.training(role)) for role in fit]
            + [(f"{role} reduce bucket", sizes.reduce_bucket()) for role in fit]
        )
    if not fits:
        parts["training"] = engine(awake_after_generation) + base(()) + kept_rows

    sending = [("policy sync buffer", sizes.sync_buffer())] if "policy" in models else []
    parts["weight sync"] = engine(layout.vllm_awake, weights_only=True) + base(between) + kept_rows + sending
    return {name: _reuse_cached_grads(rows, fitting.get(name, set())) for name, rows in parts.items()}


TRANSIENTS = ("forward", "scorer cache", "scorer prefill", "sync buffer")


def _reuse_cached_grads(rows: list, fitting: set) -> list:
    """Outside its fit, a model's fp32 gradient partition is a freed block its process's allocator keeps: that
    process's other tensors (a forward, a scorer's cache and prefill, the sync buffer) are cut from it before the
    allocator reserves more. Counts of the block only what they leave unused."""
    out = []
    for name, size in rows:
        role = name.split(" ")[0]
        if name.endswith("fp32 grads") and role not in fitting:
            used = sum(b for n, b in rows if n.startswith(f"{role} ") and n.endswith(TRANSIENTS))
            size = max(0.0, size - used)
        out.append((name, size))
    return out


def estimate(args, layout: Layout, gpu_gib: float, shapes=None, longest: Optional[int] = None) -> Estimate:
    """Each GPU's peak over the phases of a step, in GiB, and whether the worst fits in ``gpu_gib``.

    ``shapes``: ModelShape by role (default: read from the checkpoints, ``shapes_from_args``); ``longest``: the
    longest sequence in tokens, prompt and response (default ``--data.max_len``)."""
    shapes = shapes or shapes_from_args(args)
    if shapes is None:
        raise LookupError("a model's config.json cannot be read without the network: no memory estimate")
    sizes = _Sizes(args, shapes, longest or args.data.max_len)
    peaks = []
    for group in topology.of(args, layout.frozen_beside_vllm).groups:
        for index in range(group.gpus):
            phases = {
                name: tuple(sorted(((part, b / GIB) for part, b in rows if b > 0), key=lambda row: -row[1]))
                for name, rows in _gpu_phases(sizes, layout, group, index, gpu_gib).items()
            }
            phase = max(phases, key=lambda name: sum(gib for _, gib in phases[name]))
            label = f"{group.label} {index}" if group.gpus > 1 else group.label
            peaks.append(GPUPeak(label, sum(gib for _, gib in phases[phase]), phase, phases[phase], phases))
    worst = max(peaks, key=lambda peak: peak.peak_gib)
    return Estimate(tuple(peaks), worst.peak_gib <= gpu_gib, worst, gpu_gib, _flag_to_change(worst, layout))


def _flag_to_change(peak: GPUPeak, layout: Layout) -> str:
    """The flag whose parts weigh most in the worst GPU's peak phase (the states only where they stay on the GPU)."""
    freed = {}
    for name, gib in peak.parts:
        kind = next((kind for kind in FLAGS if name.endswith(kind)), None)
        if kind is None or FLAGS[kind] is None or (kind == "states" and layout.ds_sleep):
            continue
        freed[FLAGS[kind]] = freed.get(FLAGS[kind], 0.0) + gib
    return max(freed, key=freed.get) if freed else "--vllm.gpu_memory_utilization"
