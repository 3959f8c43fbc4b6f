"""A small discrete-event simulation of the PPO step of OpenRLHF's sync and async trainers and of OPPO.

Requests decode on vLLM engines: an engine's iteration advances each request it runs by one token and takes
``decode_s + decode_per_request_s * running``. The scorers' prefill is work queued on the GPUs they run on (the
models' GPUs, or the engines' beside decoding); make_experience runs upstream's forward of the models that did not
stream, then training and the weight sync hold the models' GPUs. The systems differ in the order of these and in
what decodes when:

* sync: generate the batch, make its experiences, train, sync;
* async (``--train.async_enable --train.partial_rollout_enable``): the next batch decodes while this one trains,
  the engines pausing for the weight sync;
* OPPO: B + Delta groups in flight, the step ends when B are done (a group carried ``max_defer_steps`` times is
  waited for), the scorers prefill while the engines decode and what was held through training once the models'
  GPUs are free, carried groups decode through training where the engines have GPUs of their own.

Two things on one GPU: a scorer first takes the time decoding leaves idle (``1 - decode_busy``, the share of
decoding time the GPU runs no kernel); once its work backs up, and for decoding beside training, the two take the
GPU in turns, each at ``1 / (sum of their busy shares)`` of its speed.
"""

import heapq
import math
import random
from dataclasses import dataclass, field, replace
from typing import List, Optional

from openrlhf_oppo.overcommit.controller import ThroughputController
from openrlhf_oppo.plan import OFF, Plan

# The share of training after which the critic's fit ends (the two train side by side, or the critic first under
# the hybrid engine): an assumption, as the logs time the two only together.
CRITIC_FIT_SHARE = 0.5
EPS = 1e-9
MIN_INTERVAL_S = 0.005  # the shortest simulated interval while a scorer's queue drains


@dataclass
class Costs:
    """Seconds, per step, per call or per token on one GPU."""

    decode_s: float  # an engine iteration with one running request
    decode_per_request_s: float  # added to an iteration per running request
    dispatch_s: float  # upstream's generation phase besides decoding (dispatch, wake-up), per step
    oppo_dispatch_s: float  # the same for OPPO's samples generator, which sends the tokenizer once
    forward_s: float  # one model's forward pass per (padded) token, with its share of make_experience
    call_s: float  # of that, the fixed cost of one forward call of one model
    train_s: float  # training, per step
    train_per_token_s: float  # training, per padded token of one trained model
    sync_s: float  # the weight sync
    other_s: float = 0.0  # the rest of a step (metrics, logging)
    decode_busy: float = 0.8  # share of decoding time the GPU runs kernels
    train_busy: float = 0.9  # the same in training


@dataclass
class Setup:
    """What every system of a comparison shares: placement, batch and the models."""

    engines: int
    model_gpus: int
    colocated: bool = False  # vLLM on the models' GPUs (--train.colocate_all)
    vllm_sleep: bool = False  # the engines sleep outside generation (--vllm.enable_sleep)
    batch: int = 32  # prompt groups a step (--rollout.batch_size)
    n_samples: int = 1
    prompt_tokens: int = 64
    rollout_micro_batch: int = 8
    train_micro_batch: int = 2
    roles: tuple = ("policy", "critic", "reward", "reference")  # the models make_experience scores with
    trained: tuple = ("policy", "critic")


def engine_scored_roles(plan: Plan) -> tuple:
    """The streamed roles scored on the engines' GPUs: the frozen models beside vLLM, and the policy whose
    log-probs vLLM computes (``--oppo.policy_logprobs vllm``)."""
    streamed = plan.stream.roles
    on_engines = tuple(r for r in streamed if r in plan.topology.frozen_beside_engines)
    if plan.stream.policy_logprobs == "vllm" and "policy" in streamed:
        on_engines += ("policy",)
    return on_engines


def with_delta(plan: Plan, delta: int) -> Plan:
    """The plan with Delta fixed at ``delta`` (no controller)."""
    return replace(
        plan, carry=replace(plan.carry, overcommit=replace(plan.carry.overcommit, initial=delta, auto=False))
    )


