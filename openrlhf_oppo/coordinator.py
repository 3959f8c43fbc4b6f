"""The trainer's side of OPPO's protocol with the rollout and scoring actors.

``StreamCoordinator`` makes every remote ``oppo_*`` call: the samples generators, the experience maker and
the trainer ask it, and nothing else in the trainer process talks to those actors about streaming. It holds
the one map from roles to scoring actors, and turns a dead or silent actor into one ``OPPOActorError``
that says which actor and what the trainer was doing.

Its calls follow a step's phases as ``OPPOTrainer.train_step`` runs them, each phase a method of the trainer:

* ``connect`` once, after the models are loaded (``OPPOTrainer.fit``): scorers built, rollout actors told where
  to stream. With ``--oppo.policy_logprobs vllm`` the engines score the policy's log-probs themselves: for that
  role the rollout actors stand where its ranks would (rank i is engine i) and answer ``collect``, ``discard``
  and ``stats``.
* Generation (upstream's ``fit``, before ``train_step``): the rollout actors stream chunks straight to the
  scorers (``oppo_prefill``), with no trainer call.
* ``_end_generation`` (inter-step overlap): ``hold``: the chunks of the roles whose GPUs train only queue, until
  ``release``; engines awake on the models' GPUs ``pause``.
* ``_discard_dropped``: ``discard`` the sequences training will not see.
* ``_make_experience``: ``flush`` + ``collect`` (the experience maker's): the batch's queued chunks sent, every
  prefill awaited, the scores fetched from the rank that holds each sequence.
* ``_train``: ``unpause`` (``--oppo.colocated_decode during_training``); the critic's ``catch_up`` once its fit
  returns (``--oppo.critic_catch_up after_fit`` or ``next_batch``, which sends only the next batch's chunks and
  keeps the others held until their batch).
* ``_sync_weights_and_release``: ``sync_weights``, with ``pause`` / ``resume`` around it when requests outlive
  the step (paused only to load the new weights when they were staged while the engines decoded);
  ``release_engine_scoring``; ``release``: the chunks held through training go out.
* The step's metrics and trace: ``stats``, ``resources``, ``set_chunk_size``, ``drain_traces``.
"""

import time
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from openrlhf_oppo import actor_errors
from openrlhf_oppo.protocol import (
    ROLES,
    ResourceReading,
    ScoredSequence,
    ScorerSettings,
    ScorerStats,
    StreamInfo,
    StreamSettings,
)


class OPPOActorError(RuntimeError):
    """A rollout or scoring actor died or stopped answering; the message names it and the phase."""


@contextmanager
def phase(what: str):
    """Name the actor that dies while the trainer is ``what`` (training, the weight sync, ...): Ray's own
    error names the call that found it, deep inside upstream's code."""
    try:
        yield
    except RayActorError as error:
        raise OPPOActorError(f"{dead_actor(error)} died while {what}: {_first_line(error)}") from None


def dead_actor(error: BaseException) -> str:
    """The class of the actor a Ray error says died (or failed in ``__init__``)."""
    return actor_errors.actor_class(error)


