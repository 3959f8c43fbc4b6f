"""Bucketed weight sync (``openrlhf_oppo/weight_sync.py``, ``patches/openrlhf/0007``) on a real vLLM engine.

The policy's rank 0 is this process (a Hugging Face model of the actor checkpoint with new weights); the
engine's worker is rank 1 of a gloo group (``cpu_pipeline.GlooGroup``, CPU's stand-in for NCCL). After a
sync the engine must generate exactly (greedy tokens and their log-probs) what it generates with the new
weights loaded from a file, whatever the bucket size, parameter by parameter included.
"""

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import SamplingParams

from openrlhf_oppo.coordinator import StreamCoordinator
from openrlhf_oppo.testing.cpu_pipeline import GlooGroup, scorer_settings, stream_settings
from openrlhf_oppo.weight_sync import (
    SyncPlan,
    WeightSyncRolloutMixin,
    broadcast_to_vllm,
    flatten,
    plan_buckets,
    send_bucket,
    unflatten,
)

PROMPTS = [[5, 17, 33, 2, 90], [400, 401, 7], [1000, 3, 3, 3, 12, 64, 9]]
LONG_PROMPT = "7: of to and in is for on with as by"


def _greedy(max_tokens, logprobs=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def _outputs(engine):
    """Greedy tokens and their log-probs for ``PROMPTS``, one request at a time (the same batches each time)."""
    outputs = []
    for prompt in PROMPTS:
        completion = ray.get(engine.generate.remote(prompt, _greedy(16, logprobs=0))).outputs[0]
        logprobs = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
        outputs.append((list(completion.token_ids), logprobs))
    return outputs


@pytest.fixture(scope="module")
def weights(engine, checkpoints, tmp_path_factory):
    """The actor with new weights (every parameter moved), both weight files, and what the engine generates
    with each, loaded from the files (vLLM's own reload of a checkpoint)."""
    folder = tmp_path_factory.mktemp("weights")
    model = AutoModelForCausalLM.from_pretrained(checkpoints["actor"], torch_dtype=torch.float32)
    original = {name: param.detach().clone() for name, param in model.named_parameters()}
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().clamp_min(0.02) * 0.5)
    save_file(original, folder / "original.safetensors")
    save_file({name: param.detach() for name, param in model.named_parameters()}, folder / "new.safetensors")
    paths = dict(original=str(folder / "original.safetensors"), new=str(folder / "new.safetensors"))

    ray.get(engine.load_weights.remote(paths["new"]))
    new_outputs = _outputs(engine)
    ray.get(engine.load_weights.remote(paths["original"]))
    old_outputs = _outputs(engine)
    assert new_outputs != old_outputs  # the new weights show in every comparison below
    yield SimpleNamespace(model=model, paths=paths, new=new_outputs, old=old_outputs)
    ray.get(engine.load_weights.remote(paths["original"]))


@pytest.fixture
def group(engine):
    """A fresh gloo group: this process is rank 0, the engine's worker rank 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    joined = engine.init_process_group.remote("127.0.0.1", port, 1, 2, "oppo-weight-sync", "gloo", False)
    group = GlooGroup("127.0.0.1", port, 0, 2, timeout_s=120)
    ray.get(joined)
    return group


def _trainer(model, engine, group):
    """What ``broadcast_to_vllm`` reads of upstream's ``ActorPPOTrainer`` (here a plain model, no DeepSpeed)."""
    args = SimpleNamespace(
        vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False),
        ds=SimpleNamespace(zero_stage=0, tensor_parallel_size=1),
    )
    return SimpleNamespace(
        strategy=SimpleNamespace(args=args),
        actor=SimpleNamespace(model=SimpleNamespace(module=model)),
        vllm_engines=[engine],
        _model_update_group=group,
        use_cuda_ipc=False,
    )


def test_buckets_keep_order_one_dtype_and_the_size_limit():
    params = [
        ("a", torch.randn(10)),  # 40 bytes
        ("b", torch.randn(3, 5)),  # 60
        ("c", torch.randn(100)),  # 400: over the limit, a bucket of its own
        ("d", torch.randn(4, dtype=torch.bfloat16)),  # another dtype, another bucket
        ("e", torch.randn(2)),
        ("f", torch.randn(2)),
    ]
    buckets = plan_buckets(params, bucket_bytes=128)
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert [[name for name, _ in bucket] for bucket in plan_buckets(params, 1)] == [[name] for name in "abcdef"]
    for bucket in buckets:
        tensors = [tensor for _, tensor in bucket]
        views = unflatten(flatten(tensors), [name for name, _ in bucket], [t.shape for t in tensors])
        assert [name for name, _ in views] == [name for name, _ in bucket]
        assert all(
            torch.equal(view, tensor) and view.shape == tensor.shape for (_, view), tensor in zip(views, tensors)
        )


