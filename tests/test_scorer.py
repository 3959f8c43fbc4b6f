"""ChunkScorer against upstream's full forward (float32, CPU): rewards, values and log-probs to 1e-5."""

import random

import pytest
import torch

from openrlhf_oppo.protocol import Chunk, ScorerSettings
from openrlhf_oppo.streaming.actors import StreamingScorerMixin
from openrlhf_oppo.streaming.scorer import ChunkScorer
from openrlhf_oppo.testing.cpu_pipeline import run_out_of_memory_at_prefill

TOLERANCE = 1e-5
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def models(checkpoints):
    from openrlhf.models import Actor, get_llm_for_sequence_regression

    def value_model(kind):
        model = get_llm_for_sequence_regression(
            checkpoints["reward"], kind, param_dtype="bf16", attn_implementation="sdpa", normalize_reward=True
        )
        model.mean[0], model.std[0] = 0.3, 2.0  # exercise upstream's normalisation too
        return model.float().eval()

    actor = Actor(checkpoints["actor"], attn_implementation="sdpa", param_dtype="bf16", temperature=TEMPERATURE)
    actor.model.float().eval()
    return dict(reward=value_model("reward"), critic=value_model("critic"), actor=actor)


def make_batch(seed=0, count=7):
    """Prompts of 3..12 tokens, responses of mixed lengths (1 token to past several chunks)."""
    rng = random.Random(seed)
    sequences = []
    for _ in range(count):
        prompt_len = rng.randint(3, 12)
        response_len = rng.choice([1, 2, 5, 17, 40, 64, 70])
        sequences.append((prompt_len, [rng.randint(1, 2000) for _ in range(prompt_len + response_len)]))
    width = max(len(tokens) for _, tokens in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)  # right padding, as upstream batches
    attention_mask = torch.zeros_like(input_ids)
    action_mask = torch.zeros(len(sequences), width - 1)
    for row, (prompt_len, tokens) in enumerate(sequences):
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        action_mask[row, prompt_len - 1 : len(tokens) - 1] = 1
    return sequences, input_ids, attention_mask, action_mask


@torch.no_grad()
def upstream_outputs(models, input_ids, attention_mask, action_mask):
    return dict(
        reward=models["reward"](input_ids, attention_mask, pad_sequence=True),
        critic=models["critic"](input_ids, action_mask, attention_mask),
        policy=models["actor"](input_ids, action_mask, attention_mask),
    )


def stream(scorer, sequences, chunk_size):
    """Feed every sequence in chunks of ``chunk_size`` new tokens (the first one also holds the prompt)."""
    results, sent = {}, [0] * len(sequences)
    while any(s is not None for s in sent):
        chunks = []
        for i, (prompt_len, tokens) in enumerate(sequences):
            if sent[i] is None:
                continue
            end = min(len(tokens), (sent[i] or prompt_len) + chunk_size)
            chunks.append(Chunk(f"s{i}", sent[i], tokens[sent[i] : end], prompt_len, final=end == len(tokens)))
            sent[i] = None if end == len(tokens) else end
        results.update(scorer.process(chunks))
    return results


def scorers(models, budget=1 << 30):
    return dict(
        reward=ChunkScorer(models["reward"], "reward", budget),
        critic=ChunkScorer(models["critic"], "critic", budget),
        policy=ChunkScorer(models["actor"].model, "policy", budget, temperature=TEMPERATURE),
    )