class StreamCoordinator:
    """Every remote call from the trainer to the rollout actors (``engines``) and scoring actors.

    Args:
        engines: the rollout actors (upstream's vLLM engine handles).
        groups: role -> upstream ``RayActorGroup`` of the models that score streamed chunks (the roles
            that stream; others are left out).
        timeout_s: the longest any call may take before the run stops with an error naming the actor.
        beside_vllm: the roles whose ranks sit on the engines' GPUs (``--oppo.frozen_scorers_on generation``):
            training does not hold their chunks.
        scored_by_engines: the roles the engines score themselves (``--oppo.policy_logprobs vllm``: the policy).
        every_model: role -> group of every model of the run, streamed or not (None where a role has no
            group): each reports its memory by phase (``resources``). Default: ``groups``.
    """

    def __init__(
        self,
        engines: Sequence,
        groups: Dict[str, object],
        timeout_s: float = 900.0,
        beside_vllm: Sequence[str] = (),
        scored_by_engines: Sequence[str] = (),
        every_model: Optional[Dict[str, object]] = None,
    ):
        unknown = set(groups) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; roles are {ROLES}")
        self.engines = list(engines or [])
        self.groups = dict(groups)
        # RayActorGroup exposes no accessor for its actors: this is the one place that reads them.
        self.models = {role: list(group._actor_handlers) for role, group in self.groups.items()}  # noqa: SLF001
        # Every model's ranks, streamed or not: each reports its memory (``resources``).
        self.every_model = {
            role: list(group._actor_handlers)  # noqa: SLF001
            for role, group in (every_model if every_model is not None else groups).items()
            if group is not None
        }
        self.scored_by_engines = tuple(role for role in scored_by_engines if role in self.groups)
        # Where each role's scores live: its model's ranks, or the engines.
        self.scorers = {
            role: self.engines if role in self.scored_by_engines else actors for role, actors in self.models.items()
        }
        self.timeout_s = timeout_s
        self.beside_vllm = tuple(beside_vllm)
        self.held: List[str] = []  # the roles whose chunks queue (``hold``)
        self.kept_held: Set[str] = set()  # held roles that a ``release`` of all roles leaves held (``catch_up``)
        self.paused_at = time.time()
        self.tokenizer_sent = False

    @property
    def roles(self) -> Tuple[str, ...]:
        return tuple(self.scorers)

    # -- set-up --------------------------------------------------------------------------------------

    def connect(
        self,
        scorer: ScorerSettings,
        stream: StreamSettings,
        affinity: Optional[Dict[str, List[int]]] = None,
    ) -> None:
        """Build each scoring actor's scorer, then tell every rollout actor where and how to stream.

        ``affinity``: role -> for each engine, the rank it sends that role's chunks to (a frozen scorer
        sharing the engine's GPU, say). Roles left out are balanced over their ranks by each engine.
        """
        streamed = self._scoring_actors()
        self._wait(
            [(f"{role} rank {rank}", actor.oppo_setup.remote(role, scorer))
             for role, actors in streamed.items() for rank, actor in enumerate(actors)],
            "setting up the scorers",
        )  # fmt: skip
        calls = []
        for index, engine in enumerate(self.engines):
            pinned = {role: ranks[index % len(ranks)] for role, ranks in (affinity or {}).items() if role in streamed}
            connect = engine.oppo_connect.remote(
                streamed,
                pinned,
                stream,
                engine_index=index,
                score_policy="policy" in self.scored_by_engines,
            )
            calls.append((f"rollout engine {index}", connect))
        self._wait(calls, "connecting the rollout actors")

    def disconnect(self) -> None:
        """Stop streaming: samples started from now on are scored the upstream way."""
        self._each_engine("oppo_disconnect", "disconnecting the rollout actors")

    def send_tokenizer(self, tokenizer) -> None:
        """Give each rollout actor the tokenizer once, rather than with every call (upstream's way)."""
        if not self.tokenizer_sent:
            self._each_engine("oppo_set_tokenizer", "sending the tokenizer", tokenizer)
            self.tokenizer_sent = True

    def set_streaming(self, enabled: bool) -> None:
        """Stream the samples started from now on, or not (evaluation samples are not streamed)."""
        self._each_engine("oppo_set_streaming", "switching streaming", enabled)

    def set_chunk_size(self, chunk_size: int) -> None:
        self._each_engine("oppo_set_chunk_size", "setting the chunk size", chunk_size)

    # -- the step ------------------------------------------------------------------------------------

    def hold(self) -> None:
        """Queue chunks instead of sending them, until ``release``, for the roles whose GPUs are about to train
        (the frozen models beside vLLM keep scoring)."""
        self.held = [role for role in self.roles if role not in self.beside_vllm]
        self.kept_held = set()
        self._each_engine("oppo_hold", "holding the chunks", self.held)

    def release(self, roles: Optional[Sequence[str]] = None) -> None:
        """Send the held chunks of ``roles`` (all but those ``catch_up`` kept held if None), whose models have
        their new weights."""
        released = [role for role in self.held if role not in self.kept_held] if roles is None else roles
        self.held = [role for role in self.held if role not in released]
        self._each_engine("oppo_hold", "releasing the held chunks", self.held)

    def catch_up(self, role: str, infos: Optional[Iterable[StreamInfo]]) -> None:
        """``role``'s model has its new weights. Send its held chunks of these sequences (the next batch's) and keep
        its other chunks held, through the next ``release`` too, until a ``flush`` or a later ``catch_up`` sends
        them with their batch: a trainable model prefills a sequence again after each update of its weights, so
        the chunks of sequences that a later step trains would be prefilled for nothing now. With no ``infos``
        (the next batch is not known yet), release all of them."""
        if infos is None:
            self.release([role])
            return
        uids = [info.uid for info in infos if info.ranks]
        self._each_engine("oppo_flush", "sending the next batch's held chunks", uids, roles=[role])
        self.kept_held.add(role)

    def release_engine_scoring(self, next_batch: Optional[Sequence[StreamInfo]] = None) -> None:
        """``catch_up`` the held roles that the engines score (the policy's log-probs), whose weights are the
        engines' own: they have them as soon as the weight sync ends. Given the next batch, the engines score its
        sequences only: each weight sync makes them score a finished sequence again, so the others (those a later
        step trains) would be scored for nothing now."""
        for role in [role for role in self.scored_by_engines if role in self.held]:
            self.catch_up(role, next_batch)

    def pause(self, clear_cache: bool) -> None:
        """Freeze every request in every engine; ``clear_cache`` drops their KV (re-prefilled on resume)."""
        self._each_engine("oppo_pause", "pausing generation", clear_cache=clear_cache)
        self.paused_at = time.time()

    def unpause(self) -> float:
        """Restart the requests that ``pause`` froze, at the weights they had; returns how long they waited."""
        self._each_engine("oppo_unpause", "restarting generation")
        return time.time() - self.paused_at

    def resume(self, weight_version: int, resume: bool = True) -> None:
        """Tell the engines the new weight version; ``resume`` restarts paused requests."""
        self._each_engine("oppo_resume", "resuming generation", weight_version=weight_version, resume=resume)

    def sync_weights(self, send_weights, staged: bool, pause: bool, clear_cache: bool, weight_version: int) -> dict:
        """One weight sync around ``send_weights`` (every policy rank's ``broadcast_to_vllm``, see
        ``weight_sync.py``), with requests in flight when ``pause``: the engines are paused for the whole sync,
        or, ``staged``, receive every bucket while they decode and pause only to load it. Every engine learns
        ``weight_version``. Returns how long the sync took and how long the engines were paused."""
        staged = staged and pause
        start = paused_at = time.time()
        if pause and not staged:
            self.pause(clear_cache)
        try:
            send_weights()
            if staged:
                paused_at = time.time()
                self.pause(clear_cache)
                self._each_engine("oppo_load_staged", "loading the new weights")
        except BaseException:
            if staged:
                self._each_engine("oppo_drop_staged", "dropping the staged weights")
            raise
        finally:
            # A sleeping engine resumes when it wakes up; it only learns the version here.
            self.resume(weight_version, resume=pause)
        end = time.time()
        return {"oppo/weight_sync_s": end - start, "oppo/weight_sync_pause_s": end - paused_at if pause else 0.0}

    def flush(self, infos: Iterable[StreamInfo]) -> None:
        """Send the queued chunks of these sequences now and wait until every prefill call has landed."""
        uids = [info.uid for info in infos if info.ranks]
        calls = self._each_engine("oppo_flush", "flushing the chunks", uids)
        pending = [
            (f"{scorer} (a prefill call from rollout engine {i})", ref)
            for i, refs in enumerate(calls)
            for scorer, ref in refs
        ]
        self._wait(pending, "waiting for the last chunks' prefill")

    def collect(self, infos: Sequence[Optional[StreamInfo]]) -> Dict[str, Dict[str, Optional[ScoredSequence]]]:
        """Per streamed role, the finished sequences' scores by uid, from the rank that holds each (None
        where it has none). A scorer rescores what it finished under older weights before it answers, so
        every score returned was computed with the role's current weights."""
        calls = [
            (role, rank, self.scorers[role][rank].oppo_collect.remote(uids))
            for role in self.roles
            for rank, uids in _uids_by_rank(role, infos).items()
        ]
        results = self._wait([(f"{role} rank {rank}", ref) for role, rank, ref in calls], "collecting the scores")
        collected = {role: {} for role in self.roles}
        for (role, _, _), scores in zip(calls, results):
            collected[role].update(scores)
        return collected

    def discard(self, infos: Sequence[StreamInfo]) -> None:
        """Forget the scores of sequences training will never ask for (dropped or replaced samples)."""
        calls = [
            (f"{role} rank {rank}", self.scorers[role][rank].oppo_discard.remote(uids))
            for role in self.roles
            for rank, uids in _uids_by_rank(role, infos).items()
        ]
        self._wait(calls, "discarding dropped sequences")

    def stats(self) -> Dict[str, List[ScorerStats]]:
        """Each scoring actor's counters, per role and rank (its prefill calls since the last ``stats``); for a
        role the engines score, each engine's."""
        return self._ask_each("oppo_stats", "reading scorer stats", self.scorers, engines=False)

    def resources(self) -> Dict[str, List[ResourceReading]]:
        """The memory each rollout actor (``rollout``) and each model's rank (by role) holds, and the CPU time
        it has used."""
        return self._ask_each("oppo_resources", "reading memory and CPU time", self.every_model, engines=True)

    def drain_traces(self) -> list:
        answers = self._ask_each("oppo_drain_trace", "collecting traces", self._scoring_actors(), engines=True)
        return [event for per_actor in answers.values() for events in per_actor for event in events]

    def forward(self, role: str, kwargs: dict) -> List[ray.ObjectRef]:
        """Upstream's ``forward`` over these micro-batches, spread over the role's ranks even when there are
        fewer micro-batches than ranks (upstream's ``async_run_method_batch`` refuses that)."""
        group, actors = self.groups[role], self.models[role]
        count = len(next(iter(kwargs.values())))
        if count >= len(actors):
            return group.async_run_method_batch(method_name="forward", **kwargs)
        return [
            actors[i].execute_batch.remote("forward", ray.put({k: v[i : i + 1] for k, v in kwargs.items()}), 0, 1)
            for i in range(count)
        ]

    # -- calls -----------------------------------------------------------------------------------------

    def _scoring_actors(self) -> Dict[str, list]:
        """The model ranks that score streamed chunks, by role (not those of roles the engines score)."""
        return {role: actors for role, actors in self.models.items() if role not in self.scored_by_engines}

    def _ask_each(self, method: str, doing: str, actors: Dict[str, list], engines: bool) -> Dict[str, list]:
        """``method``'s answer from each of ``actors`` (role -> handles), by role in rank order, and with
        ``engines`` from every rollout actor, under ``rollout`` (first)."""
        calls = []
        if engines:
            calls += [
                ("rollout", f"rollout engine {i}", getattr(e, method).remote()) for i, e in enumerate(self.engines)
            ]
        calls += [
            (role, f"{role} rank {rank}", getattr(actor, method).remote())
            for role, handles in actors.items()
            for rank, actor in enumerate(handles)
        ]
        answers = {}
        for (kind, _, _), answer in zip(calls, self._wait([(name, ref) for _, name, ref in calls], doing)):
            answers.setdefault(kind, []).append(answer)
        return answers

    def _each_engine(self, method: str, doing: str, *args, **kwargs) -> list:
        calls = [
            (f"rollout engine {i}", getattr(e, method).remote(*args, **kwargs)) for i, e in enumerate(self.engines)
        ]
        return self._wait(calls, doing)

    def _wait(self, calls: List[Tuple[str, ray.ObjectRef]], doing: str) -> list:
        """The calls' results, in order. An actor that died, a call that raised, or calls that outlast the
        timeout (Ray itself would wait forever on a hung actor) end in one ``OPPOActorError`` that says what
        they were ``doing`` ("flushing the chunks")."""
        refs = [ref for _, ref in calls]
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            silent = [name for name, ref in calls if ref not in ready]
            raise OPPOActorError(
                f"{', '.join(silent[:3])} did not answer within {self.timeout_s:g} s while {doing} "
                "(--oppo.call_timeout_s)"
            ) from None
        except RayActorError as error:
            raise OPPOActorError(f"{_failed_call(calls)} died while {doing}: {_first_line(error)}") from None
        except RayTaskError as error:  # the call raised: keep its traceback for the log
            raise OPPOActorError(f"{_failed_call(calls)} failed while {doing}: {_first_line(error)}") from error


def _uids_by_rank(role: str, infos: Iterable[Optional[StreamInfo]]) -> Dict[int, List[str]]:
    """The uids of the sequences streamed to ``role``, by the rank that holds their scores."""
    by_rank: Dict[int, List[str]] = {}
    for info in infos:
        if info is not None and role in info.ranks:
            by_rank.setdefault(info.ranks[role], []).append(info.uid)
    return by_rank


def _failed_call(calls) -> str:
    """The name of the first call that raised."""
    for name, ref in calls:
        try:
            ray.get(ref, timeout=1.0)
        except (RayActorError, RayTaskError):
            return name
        except GetTimeoutError:
            continue
    return "an actor"


def _first_line(error: Exception) -> str:
    """The error's own message: for a call that raised, its exception's (Ray's wrapper starts with the call); for
    an actor that failed in ``__init__``, the exception raised there."""
    return actor_errors.exception_line(error)