def test_sync_plan_stages_only_where_engines_decode_through_the_sync():
    from openrlhf_oppo.plan import Carry, Overcommit, Plan, Sync

    def plan(bucket_mb=512, inter_step=True, sleep=False, colocate_all=False, weight_sync="staged"):
        return Plan(
            enabled=True,
            carry=Carry(overcommit=Overcommit(initial=4 if inter_step else 0)),
            sync=Sync(mode=weight_sync, bucket_mb=bucket_mb, colocate_all=colocate_all, vllm_sleeps=sleep),
        )

    assert SyncPlan.of(plan()) == SyncPlan(512 << 20, staged=True)
    assert not SyncPlan.of(plan(weight_sync="paused")).staged
    assert not SyncPlan.of(plan(inter_step=False)).staged  # nothing decodes during the sync
    assert not SyncPlan.of(plan(sleep=True)).staged
    assert not SyncPlan.of(plan(colocate_all=True)).staged  # engines paused while the models train
    assert SyncPlan.of(plan(bucket_mb=0)) == SyncPlan(0, staged=False)  # upstream's own sync


def test_rollout_actor_swaps_in_the_worker_extension_only_for_upstreams():
    import asyncio

    class Base:
        async def __init__(self, **kwargs):
            self.kwargs = kwargs

    class Actor(WeightSyncRolloutMixin, Base):
        pass

    def built(**kwargs):
        actor = Actor.__new__(Actor)
        asyncio.run(actor.__init__(**kwargs))
        return actor.kwargs["worker_extension_cls"]

    assert built(worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap") == (
        "openrlhf_oppo.weight_sync.OPPOWorkerWrap"
    )
    assert built(worker_extension_cls="my.Wrap") == "my.Wrap"


@pytest.mark.engine
@pytest.mark.parametrize(
    "bucket_bytes,staged",
    [(1, False), (64 << 10, False), (512 << 20, False), (64 << 10, True)],
    ids=["per-tensor", "64KB", "512MB", "64KB-staged"],
)
def test_bucketed_sync_equals_loading_the_new_weights(engine, weights, group, bucket_bytes, staged):
    """The trainer's sequence (``StreamCoordinator.sync_weights``) around the policy's ``broadcast_to_vllm``: paused with
    each bucket loaded on arrival, or staged and loaded at once."""
    plan = SyncPlan(bucket_bytes, staged=staged)
    trainer = _trainer(weights.model, engine, group)
    buckets = []
    try:
        send = lambda: buckets.append(broadcast_to_vllm(trainer, plan))  # noqa: E731
        timings = StreamCoordinator([engine], {}).sync_weights(
            send, plan.staged, pause=True, clear_cache=True, weight_version=1
        )
        assert _outputs(engine) == weights.new
    finally:
        ray.get(engine.oppo_drop_staged.remote())
        ray.get(engine.load_weights.remote(weights.paths["original"]))
        ray.get(engine.oppo_resume.remote(0))
    num_params = len(list(weights.model.parameters()))
    expected = {1: num_params, 64 << 10: None, 512 << 20: 1}[bucket_bytes]
    if expected is None:  # q/k/v and gate/up of a layer land in different buckets here
        assert 2 < buckets[0] < num_params
    else:
        assert buckets == [expected]
    if staged:  # paused for the load only
        assert 0 < timings["oppo/weight_sync_pause_s"] < timings["oppo/weight_sync_s"]
    else:
        assert timings["oppo/weight_sync_pause_s"] == timings["oppo/weight_sync_s"]


