"""Streamed prefill under ZeRO-3: two ranks, DeepSpeed's CPU accelerator, gloo.

Each rank loads the four models the way OpenRLHF does under ``--ds.zero_stage 3`` (parameters partitioned
by ``deepspeed.zero.Init`` while loading, then ``deepspeed.initialize``: the policy and the critic with an
optimizer, the reward and reference models for inference), builds its scoring actors' scorers, and streams
its own sequences in chunks of its own size, so the two ranks run different numbers of forwards: a forward
that all-gathered parameters would leave the other rank waiting. The scores must equal upstream's ZeRO-3
forward over the full sequences (float32, 1e-5), before and after a training step of the policy and the
critic taken halfway through the streams. The policy and the critic stream on a gathered copy of their
weights; the reward and reference actors are OPPO's own, loaded by their ``init_model_from_pretrained``
from a ``--ds.zero_stage 3`` command line, and must hold their weights unsharded. A policy rank that runs out
of memory in a prefill frees its copy and streams no more, and the next step's gathers still line up.
"""

import os
import socket
import weakref
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from test_scorer import TEMPERATURE, TOLERANCE, make_batch

from openrlhf_oppo.protocol import Chunk
from openrlhf_oppo.streaming import actors
from openrlhf_oppo.streaming.zero3 import is_partitioned
from openrlhf_oppo.testing.cpu_pipeline import run_out_of_memory_at_prefill, scorer_settings

pytestmark = pytest.mark.process  # the ranks are processes of their own

WORLD_SIZE = 2
CHUNK_SIZES = (3, 16)  # per rank


def test_streamed_scores_under_zero3_equal_upstream(checkpoints):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, checkpoints), nprocs=WORLD_SIZE, join=True)


