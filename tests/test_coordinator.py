"""The coordinator turns a dead or silent actor into one error that names it and what the trainer was doing."""

import time

import pytest
import ray

from openrlhf_oppo.coordinator import OPPOActorError, StreamCoordinator
from openrlhf_oppo.protocol import ScorerSettings, StreamInfo
from openrlhf_oppo.testing.cpu_pipeline import ACTOR_CLASSES, stream_settings


class _Group:
    """What the coordinator reads of upstream's ``RayActorGroup``: its actors."""

    def __init__(self, actors):
        self._actor_handlers = actors


@ray.remote
class _SlowScorer:
    def oppo_stats(self):
        time.sleep(60)


def test_a_dead_scorer_is_named(ray_session, checkpoints, ppo_args):
    from openrlhf.utils import get_strategy

    scorer = ACTOR_CLASSES["reward"].remote(1, 0, None, None)
    ray.get(scorer.init_model_from_pretrained.remote(get_strategy(ppo_args), checkpoints["reward"]))
    coordinator = StreamCoordinator([], {"reward": _Group([scorer])})
    settings = ScorerSettings(1 << 20, 1.0, max_tokens_per_forward=64, max_cached_tokens_per_forward=64)
    coordinator.connect(settings, stream_settings(8, salt_prompts=False))
    assert coordinator.stats()["reward"][0].waiting == 0
    ray.kill(scorer)
    _wait_until_dead(scorer)
    started = time.time()
    with pytest.raises(OPPOActorError, match="reward rank 0 died while reading scorer stats"):
        coordinator.stats()
    assert time.time() - started < 10


def test_reads_at_a_steps_end_do_not_wait_behind_prefill_calls(ray_session, checkpoints, ppo_args):
    """The trainer reads every scorer's counters, memory and trace as each step ends. A scorer's own thread may
    still be busy then (the critic catches up on its held chunks after its fit): the reads are answered on
    a thread of their own, as soon as they arrive."""
    from openrlhf.utils import get_strategy

    scorer = ACTOR_CLASSES["reward"].remote(1, 0, None, None)
    ray.get(scorer.init_model_from_pretrained.remote(get_strategy(ppo_args), checkpoints["reward"]))
    coordinator = StreamCoordinator([], {"reward": _Group([scorer])}, timeout_s=30)
    settings = ScorerSettings(1 << 20, 1.0, max_tokens_per_forward=64, max_cached_tokens_per_forward=64)
    coordinator.connect(settings, stream_settings(8, salt_prompts=False))
    busy = scorer.__ray_call__.remote(lambda self: time.sleep(20))  # work queued on the scorer's own thread
    time.sleep(1.0)
    started = time.time()
    assert coordinator.stats()["reward"][0].waiting == 0
    assert coordinator.resources()["reward"][0].host_bytes > 0
    assert coordinator.drain_traces() == []
    assert time.time() - started < 10
    assert ray.wait([busy], timeout=0)[0] == []  # answered while the scorer's own thread was still busy
    ray.kill(scorer)


def _wait_until_dead(actor):
    """ray.kill returns at once; calls made before the actor is gone may still be served."""
    for _ in range(100):
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the actor did not die")


@ray.remote
class _FlushingEngine:
    """A rollout actor's side of ``flush``: its prefill calls in flight, each with the scorer it went to."""

    def oppo_flush(self, uids):
        return [("reward rank 0", self.victim.__ray_call__.remote(lambda self: time.sleep(60)))]

    def aim_at(self, victim):
        self.victim = victim


def test_a_scorer_that_dies_under_a_prefill_call_is_named(ray_session):
    """The last chunks' prefill calls go from the rollout actors to the scorers; the trainer waits on them."""
    victim, engine = _SlowScorer.remote(), _FlushingEngine.remote()
    ray.get(engine.aim_at.remote(victim))
    coordinator = StreamCoordinator([engine], {"reward": _Group([victim])}, timeout_s=30)
    ray.kill(victim)
    _wait_until_dead(victim)
    expected = r"reward rank 0 \(a prefill call from rollout engine 0\) died while waiting for the last chunks"
    with pytest.raises(OPPOActorError, match=expected):
        coordinator.flush([StreamInfo("s0", 3, ranks={"reward": 0})])


def test_a_silent_actor_is_named_after_the_timeout(ray_session):
    slow = _SlowScorer.remote()
    coordinator = StreamCoordinator([], {"critic": _Group([slow])}, timeout_s=2)
    started = time.time()
    with pytest.raises(OPPOActorError, match=r"critic rank 0 did not answer within 2 s while reading scorer stats"):
        coordinator.stats()
    assert time.time() - started < 10
    ray.kill(slow)


@ray.remote
class _Caller:
    """Waits on another actor, as the trainer waits on the engines and models."""

    def wait_on(self, actor):
        return ray.get(actor.__ray_call__.remote(lambda self: time.sleep(60)))


def test_the_cli_names_an_actor_that_died_under_the_trainer(ray_session):
    from openrlhf_oppo.cli.train_ppo_ray import failure_line

    victim, caller = _SlowScorer.remote(), _Caller.remote()
    waiting = caller.wait_on.remote(victim)
    ray.get(victim.__ray_ready__.remote())
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(waiting, timeout=30)
    line = failure_line(raised.value)
    assert line.startswith("_SlowScorer died while _Caller.wait_on waited on it: The actor is dead"), line
    assert "\n" not in line
    assert failure_line(ValueError("not an actor's death")) is None
    ray.kill(caller)


@ray.remote
class _BrokenScorer:
    def oppo_stats(self):
        raise MemoryError("CUDA out of memory (a stand-in for a scorer's own failure)")


def test_a_call_that_raises_is_named_with_its_error(ray_session):
    broken = _BrokenScorer.remote()
    coordinator = StreamCoordinator([], {"policy": _Group([broken])})
    with pytest.raises(
        OPPOActorError, match=r"policy rank 0 failed while reading scorer stats: MemoryError: CUDA out"
    ):
        coordinator.stats()
    ray.kill(broken)


def test_every_model_reports_its_memory_streamed_or_not(ray_session, checkpoints, ppo_args):
    """A run that streams to no model (the hybrid engine, where the scorers' caches do not fit) still reads each
    model's memory by phase every step: the coordinator asks every model, not only the streamed ones."""
    from openrlhf.utils import get_strategy

    scorer = ACTOR_CLASSES["reward"].remote(1, 0, None, None)
    ray.get(scorer.init_model_from_pretrained.remote(get_strategy(ppo_args), checkpoints["reward"]))
    coordinator = StreamCoordinator([], {}, every_model={"reward": _Group([scorer]), "critic": None})
    assert coordinator.roles == ()
    (reading,) = coordinator.resources()["reward"]
    assert reading.host_bytes > 0 and reading.phase_peaks == {}  # no CUDA here: no phase recorded
    ray.kill(scorer)