@pytest.mark.engine
def test_staged_receive_keeps_decoding_then_pause_load_resume(engine, weights, group, checkpoints):
    """A request decodes while every bucket is staged, with the old weights (its tokens and log-probs so far
    are the old weights' greedy ones); pause, load the staged weights, resume: it finishes with the new
    weights (re-prefilled, ``clear_cache``), and new requests get them too. The calls are ``StreamCoordinator.sync_weights``'s.
    """
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["actor"])
    prompt_ids = tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]
    length, params = 200, list(weights.model.named_parameters())
    old = _completion(engine, prompt_ids, length)
    buckets = plan_buckets(params, 64 << 10)
    coordinator = StreamCoordinator([engine], {})
    # Inter-step: the engine tracks its samples across weight updates.
    coordinator.connect(scorer_settings(1 << 30, 1.0), stream_settings(8, salt_prompts=True))
    try:
        greedy = _greedy(length, logprobs=0)
        running = engine.generate_responses.remote(LONG_PROMPT, str(length), greedy, 256, tokenizer, 1)
        _wait_for(lambda: _in_flight(engine) >= 5)
        for i, bucket in enumerate(buckets):
            before = _in_flight(engine)
            shapes = [tuple(param.shape) for _, param in bucket]
            send_bucket([engine], group, bucket, shapes, stage=True, last=i == len(buckets) - 1)
            _wait_for(lambda: _in_flight(engine) > before)  # the engine decodes with buckets staged
        coordinator.pause(clear_cache=True)
        done_before = _settled_in_flight(engine)  # outputs computed before the pause are on their way
        assert done_before < length - 20
        assert ray.get(engine.oppo_load_staged.remote()) == len(params)
        coordinator.resume(1)

        response = ray.get(running)[0]
        assert len(response["observation_tokens"]) == len(prompt_ids) + length
        assert response["stream_info"].last_version == 1
        ours = list(zip(response["observation_tokens"], response["rollout_log_probs"]))[len(prompt_ids) :]
        assert ours[:done_before] == old[:done_before]  # staging left the live weights alone
        prefix = prompt_ids + [token for token, _ in ours[:done_before]]
        assert ours[done_before:] == _completion(engine, prefix, length - done_before)  # the new weights
        assert _outputs(engine) == weights.new
        assert ray.get(engine.oppo_load_staged.remote()) == 0  # the staging copy is gone
        ray.get(engine.load_weights.remote(weights.paths["original"]))
        assert ours[done_before:] != _completion(engine, prefix, length - done_before)  # not the old ones
    finally:
        ray.get(engine.oppo_drop_staged.remote())
        ray.get(engine.load_weights.remote(weights.paths["original"]))
        coordinator.resume(0)
        coordinator.connect(scorer_settings(1 << 30, 1.0), stream_settings(8, salt_prompts=False))


def test_prompts_sent_to_paused_engines_wait_queued_until_the_restart(engine, checkpoints):
    """``Plan.top_up_while_paused``: colocated engines pause as a step's generation ends, then get the next step's
    prompts, which must not decode beside the experiences, only once training restarts the engines; then they
    decode as they would have."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["actor"])
    greedy = _greedy(8)
    started = time.time()
    expected = ray.get(engine.generate_responses.remote(LONG_PROMPT, "8", greedy, 256, tokenizer, 2))
    unpaused_s = time.time() - started
    coordinator = StreamCoordinator([engine], {})
    coordinator.pause(clear_cache=False)
    try:
        queued = engine.generate_responses.remote(LONG_PROMPT, "8", greedy, 256, tokenizer, 2)
        done, _ = ray.wait([queued], timeout=5 * unpaused_s + 1.0)
        assert not done  # unpaused, the same prompts were done in a fifth of this
    finally:
        waited = coordinator.unpause()
    responses = ray.get(queued, timeout=120)
    assert waited >= 5 * unpaused_s + 1.0
    tokens = [r["observation_tokens"] for r in responses]
    assert tokens == [r["observation_tokens"] for r in expected]


@pytest.mark.engine
def test_patched_upstream_sync_loads_the_new_weights(ray_session, engine, weights, patched_openrlhf):
    """patches/openrlhf/0007: upstream's patched sender, engine call and worker method, against this engine."""
    helper = os.path.join(os.path.dirname(__file__), "patched_sync_helper.py")
    argv = [ray_session, patched_openrlhf, weights.model.name_or_path, weights.paths["new"], str(64 / 1024)]
    try:
        result = subprocess.run([sys.executable, helper, *argv], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert _outputs(engine) == weights.new
    finally:
        ray.get(engine.load_weights.remote(weights.paths["original"]))
    calls, params = [int(word) for word in result.stdout.split() if word.isdigit()][-2:]
    assert 2 < calls < params  # buckets of 64 KB: several, fewer than the parameters


def _completion(engine, prompt_ids, max_tokens):
    """(token, log-prob) pairs of a greedy completion (the log-probs tell weights apart where tokens agree)."""
    completion = ray.get(engine.generate.remote(prompt_ids, _greedy(max_tokens, logprobs=0))).outputs[0]
    return [(token, step[token].logprob) for token, step in zip(completion.token_ids, completion.logprobs)]


def _in_flight(engine) -> int:
    return max(ray.get(engine.oppo_in_flight.remote()).values(), default=0)


def _settled_in_flight(engine) -> int:
    """Tokens of the paused request, once no more arrive (the last step's outputs may still be on their way)."""
    counts = [_in_flight(engine)]
    while len(counts) < 5 or len(set(counts[-4:])) > 1:
        time.sleep(0.15)
        counts.append(_in_flight(engine))
    return counts[-1]


def _wait_for(condition, timeout_s=60.0):
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)