def assert_equal_to_upstream(results, sequences, expected):
    for role, by_uid in results.items():
        for i, (prompt_len, tokens) in enumerate(sequences):
            scored = by_uid[f"s{i}"]
            assert scored.output is not None, (role, i)
            if role == "reward":
                torch.testing.assert_close(scored.output, expected["reward"][i], atol=TOLERANCE, rtol=0)
            else:
                assert scored.output.shape == (len(tokens) - prompt_len,)
                span = expected[role][i, prompt_len - 1 : len(tokens) - 1]
                torch.testing.assert_close(scored.output, span, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
def test_streamed_scores_equal_full_forward(models, chunk_size):
    sequences, input_ids, attention_mask, action_mask = make_batch(seed=chunk_size)
    expected = upstream_outputs(models, input_ids, attention_mask, action_mask)
    results = {role: stream(scorer, sequences, chunk_size) for role, scorer in scorers(models).items()}
    assert_equal_to_upstream(results, sequences, expected)
    if chunk_size < 64:
        longer = [r for r in results["critic"].values() if r.length - r.prompt_len > chunk_size]
        assert longer and all(len(r.prefilled) > 1 for r in longer)  # prefilled before the last chunk too


@pytest.mark.parametrize("chunk_size", [7, 10_000])
def test_log_probs_in_slices_of_positions_equal_full_forward(models, chunk_size):
    """The policy's log-probs computed a few positions at a time (bounded logits memory) are upstream's."""
    sequences, input_ids, attention_mask, action_mask = make_batch(seed=11)
    expected = upstream_outputs(models, input_ids, attention_mask, action_mask)
    policy = ChunkScorer(models["actor"].model, "policy", 1 << 30, temperature=TEMPERATURE, max_logit_rows=3)
    assert max(len(tokens) - prompt_len for prompt_len, tokens in sequences) > 3 * policy.max_logit_rows
    assert_equal_to_upstream({"policy": stream(policy, sequences, chunk_size)}, sequences, expected)


def test_cache_budget_evicts_and_results_stay_equal(models):
    sequences, input_ids, attention_mask, action_mask = make_batch(seed=3)
    expected = upstream_outputs(models, input_ids, attention_mask, action_mask)
    tight = scorers(models, budget=40_000)  # a few hundred tokens of KV for all sequences together
    results = {role: stream(scorer, sequences, 5) for role, scorer in tight.items()}
    assert_equal_to_upstream(results, sequences, expected)
    assert all(scorer.stats["evictions"] > 0 for scorer in tight.values())
    assert all(scorer.cached_bytes() == 0 for scorer in tight.values())  # nothing left behind


def test_weights_change_mid_stream_rescored_with_new_weights(models):
    """After ``bump_version`` a sequence's cache is rebuilt: its scores are the new weights' scores."""
    critic = models["critic"]
    sequences, input_ids, attention_mask, action_mask = make_batch(seed=5, count=4)
    scorer = ChunkScorer(critic, "critic", 1 << 30)
    halves = [len(tokens) // 2 + 1 for _, tokens in sequences]
    scorer.process([Chunk(f"s{i}", 0, t[:h], p, False) for i, ((p, t), h) in enumerate(zip(sequences, halves))])

    saved = {k: v.clone() for k, v in critic.state_dict().items()}
    try:
        with torch.no_grad():
            for parameter in critic.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        scorer.bump_version()
        results = scorer.process(
            [Chunk(f"s{i}", h, t[h:], p, True) for i, ((p, t), h) in enumerate(zip(sequences, halves))]
        )
        expected = upstream_outputs(dict(models, critic=critic), input_ids, attention_mask, action_mask)
        assert_equal_to_upstream({"critic": results}, sequences, expected)
        assert all(r.version == 1 for r in results.values())
    finally:
        critic.load_state_dict(saved)


def test_missing_chunk_leaves_the_sequence_to_upstream(models):
    scorer = ChunkScorer(models["reward"], "reward", 1 << 30)
    scorer.process([Chunk("a", 0, [5, 6, 7, 8], 2, False)])
    result = scorer.process([Chunk("a", 6, [9, 10], 2, True)])  # positions 4..5 never arrived
    assert result["a"].output is None
    assert scorer.cached_bytes() == 0


def test_chunks_of_one_sequence_in_one_call_are_merged(models):
    sequences, input_ids, attention_mask, action_mask = make_batch(seed=9, count=2)
    expected = upstream_outputs(models, input_ids, attention_mask, action_mask)
    scorer = ChunkScorer(models["actor"].model, "policy", 1 << 30, temperature=TEMPERATURE)
    chunks = []
    for i, (prompt_len, tokens) in enumerate(sequences):
        cut = prompt_len + 1
        chunks += [Chunk(f"s{i}", 0, tokens[:cut], prompt_len), Chunk(f"s{i}", cut, tokens[cut:], prompt_len, True)]
    assert_equal_to_upstream({"policy": scorer.process(chunks)}, sequences, expected)
    assert scorer.stats["forwards"] == 1


class _ScoringActor(StreamingScorerMixin):
    """The scorer side of a streaming actor, without Ray or DeepSpeed."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def oppo_model(self):
        return self.model


SETTINGS = ScorerSettings(1 << 30, 1.0, max_tokens_per_forward=4096, max_cached_tokens_per_forward=4096)


def test_discarded_sequences_are_not_kept(models):
    actor = _ScoringActor(models["reward"])
    actor.oppo_setup("reward", SETTINGS)
    actor.oppo_prefill([Chunk(uid, 0, [5, 6, 7, 8], 2) for uid in ("early", "late", "kept")])

    actor.oppo_discard(["early"])  # overtakes its last chunk, still on the way
    assert actor.oppo_stats().tombstones == 1
    actor.oppo_prefill([Chunk(uid, 4, [9, 10], 2, final=True) for uid in ("early", "late", "kept")])
    stats = actor.oppo_stats()
    assert (stats.waiting, stats.tombstones) == (2, 0)  # "early" landed and was dropped

    actor.oppo_discard(["late"])  # after its last chunk: taken out of the finished ones
    stats = actor.oppo_stats()
    assert (stats.waiting, stats.tombstones, stats.cached_bytes) == (1, 0, 0)

    # After a weight update only what is kept is re-scored.
    actor.oppo_scorer.bump_version()
    final_tokens = actor.oppo_scorer.stats["final_tokens"]
    collected = actor.oppo_collect(["kept", "early", "late"])
    assert actor.oppo_scorer.stats["final_tokens"] == final_tokens + 6
    assert collected["kept"].output is not None and collected["kept"].version == 1
    assert collected["early"] is None and collected["late"] is None
    assert actor.oppo_stats().waiting == 0


def test_a_prefill_out_of_memory_turns_streaming_off(models, capsys):
    """A prefill that runs out of GPU memory does not end the run: the scorer drops what it held, prefills no later
    chunk and, after a weight update, rescores nothing, and answers None for every sequence (the experience maker
    scores those with upstream's forward, which runs as before)."""
    critic = models["critic"]
    (prompt_len, tokens), *_ = make_batch(seed=13, count=1)[0]
    hook = run_out_of_memory_at_prefill(critic, forward=2)
    try:
        actor = _ScoringActor(critic)
        actor.oppo_setup("critic", SETTINGS)
        actor.oppo_prefill([Chunk("done", 0, tokens, prompt_len, True), Chunk("on", 0, tokens[:-1], prompt_len)])
        actor.oppo_discard(["gone"])  # its last chunk is still on the way
        stats = actor.oppo_stats()
        assert (stats.forwards, stats.waiting, stats.tombstones, stats.streaming_off) == (1, 1, 1, False)
        assert stats.cached_bytes > 0

        assert actor.oppo_prefill([Chunk("on", len(tokens) - 1, tokens[-1:], prompt_len, True)]) == 1
        assert "streaming off for critic rank 0 for the rest of the run" in capsys.readouterr().out
        stats = actor.oppo_stats()
        assert (stats.waiting, stats.tombstones, stats.cached_bytes, stats.streaming_off) == (0, 0, 0, True)

        actor.oppo_prefill([Chunk("later", 0, tokens, prompt_len, True)])
        actor.oppo_scorer.bump_version()  # a fit: nothing is rescored
        assert actor.oppo_collect(["done", "on", "later"]) == dict(done=None, on=None, later=None)
        actor.oppo_discard(["gone", "later"])
        stats = actor.oppo_stats()
        assert (stats.forwards, stats.final_tokens, stats.waiting, stats.tombstones) == (1, len(tokens), 0, 0)

        _, input_ids, attention_mask, action_mask = make_batch(seed=13, count=1)
        assert critic(input_ids, action_mask, attention_mask).shape == action_mask.shape  # upstream's forward runs
    finally:
        hook.remove()