def _rank(rank, port, checkpoints):
    import importlib

    import deepspeed

    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce on first use (minutes on a small
    # machine) that nothing here uses: gloo does the communication.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    assert deepspeed.comm.get_world_size() == WORLD_SIZE

    _load_in_float32()
    # The frozen actors load first: transformers keeps the last ZeRO-3 config loaded in this process as a global,
    # which the ZeRO-3 models below would leave behind (an actor's own process loads one model).
    args = _run_args(checkpoints)
    scorers = {role: _frozen_actor(role, checkpoints, args) for role in ("reward", "reference")}
    for role, actor in scorers.items():
        assert actor.oppo_copy is None and not is_partitioned(actor.oppo_scorer.model), role
    models = _load_models(checkpoints)
    for role in ("policy", "critic"):
        scorers[role] = _scoring_actor(role, models[role], args)
        assert scorers[role].oppo_copy is not None and not _has_zero3_hooks(scorers[role].oppo_copy.module), role

    sequences, input_ids, attention_mask, action_mask = make_batch(seed=rank, count=5)
    halves = [len(tokens) // 2 + 1 for _, tokens in sequences]
    chunk_size = CHUNK_SIZES[rank]

    # Each rank streams its own sequences, in chunks of its own size, through every model.
    before = {role: _stream(actor, "a", sequences, chunk_size) for role, actor in scorers.items()}
    expected = _upstream(models, input_ids, attention_mask, action_mask)
    _assert_equal(before, sequences, expected)
    forwards = [None] * WORLD_SIZE
    torch.distributed.all_gather_object(forwards, [a.oppo_scorer.stats["forwards"] for a in scorers.values()])
    assert all(len(set(counts)) == WORLD_SIZE for counts in zip(*forwards)), forwards  # not in lockstep

    # Halfway through new streams, the policy and the critic train one step (a collective, as upstream
    # calls fit on every rank); the rest of each sequence streams under the new weights.
    for role, actor in scorers.items():
        _stream(actor, "b", sequences, chunk_size, stop=halves)
    for role in ("policy", "critic"):
        scorers[role].fit(input_ids, attention_mask, action_mask)
    after = {role: _stream(actor, "b", sequences, chunk_size, start=halves) for role, actor in scorers.items()}
    expected_after = _upstream(models, input_ids, attention_mask, action_mask)
    _assert_equal(after, sequences, expected_after)
    for role in ("policy", "critic"):
        moved = max((after[role][i] - before[role][i]).abs().max() for i in range(len(sequences)))
        assert moved > 100 * TOLERANCE, f"the {role}'s step did not change its scores"

    # Rank 1's policy runs out of memory halfway through new streams: it streams no more and frees its copy, but
    # still takes part in the gathers of the next step, after which rank 0's policy streams the new weights' scores.
    policy, out_of_memory = scorers["policy"], rank == 1
    copy = weakref.ref(policy.oppo_copy.module)
    if out_of_memory:
        run_out_of_memory_at_prefill(policy.oppo_copy.module, forward=1)
    _stream(policy, "c", sequences, chunk_size, stop=halves)
    assert policy.oppo_stats().streaming_off == (copy() is None) == out_of_memory  # nothing keeps the copy
    policy.fit(input_ids, attention_mask, action_mask)
    scores = _stream(policy, "c", sequences, chunk_size, start=halves)
    with torch.no_grad():
        expected_later = models["policy"].eval()(input_ids, action_mask, attention_mask)
    if not out_of_memory:
        _assert_equal({"policy": scores}, sequences, {"policy": expected_later})
    else:
        assert scores == [None] * len(sequences)  # left to upstream's forward


def _load_in_float32():
    """OpenRLHF loads bf16 or fp16 only; float32 is what makes a 1e-5 comparison meaningful on CPU."""
    import openrlhf.utils.utils

    to_dtype = openrlhf.utils.utils.convert_to_torch_dtype
    openrlhf.utils.utils.convert_to_torch_dtype = lambda name: torch.float32 if name == "fp32" else to_dtype(name)


def _load_models(checkpoints):
    """The four models as OpenRLHF's actors load them under ZeRO-3, in float32 (CPU, tolerance 1e-5)."""
    import deepspeed
    from openrlhf.models import Actor, get_llm_for_sequence_regression
    from openrlhf.utils.deepspeed.deepspeed_utils import get_eval_ds_config, get_train_ds_config

    # As DeepspeedStrategy.get_ds_train_config, with torch's AdamW (DeepSpeed's fused Adam is compiled).
    optimizer = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
    train_config = get_train_ds_config(False, adam_offload=False, stage=3, param_dtype="fp32", zpg=1)
    train_config.update(optimizer=optimizer, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    eval_config = get_eval_ds_config(False, stage=3, param_dtype="fp32")
    eval_config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    # DeepSpeed gathers several parameters with one async all-gather each and waits for the last one only,
    # which on a GPU stream implies the others. Gloo runs them on several threads: on CPU the others may
    # not have landed yet (a weight loaded as garbage now and then). Gather one at a time here.
    for config in (train_config, eval_config):
        config["zero_optimization"]["stage3_allgather_sequential"] = True

    def value_model(kind, config):
        model = get_llm_for_sequence_regression(
            checkpoints["reward"],
            kind,
            param_dtype="fp32",
            attn_implementation="sdpa",
            normalize_reward=True,
            ds_config=config,
        )
        model.mean[0], model.std[0] = 0.3, 2.0  # exercise upstream's normalisation (buffers: not sharded)
        return model

    def actor(config):
        return Actor(
            checkpoints["actor"],
            attn_implementation="sdpa",
            param_dtype="fp32",
            ds_config=config,
            temperature=TEMPERATURE,
        )

    def initialize(model, config, train):
        inner = model.model if isinstance(model, Actor) else model
        parameters = [p for p in inner.parameters() if p.requires_grad] if train else None
        engine, *_ = deepspeed.initialize(model=inner, model_parameters=parameters, config=config)
        if isinstance(model, Actor):
            model.model = engine
            return model
        return engine

    return dict(
        policy=initialize(actor(train_config), train_config, train=True),
        critic=initialize(value_model("critic", train_config), train_config, train=True),
        reward=initialize(value_model("reward", eval_config), eval_config, train=False),
        reference=initialize(actor(eval_config), eval_config, train=False),
    )


class _Trainable:
    """A stand-in for upstream's ``fit``: one optimizer step of the DeepSpeed engine, on every rank."""

    def fit(self, input_ids, attention_mask, action_mask):
        model = self.oppo_model()
        engine = model.model if self.oppo_role == "policy" else model
        model.train()
        outputs = model(input_ids, action_mask, attention_mask)
        engine.backward(outputs.pow(2).mean() if self.oppo_role == "critic" else -outputs.mean())
        engine.step()
        model.eval()
        return {}


# The scorers' settings (``oppo_setup``), the same for every role.
SCORER_SETTINGS = scorer_settings(1 << 30, TEMPERATURE)


def _run_args(checkpoints):
    """The flags of a ``--ds.zero_stage 3`` run of these models with OPPO on, in float32 (see
    ``_load_in_float32``; upstream's parser offers bf16 and fp16 only)."""
    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    argv = [
        "--actor.model_name_or_path", checkpoints["actor"],
        "--reward.model_name_or_path", checkpoints["reward"],
        "--critic.model_name_or_path", checkpoints["reward"],
        "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa",
        "--reward.normalize_enable",
        "--rollout.temperature", str(TEMPERATURE),
        "--vllm.num_engines", "1",
        "--oppo.enable",
    ]  # fmt: skip
    args = parse_args(argv)
    args.ds.param_dtype = "fp32"
    return args


def _frozen_actor(role, checkpoints, args):
    """OPPO's reward or reference actor (outside Ray), loaded by its own ``init_model_from_pretrained`` as the
    placement loads it under ``--ds.zero_stage 3`` (``args``), with the scorer set up."""
    from openrlhf.utils import get_strategy

    from openrlhf_oppo.plan import resolve

    plan = resolve(args)
    assert role in plan.stream.roles
    strategy = get_strategy(args)
    strategy.setup_distributed = lambda: None  # upstream's builds a CUDA device mesh; gloo is up already
    cls = actors.StreamingRewardModelActor if role == "reward" else actors.StreamingReferenceModelActor
    actor = cls.__new__(cls)  # BaseDistributedActor.__init__ only sets a GPU rank's environment
    actor.oppo_plan, actor.oppo_peaks = plan, actors.PhasePeaks()  # what the constructor sets
    actor.init_model_from_pretrained(strategy, checkpoints["reward" if role == "reward" else "actor"])
    assert strategy.stage == 0
    if role == "reward":
        model = actor.model.module
        model.mean[0], model.std[0] = 0.3, 2.0  # as _load_models' upstream reward model
    actor.oppo_setup(role, SCORER_SETTINGS)
    return actor


def _scoring_actor(role, model, args):
    """The real ``oppo_*`` side of the policy's or the critic's scoring actor (``streaming/actors.py``) over
    ``model``, with ``_Trainable``'s fit."""
    base = (actors._TrainableScorerMixin, _Trainable)
    actor = type(f"{role}Scorer", base, {"oppo_model": lambda self: model})()
    actor.strategy = SimpleNamespace(args=args)  # the run's flags, which OPPO's fit reads
    actor.oppo_setup(role, SCORER_SETTINGS)
    return actor


def _stream(actor, name, sequences, chunk_size, start=None, stop=None):
    """Stream tokens ``start[i]:stop[i]`` of each sequence (all of it by default) through ``actor.oppo_prefill``,
    ``chunk_size`` new tokens a chunk (the first one also holds the prompt). Returns the collected scores if
    every sequence reached its end."""
    position = list(start or [0] * len(sequences))
    stop = stop or [len(tokens) for _, tokens in sequences]
    while any(p < s for p, s in zip(position, stop)):
        chunks = []
        for i, (prompt_len, tokens) in enumerate(sequences):
            if position[i] < stop[i]:
                end = min(stop[i], max(position[i], prompt_len) + chunk_size)
                chunks.append(
                    Chunk(f"{name}{i}", position[i], tokens[position[i] : end], prompt_len, end == len(tokens))
                )
                position[i] = end
        actor.oppo_prefill(chunks)
    if any(end < len(tokens) for end, (_, tokens) in zip(stop, sequences)):
        return None
    collected = actor.oppo_collect([f"{name}{i}" for i in range(len(sequences))])
    return [getattr(collected[f"{name}{i}"], "output", None) for i in range(len(sequences))]


@torch.no_grad()
def _upstream(models, input_ids, attention_mask, action_mask):
    """Upstream's forward on the ZeRO-3 engines (all ranks together), in eval mode as the actors run it."""
    for model in models.values():
        model.eval()
    return dict(
        policy=models["policy"](input_ids, action_mask, attention_mask),
        critic=models["critic"](input_ids, action_mask, attention_mask),
        reward=models["reward"](input_ids, attention_mask, pad_sequence=True),
        reference=models["reference"](input_ids, action_mask, attention_mask),
    )


def _assert_equal(results, sequences, expected):
    for role, outputs in results.items():
        for i, (prompt_len, tokens) in enumerate(sequences):
            assert outputs[i] is not None, (role, i)
            want = expected[role][i] if role == "reward" else expected[role][i, prompt_len - 1 : len(tokens) - 1]
            torch.testing.assert_close(
                outputs[i], want, atol=TOLERANCE, rtol=0, msg=lambda m: f"{role} {i}: {m}\n{outputs[i]}\n{want}"
            )


def _has_zero3_hooks(module):
    return any(hasattr(p, "ds_id") for p in module.parameters()) or any(
        m._forward_pre_hooks or m._forward_hooks for m in module.modules()
    )