class Engine:
    """One vLLM engine: each iteration advances every running request by one token, so a request's progress is
    the engine's iterations since the request joined it."""

    def __init__(self):
        self.iterations = 0.0
        self.finishing = []  # (iteration at which it finishes, order, request), a heap
        self.running = 0
        self.stall = 0.0  # seconds it re-prefills before it decodes on
        self.joined = 0

    def add(self, request: "Request") -> None:
        request.engine, request.start = self, self.iterations
        heapq.heappush(self.finishing, (self.iterations + request.length, self.joined, request))
        self.joined += 1
        self.running += 1

    def next_finish(self) -> float:
        """Iterations until its next request finishes."""
        return self.finishing[0][0] - self.iterations


@dataclass(eq=False)
class Request:
    group: "Group"
    length: int
    engine: Optional[Engine] = None
    start: float = 0.0
    done: bool = False
    sent: dict = field(default_factory=dict)  # role: tokens its scorer holds (while the role is held)
    stale: dict = field(default_factory=dict)  # role: what its scorer holds is from older weights

    @property
    def decoded(self) -> float:
        if self.done:
            return float(self.length)
        if self.engine is None:
            return 0.0
        return min(float(self.length), self.engine.iterations - self.start)


@dataclass(eq=False)
class Group:
    index: int
    requests: List[Request]
    deferrals: int = 0
    announced: bool = False  # named as the next batch (its scores are prepared before the step takes it)
    left: int = 0  # requests not done

    @property
    def done(self) -> bool:
        return self.left == 0


@dataclass
class Step:
    wall_s: float
    generation_s: float  # the generation phase: until the step's samples are done
    experience_s: float
    train_s: float
    sync_s: float
    models_busy_s: float = 0.0  # the models' GPUs making experiences, scoring, training and syncing
    engines_busy_s: float = 0.0  # the engines decoding
    busy_s: float = 0.0  # any of them (one set of GPUs where vLLM shares the models')
    trained_tokens: float = 0.0
    lag: float = 0.0  # mean weight updates between a trained group's dispatch and its training
    delta: int = 0

    @property
    def bound_s(self) -> float:
        """No step is shorter than its busiest set of GPUs is busy (one set where vLLM shares the models')."""
        return max(self.models_busy_s, self.engines_busy_s, self.busy_s)


def padded_tokens(lengths: List[int], micro: int, ranks: int, shuffled: bool) -> float:
    """Tokens a forward or training pass computes on its busiest rank: micro-batches pad to their longest
    sequence. The batch is split into ``ranks`` contiguous parts; training shuffles it (the mean of a few
    seeded shuffles)."""

    def busiest(order):
        share = math.ceil(len(order) / ranks)
        parts = [order[i : i + share] for i in range(0, len(order), share)]
        return max(sum(max(p[i : i + micro]) * len(p[i : i + micro]) for i in range(0, len(p), micro)) for p in parts)

    if not shuffled:
        return busiest(lengths)
    rng = random.Random(0)
    draws = []
    for _ in range(8):
        order = lengths[:]
        rng.shuffle(order)
        draws.append(busiest(order))
    return sum(draws) / len(draws)


class Queue:
    """Prefill work (GPU-seconds) waiting for a set of GPUs, served first in first out."""

    def __init__(self):
        self.work = 0.0
        self.capacity = 0.0  # GPU-seconds served per second

    def serve(self, seconds: float) -> float:
        served = min(self.work, self.capacity * seconds)
        self.work -= served
        return served

    def drain_s(self) -> float:
        return self.work / self.capacity if self.work > EPS and self.capacity > 0 else 0.0


