"""Inter-step overlap: a samples generator that keeps B + Delta prompt groups in flight.

A group is one prompt with its ``n_samples_per_prompt`` samples (one ``generate_responses`` call). Each
step tops the groups in the system up to ``B + Delta`` (B = ``--rollout.batch_size``), ends as soon as
B groups are done, and leaves the rest running in vLLM: they are first in line next step, with their
partial work. A group carried ``--oppo.max_defer_steps`` times is waited for. With ``--oppo.top_up
step_end`` the top-up happens as a step ends instead, so that new prompts decode during training.

Exactly once: every prompt drawn from the dataloader is in exactly one place: in flight, done and
waiting, or returned for training. An epoch ends when the dataloader is exhausted and the carried
groups have drained. A checkpoint stores the carried prompts (``state_dict``); after a resume they are
dispatched again before any new prompt, so none is lost and none repeats. Storing them is cheaper than
draining before every save, which would bring back the long-tail wait OPPO removes; the price is
regenerating at most ``Delta`` groups once per resume. The checkpoint also says whether the dataloader
has run out: a ``StatefulDataLoader`` state saved after its ``StopIteration`` starts the next epoch when
iterated again, so the carried groups of the epoch's end must drain first, with no new prompt.
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional

import ray
import torch
from openrlhf.trainer.ppo_utils.samples_generator import _collect_prompt_batch
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
from openrlhf.utils.logging_utils import init_logger
from tqdm import tqdm

from openrlhf_oppo.overcommit.controller import OvercommitController
from openrlhf_oppo.protocol import StreamInfo
from openrlhf_oppo.samples import OPPOSamplesGenerator

logger = init_logger(__name__)


@dataclass
class PromptGroup:
    prompt: str
    label: object
    image: object = None
    deferrals: int = 0  # steps this group has been carried over
    ref: Optional[ray.ObjectRef] = None
    experiences: Optional[list] = None  # set when all its samples are done
    announced: bool = False  # in the next batch that ``next_batch_streams`` named: the next step takes it
    streams: Optional[list] = None  # its sequences' streams, read once from its responses (``_streams``)


@dataclass
class StepRecord:
    """One step's generation, from its start to the groups it takes (``start_step`` to ``finish_step``)."""

    started: float
    delta: int  # the Delta this step runs with
    done_at_start: int  # carried groups already done (those that finished during training included)
    stats: dict = field(default_factory=lambda: dict(completed=0, accepted=0))
    bth_done_at: float = 0.0  # s after ``started`` at which the B-th group was done
    overdue_wait: float = 0.0  # the wait past the B-th group for overdue ones
    taken: List[PromptGroup] = field(default_factory=list)
    carried: int = 0  # groups left in the system when the step took its own
    carried_in_flight: int = 0


class OvercommitSamplesGenerator(OPPOSamplesGenerator):
    """The prompt groups of inter-step overlap: which are in flight, done or carried, which a step takes, and
    the checkpoint of the carried ones. Its part of a step is generation: top up the groups, wait for B of them
    and take them. What the carried ones do from there on (held, paused, released) is the trainer's
    (``OPPOTrainer.train_step``): this class makes no call to the engines but the groups' own and upstream's
    wake-up."""

    def __init__(self, *args, controller: OvercommitController, max_defer_steps: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.controller = controller
        self.max_defer_steps = max_defer_steps
        self.groups: List[PromptGroup] = []  # carried: in flight or done and waiting, in dispatch order
        self.restored: List[PromptGroup] = []  # carried groups of a checkpoint, dispatched first
        self._iter = None
        self._iter_done = False  # the dataloader raised StopIteration in this epoch
        self.metrics = {}

    @torch.no_grad()
    def _generate_samples(self, **generate_kwargs):
        # Engines put to sleep at the last step's end (--vllm.enable_sleep) wake up, as upstream's generation does.
        if self.args.vllm.enable_sleep:
            batch_vllm_engine_call(self.vllm_engines, "wake_up")
        step = self.start_step()
        with self.tracer.span("top_up", track="generation"):
            self.top_up(step.delta, generate_kwargs)
        with self.tracer.span("wait", track="generation"):
            self.wait_for_batch(step, generate_kwargs)
        self.take_batch(step)
        return self.finish_step(step)

    # -- one step ---------------------------------------------------------------------------------

    def start_step(self) -> StepRecord:
        if self._iter is None and not self._iter_done:
            self._iter = iter(self.prompts_dataloader)
        return StepRecord(started=time.time(), delta=self.controller.delta, done_at_start=self._done_now())

    def top_up(self, delta: int, generate_kwargs) -> None:
        """Dispatch new (or restored) prompts until ``B + delta`` groups are in the system."""
        self._top_up(self.args.rollout.batch_size + delta, generate_kwargs)

    def top_up_next_step(self, generate_kwargs) -> None:
        """``--oppo.top_up step_end``: the next step's new prompts, dispatched as this step's generation ends, so
        that they decode during training."""
        if self._iter is None:
            return  # this step ended the episode: the next one's prompts start with its first step
        before = len(self.groups)
        self.top_up(self.controller.delta, generate_kwargs)
        self.metrics["oppo/topped_up_at_step_end"] = float(len(self.groups) - before)

    def wait_for_batch(self, step: StepRecord, generate_kwargs) -> None:
        step.bth_done_at = self._wait(self.args.rollout.batch_size, generate_kwargs, step.started, step.stats)
        # Past the B-th group a step waits only for overdue groups: the price of --oppo.max_defer_steps.
        step.overdue_wait = time.time() - step.started - step.bth_done_at
        # The throughput rule moves Delta on this step's waits (the reward-slope rule on the reward, later).
        self.controller.record_generation(step.bth_done_at, step.done_at_start, step.overdue_wait)

    def take_batch(self, step: StepRecord) -> None:
        step.taken = self._take(self.args.rollout.batch_size)
        step.carried = len(self.groups)
        step.carried_in_flight = sum(g.experiences is None for g in self.groups)

    def finish_step(self, step: StepRecord):
        """The step's samples and its ``oppo/*`` metrics, as upstream's ``generate_samples`` returns them."""
        taken = step.taken
        experiences = []
        for group in taken:
            for experience in group.experiences:
                experience.info["deferred_steps"] = torch.tensor([float(group.deferrals)])
            experiences.extend(group.experiences)
        self.metrics = {
            "oppo/overcommit": float(step.delta),
            "oppo/groups_done_at_start": float(step.done_at_start),
            "oppo/carried_groups": float(step.carried),
            "oppo/carried_in_flight": float(step.carried_in_flight),
            "oppo/topped_up_at_step_end": 0.0,  # top_up_next_step's, if the trainer calls it
            "oppo/deferred_groups_trained": float(sum(g.deferrals > 0 for g in taken)),
            "oppo/max_deferrals_trained": float(max((g.deferrals for g in taken), default=0)),
            "oppo/bth_group_done_s": step.bth_done_at,
            "oppo/overdue_wait_s": step.overdue_wait,
            "oppo/generation_wall_s": time.time() - step.started,
        }
        filter_pass_rate = None
        if self.args.algo.dynamic_filtering_enable and step.stats["completed"]:
            filter_pass_rate = step.stats["accepted"] / step.stats["completed"] * 100

        exhausted = self._iter_done and not self.groups and not self.restored
        if exhausted:
            self._iter, self._iter_done = None, False  # the next call starts the next episode
        return experiences, filter_pass_rate, len(taken), exhausted

    def _done_now(self) -> int:
        """Carried groups whose samples are all done (those that finished during training included)."""
        return len(self._done_groups())

    def _done_groups(self) -> List[PromptGroup]:
        """The carried groups whose samples are all done, collected or not, in dispatch order."""
        running = [g.ref for g in self.groups if g.experiences is None]
        ready = set(ray.wait(running, num_returns=len(running), timeout=0)[0]) if running else set()
        return [g for g in self.groups if g.experiences is not None or g.ref in ready]

    def record_reward(self, mean_reward: float) -> None:
        """Feed the step's mean reward to the Delta controller."""
        self.controller.update(mean_reward)

    def _top_up(self, target: int, generate_kwargs) -> None:
        missing = target - len(self.groups)
        if missing <= 0:
            return
        new = self.restored[:missing]
        self.restored = self.restored[missing:]
        if len(new) < missing and not self._iter_done:
            prompts, labels, images, self._iter_done = _collect_prompt_batch(self._iter, missing - len(new))
            new += [PromptGroup(p, l, i) for p, l, i in zip(prompts, labels, images)]
        self._dispatch(new, generate_kwargs)

    def _dispatch(self, groups: List[PromptGroup], generate_kwargs) -> None:
        if not groups:
            return
        refs = self._dispatch_prompts_to_vllm(
            [g.prompt for g in groups], [g.label for g in groups], images=[g.image for g in groups], **generate_kwargs
        )
        for group, ref in zip(groups, refs):
            group.ref = ref
        self.groups.extend(groups)

    def _wait(self, batch: int, generate_kwargs, started: float, stats: dict) -> float:
        """Collect finished groups, in take order, until ``batch`` are done, no overdue group is still running
        and the announced next batch (``next_batch_streams``, all done then) is collected.

        Returns the time (s since ``started``) at which the ``batch``-th group was done.
        """
        pbar = tqdm(total=batch, desc="Generate samples (overcommit)", leave=False)
        bth_done_at = 0.0
        while True:
            done = sum(g.experiences is not None for g in self.groups)
            pbar.n = min(done, batch)
            pbar.refresh()
            if done >= batch and not bth_done_at:
                bth_done_at = time.time() - started
            # ray.wait lists the ready ones in this order: the groups to take first are collected first.
            running = {g.ref: g for g in self._in_take_order([g for g in self.groups if g.experiences is None])}
            due = self._due()
            overdue = any(id(g) in due for g in running.values())
            announced = any(g.announced for g in running.values())
            if not running or (done >= batch and not overdue and not announced):
                break
            ready, _ = ray.wait(list(running), num_returns=1, timeout=10.0)
            for ref in ready:
                self._collect(running[ref], generate_kwargs, stats)
        pbar.close()
        return bth_done_at or time.time() - started

    def _collect(self, group: PromptGroup, generate_kwargs, stats: dict) -> None:
        experiences = [self._process_response_into_experience(r, **generate_kwargs) for r in ray.get(group.ref)]
        group.ref = None
        stats["completed"] += 1
        if self.args.algo.dynamic_filtering_enable and not self._passes_filter(experiences):
            # As upstream: a filtered group is dropped and a new prompt takes its place.
            self._drop(experiences)
            self.groups.remove(group)
            self._top_up(len(self.groups) + 1, generate_kwargs)
            return
        stats["accepted"] += 1
        group.experiences = experiences

    def _passes_filter(self, experiences) -> bool:
        if any(e.scores is None for e in experiences):
            return True
        scores = [e.scores[0].item() for e in experiences]
        low, high = self.args.algo.dynamic_filtering_range
        return low < sum(scores) / len(scores) < high

    def _take(self, batch: int) -> List[PromptGroup]:
        """This step's groups, in ``_in_take_order``."""
        taken = self._in_take_order([g for g in self.groups if g.experiences is not None])[:batch]
        taken_ids = {id(g) for g in taken}
        self.groups = [g for g in self.groups if id(g) not in taken_ids]
        for group in self.groups:
            group.deferrals += 1
            group.announced = False
        return taken

    def _in_take_order(self, groups: List[PromptGroup]) -> List[PromptGroup]:
        """Due groups first (``_due``), then those of the announced next batch, then the longest carried, then in
        dispatch order (``self.groups``'s, which ``groups`` keeps): an order known before the groups are
        collected (``next_batch_streams``)."""
        due = self._due()
        return sorted(groups, key=lambda g: (id(g) not in due, not g.announced, -g.deferrals))  # stable

    def _due(self) -> set:
        """The groups this step must train so that none is carried more than ``max_defer_steps`` steps (the lag
        bound, ``--oppo.max_lag``). A group's deadline is ``max_defer_steps - deferrals`` steps from now, and a step
        trains B groups: if ``c_k`` groups are due within k steps, this step must train ``max_k(c_k - B k)`` of
        them, the earliest deadlines first (which keeps every later step feasible too). Only overdue groups
        (deadline 0) are due while the groups in flight are spread over the steps, as Delta's bound keeps them."""
        batch, limit = self.args.rollout.batch_size, self.max_defer_steps
        need = max(sum(limit - g.deferrals <= k for g in self.groups) - batch * k for k in range(limit + 1))
        by_deadline = sorted(self.groups, key=lambda g: -g.deferrals)  # stable: dispatch order within a deadline
        return {id(g) for g in by_deadline[: min(max(need, 0), batch)]}

    def next_batch_streams(self) -> Optional[List[StreamInfo]]:
        """The streams of the groups the next step will train, if it started now; None while fewer than a batch
        are done. Once named, the next step takes these groups: the critic and the engines score them after
        their weights change, and would score a group that took the place of one of them only at its collect.
        Only a group that is overdue when the step starts comes first."""
        batch = self.args.rollout.batch_size
        done = self._done_groups()
        if len(done) < batch:
            return None
        streams = []
        for group in self._in_take_order(done)[:batch]:
            group.announced = True
            streams += self._streams(group)
        return streams

    @staticmethod
    def _streams(group: PromptGroup) -> List[StreamInfo]:
        """A done group's streams: from its experiences once collected, else from its responses in Ray's object
        store, read once (the trainer names the next batch twice a step: the critic's catch-up, the engines')."""
        if group.experiences is not None:
            return [e.stream for e in group.experiences if getattr(e, "stream", None)]
        if group.streams is None:
            group.streams = [r["stream_info"] for r in ray.get(group.ref) if r.get("stream_info")]
        return group.streams

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The carried prompts (their partial work is not kept), whether the dataloader has run out, and the
        controller."""
        carried = [dict(prompt=g.prompt, label=g.label, image=g.image, deferrals=g.deferrals) for g in self.groups]
        carried += [dict(prompt=g.prompt, label=g.label, image=g.image, deferrals=g.deferrals) for g in self.restored]
        return dict(carried=carried, loader_exhausted=self._iter_done, controller=self.controller.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self.restored = [PromptGroup(c["prompt"], c["label"], c["image"], c["deferrals"]) for c in state["carried"]]
        # Then no new prompt this epoch: the dataloader's state would start the next one.
        self._iter, self._iter_done = None, state.get("loader_exhausted", False)
        self.controller.load_state_dict(state["controller"])
        logger.info(
            f"Restored {len(self.restored)} carried prompt groups from the checkpoint"
            + (" (the epoch's prompts are all drawn)" if self._iter_done else "")
        )