class Cluster:
    """The engines with their requests, the models' GPUs and the scorers' queues, on one clock."""

    def __init__(self, costs: Costs, setup: Setup, plan: Plan = OFF):
        self.costs, self.setup, self.plan = costs, setup, plan
        self.on_engines = engine_scored_roles(plan)
        self.now = 0.0
        self.engines = [Engine() for _ in range(setup.engines)]
        self.rate = 1.0  # decoding's speed: 1 alone on its GPUs, 0 paused or asleep
        self.slow = 1.0  # decoding's speed while it takes the GPU in turns with a scorer
        self.in_phase = False  # the models' GPUs make experiences, train or sync (the scorers wait)
        self.models = Queue()
        self.beside_engines = Queue()
        self.released = set()  # roles whose tokens go to their scorer as they are decoded
        self.groups_done = 0
        self.on_group_done = None  # called with each group whose requests are all done
        self.models_busy = self.engines_busy = self.busy_any = 0.0

    # -- where the scorers' work goes ----------------------------------------------------------------

    def queue_of(self, role: str) -> Queue:
        return self.beside_engines if role in self.on_engines else self.models

    def streams_tokens(self, role: str) -> bool:
        """Whether ``role``'s scorer gets each request's tokens as they come (the policy scored by vLLM gets
        whole sequences)."""
        return role in self.released and not (role == "policy" and role in self.on_engines)

    def send(self, request: Request, role: str) -> None:
        """Hand ``role``'s scorer what it lacks of ``request``: all of it where its cache is stale."""
        whole = self.setup.prompt_tokens + request.decoded
        if role == "policy" and role in self.on_engines and not request.done:
            return  # vLLM scores a sequence's prompt log-probs once it is whole
        has = whole if self.streams_tokens(role) else request.sent.get(role, 0.0)
        tokens = whole if request.stale.get(role) else whole - has
        request.sent[role], request.stale[role] = whole, False
        self.queue_of(role).work += tokens * self.costs.forward_s

    def release(self, role: str, requests: List[Request]) -> None:
        for request in requests:
            self.send(request, role)
        self.released.add(role)

    def hold(self, role: str, requests: List[Request]) -> None:
        if role in self.released:
            for request in requests:
                request.sent[role] = self.setup.prompt_tokens + request.decoded
            self.released.discard(role)

    def new_weights(self, role: str, requests: List[Request]) -> None:
        """What ``role``'s scorer holds is stale; where it streams, the next token's chunk brings it all again."""
        for request in requests:
            request.stale[role] = True
            if self.streams_tokens(role):
                self.send(request, role)

    # -- decoding -------------------------------------------------------------------------------------

    def dispatch(self, group: Group) -> None:
        """Upstream's samples generator sends each prompt to the engine with the fewest pending requests."""
        engine = min(self.engines, key=lambda e: e.running)
        group.left = len(group.requests)
        for request in group.requests:
            engine.add(request)
            for role in self.plan.stream.roles:
                request.sent[role] = 0.0
                if self.streams_tokens(role):
                    self.queue_of(role).work += self.setup.prompt_tokens * self.costs.forward_s

    def iteration_s(self, engine: Engine) -> float:
        return self.costs.decode_s + self.costs.decode_per_request_s * engine.running

    def capacities(self) -> None:
        """Each queue's capacity and decoding's speed beside it (the module's docstring)."""
        idle, turns = 1.0 - self.costs.decode_busy, 1.0 / (1.0 + self.costs.decode_busy)
        decoding = sum(bool(e.running) for e in self.engines) if self.rate > 0 else 0
        free = self.setup.engines - decoding
        shared = [self.beside_engines]
        if self.in_phase:
            self.models.capacity = 0.0
        elif self.setup.colocated:
            shared.append(self.models)
        else:
            self.models.capacity = self.setup.model_gpus
        self.slow = 1.0
        for queue in shared:
            backed_up = queue.work > EPS
            queue.capacity = decoding * (turns if backed_up else idle) + free
            if backed_up and decoding:
                self.slow = turns

    def run(self, seconds: float = math.inf, stop=None) -> None:
        """Decode for ``seconds``, or until ``stop()`` holds after a request finishes."""
        end = self.now + seconds
        while self.now < end - EPS:
            self.capacities()
            dt = end - self.now
            speed = self.rate * self.slow
            if speed > 0:
                for e in self.engines:
                    if e.running:
                        dt = min(dt, e.stall + e.next_finish() * self.iteration_s(e) / speed)
            if self.slow < 1.0:  # decoding speeds up once the queue it shares a GPU with drains
                for queue in (self.models, self.beside_engines):
                    if queue.work > EPS:
                        dt = min(dt, max(queue.drain_s(), MIN_INTERVAL_S))
            if math.isinf(dt):
                return  # nothing decodes and nothing bounds the wait
            self.advance(dt, speed)
            if self.collect_finished() and stop is not None and stop():
                return

    def advance(self, dt: float, speed: float) -> None:
        decoding = speed > 0 and any(e.running for e in self.engines)
        streaming = [r for r in self.plan.stream.roles if self.streams_tokens(r)]
        for e in self.engines:
            if not e.running or speed <= 0:
                continue
            decode_s = dt - min(dt, e.stall)
            e.stall -= dt - decode_s
            tokens = decode_s * speed / self.iteration_s(e)
            e.iterations += tokens
            for role in streaming:
                self.queue_of(role).work += tokens * e.running * self.costs.forward_s
        scored = self.models.serve(dt) / self.setup.model_gpus
        self.beside_engines.serve(dt)
        self.engines_busy += dt if decoding else 0.0
        self.models_busy += dt if self.in_phase else scored
        self.busy_any += dt if (decoding or self.in_phase or scored) else 0.0
        self.now += dt

    def collect_finished(self) -> bool:
        any_done = False
        for e in self.engines:
            while e.finishing and e.finishing[0][0] <= e.iterations + EPS:
                request = heapq.heappop(e.finishing)[2]
                e.running -= 1
                request.done = any_done = True
                request.group.left -= 1
                if request.group.done:
                    self.groups_done += 1
                    if self.on_group_done:
                        self.on_group_done(request.group)
                if "policy" in self.on_engines and "policy" in self.released:
                    self.send(request, "policy")
        return any_done

    def idle(self, seconds: float, rate: float = 0.0) -> None:
        """Time that holds no GPU of the models (dispatch, logging), the engines decoding at ``rate``."""
        self.rate = rate
        self.run(seconds)

    def busy(self, seconds: float, beside: str, share: float = 1.0) -> None:
        """A phase of the models' GPUs that takes ``seconds`` alone, with the engines ``beside`` it: ``"apart"``
        (GPUs of their own: they decode on), ``"paused"``, or ``"shared"`` (the same GPUs: the two take turns once
        their busy shares, ``share`` and ``decode_busy``, add up past 1)."""
        self.in_phase = True
        if beside != "shared":
            self.rate = 1.0 if beside == "apart" else 0.0
            self.run(seconds)
        else:
            left, turns = seconds, min(1.0, 1.0 / (share + self.costs.decode_busy))
            while left > EPS:
                self.rate = turns if any(e.running for e in self.engines) else 1.0
                before = self.now
                self.run(left / self.rate, stop=lambda: not any(e.running for e in self.engines))
                left -= (self.now - before) * self.rate
        self.in_phase = False

    def recompute(self, requests: List[Request]) -> None:
        """Carried requests whose KV was dropped (``--oppo.carry_kv recompute``, or the engines' sleep) are
        prefilled again by their engine before it decodes on."""
        for r in requests:
            if not r.done:
                r.engine.stall += (self.setup.prompt_tokens + r.decoded) * self.costs.forward_s

    def counters(self) -> tuple:
        return self.now, self.models_busy, self.engines_busy, self.busy_any

    def step_since(self, before: tuple, **phases) -> Step:
        now, models, engines, any_ = self.counters()
        busy = any_ - before[3] if self.setup.colocated else 0.0
        return Step(
            now - before[0],
            models_busy_s=models - before[1],
            engines_busy_s=engines - before[2],
            busy_s=busy,
            **phases
        )


# -- the systems ------------------------------------------------------------------------------------------


def groups_of(lengths: List[int], setup: Setup):
    """Prompt groups in dispatch order, ``n_samples`` requests each, from the responses' lengths."""
    n = setup.n_samples
    for index in range(len(lengths) // n):
        group = Group(index, [])
        group.requests = [Request(group, max(1, int(length))) for length in lengths[index * n : (index + 1) * n]]
        yield group


def next_batch(source, size: int) -> Optional[List[Group]]:
    batch = [g for _, g in zip(range(size), source)]
    return batch if len(batch) == size else None


def wait_for(cluster: Cluster, groups: List[Group]) -> None:
    """Decode until every one of ``groups`` is done."""
    target = cluster.groups_done + sum(not g.done for g in groups)
    if cluster.groups_done < target:
        cluster.run(stop=lambda: cluster.groups_done >= target)


def sequence_lengths(groups: List[Group], setup: Setup) -> List[int]:
    return [setup.prompt_tokens + r.length for g in groups for r in g.requests]


def experience_s(costs: Costs, setup: Setup, groups: List[Group], roles) -> float:
    """make_experience: upstream's forward of each of ``roles`` over the batch in micro-batches."""
    tokens = padded_tokens(sequence_lengths(groups, setup), setup.rollout_micro_batch, setup.model_gpus, False)
    return len(roles) * costs.forward_s * tokens


def train_s(costs: Costs, setup: Setup, groups: List[Group]) -> float:
    tokens = padded_tokens(sequence_lengths(groups, setup), setup.train_micro_batch, setup.model_gpus, True)
    return costs.train_s + len(setup.trained) * costs.train_per_token_s * tokens


def tokens_of(groups: List[Group]) -> float:
    return sum(r.length for g in groups for r in g.requests)


def simulate_sync(costs: Costs, setup: Setup, lengths: List[int], steps: int) -> List[Step]:
    cluster, source, out = Cluster(costs, setup), groups_of(lengths, setup), []
    for _ in range(steps):
        batch = next_batch(source, setup.batch)
        if batch is None:
            break
        before = cluster.counters()
        cluster.idle(costs.dispatch_s)
        for group in batch:
            cluster.dispatch(group)
        cluster.rate = 1.0
        wait_for(cluster, batch)
        generation = cluster.now - before[0]
        make, train = experience_s(costs, setup, batch, setup.roles), train_s(costs, setup, batch)
        for seconds in (make, train, costs.sync_s):
            cluster.busy(seconds, "paused")
        cluster.idle(costs.other_s)
        out.append(
            cluster.step_since(
                before,
                generation_s=generation,
                experience_s=make,
                train_s=train,
                sync_s=costs.sync_s,
                trained_tokens=tokens_of(batch),
            )
        )
    return out


def simulate_async(costs: Costs, setup: Setup, lengths: List[int], steps: int) -> List[Step]:
    """Upstream's async trainer, queue size 1: the generator starts batch k + 1 when the trainer takes batch k,
    and with partial rollout the engines pause (keeping their requests) for each weight sync. A step runs from
    one training log to the next: the wait for its batch, then make_experience, training and the sync."""
    cluster, source, out = Cluster(costs, setup), groups_of(lengths, setup), []
    batch = next_batch(source, setup.batch)
    cluster.idle(costs.dispatch_s)
    for group in batch or []:
        cluster.dispatch(group)
    for _ in range(steps):
        following = next_batch(source, setup.batch)
        if batch is None or following is None:
            break
        before, cluster.rate = cluster.counters(), 1.0
        wait_for(cluster, batch)
        generation = cluster.now - before[0]
        make, train = experience_s(costs, setup, batch, setup.roles), train_s(costs, setup, batch)
        for group in following:
            cluster.dispatch(group)
        for engine in cluster.engines:  # the generator sends the batch while the trainer makes experiences
            engine.stall += costs.dispatch_s
        cluster.busy(make + train, "apart")
        cluster.busy(costs.sync_s, "paused")  # pause_generation for the broadcast
        cluster.idle(costs.other_s, rate=1.0)
        out.append(
            cluster.step_since(
                before,
                generation_s=generation,
                experience_s=make,
                train_s=train,
                sync_s=costs.sync_s,
                trained_tokens=tokens_of(batch),
                lag=1.0,
            )
        )
        batch = following
    return out


class OPPOSim:
    """OPPO's step: top-up, the wait for B groups, the scorers' drain, make_experience, training, weight sync."""

    def __init__(self, costs: Costs, setup: Setup, plan: Plan, lengths: List[int]):
        self.costs, self.setup, self.plan = costs, setup, plan
        self.cluster = Cluster(costs, setup, plan)
        self.cluster.on_group_done = self.group_done
        self.source = groups_of(lengths, setup)
        self.groups: List[Group] = []  # in flight or done and waiting, in dispatch order
        self.done = 0  # of those, done
        self.overdue = set()  # running groups carried max_defer_steps times: the step waits for them
        self.controller = ThroughputController(
            initial=plan.carry.overcommit.initial,
            auto=plan.carry.overcommit.auto and plan.carry.overcommit.rule == "throughput",
            batch=setup.batch,
            minimum=plan.carry.overcommit.minimum,
            maximum=plan.carry.overcommit.maximum,
        )
        self.on_models = [r for r in plan.stream.roles if r not in self.cluster.on_engines]
        # What the engines do beside each phase of the models' GPUs.
        if not setup.colocated:
            self.beside_experience = self.beside_training = self.beside_rest = "apart"
        elif setup.vllm_sleep:
            self.beside_experience = self.beside_training = self.beside_rest = "paused"  # asleep
        else:
            decoding = plan.carry.colocated_decode
            self.beside_experience = "shared" if decoding == "continue" else "paused"
            self.beside_training = "paused" if decoding == "pause" else "shared"
            self.beside_rest = "apart"

    # -- the samples generator's rules (overcommit/sampler.py) -------------------------------------

    def take_order(self, groups: List[Group]) -> List[Group]:
        return sorted(
            groups, key=lambda g: (g.deferrals < self.plan.carry.max_defer_steps, not g.announced, -g.deferrals)
        )

    def top_up(self, target: int) -> None:
        for _ in range(target - len(self.groups)):
            group = next(self.source, None)
            if group is None:
                return
            self.groups.append(group)
            self.cluster.dispatch(group)

    def group_done(self, group: Group) -> None:
        self.done += 1
        self.overdue.discard(group)
        if self.done == self.setup.batch and not self.bth_done:
            self.bth_done = self.cluster.now - self.start

    def waited_enough(self) -> bool:
        """B groups done and no overdue one running, or nothing running."""
        return self.done == len(self.groups) or (self.done >= self.setup.batch and not self.overdue)

    def announce(self) -> List[Group]:
        """The next batch, if B groups are done (``next_batch_streams``)."""
        if self.done < self.setup.batch:
            return []
        batch = self.take_order([g for g in self.groups if g.done])[: self.setup.batch]
        for group in batch:
            group.announced = True
        return batch

    # -- scoring ----------------------------------------------------------------------------------

    def requests(self, groups=None) -> List[Request]:
        return [r for g in (self.groups if groups is None else groups) for r in g.requests]

    def catch_up(self, role: str, groups: List[Group]) -> float:
        """Seconds on the models' GPUs of ``role``'s prefill of ``groups`` beside training: the critic's
        catch-up after its fit."""
        queue = self.cluster.models
        before = queue.work
        for request in self.requests(groups):
            self.cluster.send(request, role)
        work, queue.work = queue.work - before, before
        return work / self.setup.model_gpus

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> Optional[Step]:
        costs, setup, plan, cluster = self.costs, self.setup, self.plan, self.cluster
        before, self.start, self.bth_done = cluster.counters(), cluster.now, 0.0
        live = self.requests()
        if setup.vllm_sleep:
            cluster.recompute(live)  # the engines' sleep dropped the carried requests' KV
        for role in plan.stream.roles:
            if role == "policy" and role in cluster.on_engines:
                cluster.released.add(role)  # vLLM scores each sequence once it is whole
            elif not (role == "critic" and plan.stream.critic_catch_up == "next_batch"):
                cluster.release(role, live)
        done_at_start, delta = self.done, self.controller.delta
        if not (plan.carry.top_up == "step_end") or not self.groups:
            self.top_up(setup.batch + delta)
        if len(self.groups) < setup.batch:
            return None  # the prompts ran out
        self.overdue = {g for g in self.groups if not g.done and g.deferrals >= plan.carry.max_defer_steps}
        if self.done >= setup.batch:
            self.bth_done = 0.0
        cluster.idle(costs.oppo_dispatch_s, rate=1.0)
        if not self.waited_enough():
            cluster.run(stop=self.waited_enough)
        self.controller.record_generation(self.bth_done, done_at_start)
        taken = self.take_order([g for g in self.groups if g.done])[: setup.batch]
        chosen = set(taken)
        self.groups = [g for g in self.groups if g not in chosen]
        self.done -= len(taken)
        for group in self.groups:
            group.deferrals += 1
            group.announced = False
        generation = cluster.now - self.start

        # make_experience: what the batch's scorers still lack is flushed and the queues drain (first in, first
        # out); each streamed model returns its scores in one call; upstream's forward for the others. The
        # roles on the models' GPUs hold the carried requests' tokens until those GPUs are free again.
        make_start = cluster.now
        for role in plan.stream.roles:
            for request in self.requests(taken):
                cluster.send(request, role)
        for role in self.on_models:
            cluster.hold(role, self.requests())
        if plan.carry.top_up == "step_end":
            self.top_up(setup.batch + self.controller.delta)
        cluster.rate = 0.0 if self.beside_experience == "paused" else 1.0
        cluster.capacities()
        cluster.run(max(cluster.models.drain_s(), cluster.beside_engines.drain_s()))
        unstreamed = [r for r in setup.roles if r not in plan.stream.roles]
        collect = costs.call_s * (len(setup.roles) - len(unstreamed))
        cluster.busy(
            collect + experience_s(costs, setup, taken, unstreamed), self.beside_experience, costs.decode_busy
        )
        make = cluster.now - make_start

        train_start, train = cluster.now, train_s(costs, setup, taken)
        if "critic" in setup.trained and "critic" in plan.stream.roles and plan.stream.critic_catch_up != "next_step":
            fit = CRITIC_FIT_SHARE * train
            cluster.busy(fit, self.beside_training, costs.train_busy)
            cluster.new_weights("critic", self.requests())
            if plan.stream.critic_catch_up == "after_fit":
                extra = self.catch_up("critic", self.groups)
                cluster.released.add("critic")
            else:
                extra = self.catch_up("critic", self.announce())
            cluster.busy(train - fit + extra, self.beside_training, costs.train_busy)
        else:
            cluster.busy(train, self.beside_training, costs.train_busy)
            cluster.new_weights("critic", self.requests())
        train = cluster.now - train_start

        if plan.sync.mode == "staged" and not setup.colocated:
            cluster.busy(costs.sync_s / 2, "apart")
            cluster.busy(costs.sync_s / 2, "paused")  # the engines pause only to load the staged weights
        else:
            cluster.busy(costs.sync_s, "paused")
        cluster.new_weights("policy", self.requests())
        if not (plan.carry.kv == "keep") and not setup.vllm_sleep:
            cluster.recompute(self.requests())
        if "policy" in self.cluster.on_engines:
            for request in self.requests(self.announce()):
                cluster.send(request, "policy")
        cluster.idle(costs.other_s, rate=0.0 if self.beside_rest == "paused" else 1.0)
        lag = sum(g.deferrals for g in taken) / len(taken) + (plan.carry.top_up == "step_end")
        return cluster.step_since(
            before,
            generation_s=generation,
            experience_s=make,
            train_s=train,
            sync_s=costs.sync_s,
            trained_tokens=tokens_of(taken),
            lag=lag,
            delta=delta,
        )


def simulate_oppo(costs: Costs, setup: Setup, plan: Plan, lengths: List[int], steps: int) -> List[Step]:
    sim, out = OPPOSim(costs, setup, plan, lengths), []
    for _ in range(steps):
        step = sim.step()
        if step is None:
            break
        out.append(step)
    return out
