"""OPPO's PPO trainer: upstream's ``PPOTrainer`` with OPPO's samples generator and experience maker.

Upstream builds its ``SamplesGenerator`` and ``RemoteExperienceMaker`` inside the trainer actor, so
they are replaced here, after ``super().__init__``. A step reads top to bottom in ``OPPOTrainer.train_step``, one
method a phase: upstream's ``fit`` asks the samples generator for the step's batch (with inter-step overlap the
groups' top-up and wait, ``OvercommitSamplesGenerator``), hands it to ``train_step``, and between steps logs,
saves and evaluates. This class also sets up streaming (once the models are loaded), the chunk-size and overcommit
controllers, checkpointing of carried prompts, and the ``oppo/*`` metrics and traces.
"""

import os
import time
from contextlib import contextmanager

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_utils.experience import balance_experiences
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
from openrlhf.utils.logging_utils import init_logger

from openrlhf_oppo.coordinator import StreamCoordinator, phase
from openrlhf_oppo.experience import StreamingExperienceMaker
from openrlhf_oppo.lengths import LengthStats
from openrlhf_oppo.overcommit.controller import OvercommitController, ThroughputController
from openrlhf_oppo.overcommit.sampler import OvercommitSamplesGenerator
from openrlhf_oppo.plan import describe
from openrlhf_oppo.protocol import ROLES, ResourceReading, ScorerSettings, StreamSettings
from openrlhf_oppo.samples import OPPOSamplesGenerator
from openrlhf_oppo.streaming.chunking import ChunkSizeController
from openrlhf_oppo.trace import Tracer, write_trace

logger = init_logger(__name__)


def wait_for_awake_colocated_engines(args, vllm_engines) -> None:
    """Return once vLLM engines that stay awake on the models' GPUs (``--train.colocate_all`` without
    ``--vllm.enable_sleep``) are up. The driver loads the models as soon as this trainer exists, and vLLM refuses
    to start when memory is freed on its GPU while it profiles its own use. Upstream waits only for engines it
    puts to sleep (``create_vllm_engines``); patch 0013 waits there for awake ones too, which makes this a no-op."""
    if vllm_engines and args.train.colocate_all and not args.vllm.enable_sleep:
        ray.get([engine.__ray_ready__.remote() for engine in vllm_engines])


class OPPOTrainer(LengthStats, PPOTrainer.__ray_actor_class__):
    def __init__(
        self,
        pretrain,
        strategy,
        actor_model_group,
        critic_model_group,
        reward_model_group,
        reference_model_group,
        vllm_engines,
        plan=None,
        **generate_kwargs,
    ):
        if plan is None:
            raise ValueError("OPPOTrainer runs the plan it is given (plan.resolve; extension.configure binds it)")
        self.plan = plan
        wait_for_awake_colocated_engines(strategy.args, vllm_engines)
        super().__init__(
            pretrain,
            strategy,
            actor_model_group,
            critic_model_group,
            reward_model_group,
            reference_model_group,
            vllm_engines,
            **generate_kwargs,
        )
        oppo = self.plan
        logger.info(describe(self.plan))
        self.tracer = Tracer(enabled=oppo.observe.trace_dir is not None, process="trainer")
        self.policy_version = 0
        self.weight_sync_metrics = {}
        self.cpu_seconds = {}  # (kind, index) -> CPU seconds at the last step: oppo/cpu/* is per step
        self.chunk_controller = ChunkSizeController(fixed=oppo.stream.chunk_size)
        groups = dict(
            policy=actor_model_group,
            critic=critic_model_group,
            reward=reward_model_group,
            reference=reference_model_group,
        )
        self.coordinator = StreamCoordinator(
            vllm_engines,
            {role: groups[role] for role in oppo.stream.roles},
            timeout_s=oppo.observe.call_timeout_s,
            beside_vllm=oppo.topology.frozen_beside_engines,
            scored_by_engines=("policy",) if oppo.stream.policy_logprobs == "vllm" else (),
            every_model=groups,
        )
        self.samples_generator = self._make_samples_generator(strategy, vllm_engines)
        if oppo.stream.roles:
            self.experience_maker = StreamingExperienceMaker(
                actor_model_group,
                critic_model_group,
                reward_model_group,
                reference_model_group,
                self.kl_ctl,
                strategy,
                self.tokenizer,
                coordinator=self.coordinator,
                tracer=self.tracer,
            )
        # --oppo.state_moves overlap: moves started outside ppo_train, awaited at its start.
        self.critic_reload, self.policy_offload, self.policy_offload_due = [], [], False
        # What the engines do when the step's generation ends and when its training starts is the placement's:
        # picked once, run by the step's phases (train_step).
        self.engines_after_generation = self._pick_engines_after_generation()
        self.engines_before_training = self._unpause_carried_requests if oppo.resumes_for_training else lambda: {}
        self.timings = {}  # the step's timing/* metrics, one per timed phase (_timed)

    def _make_samples_generator(self, strategy, vllm_engines):
        oppo, args = self.plan, self.args
        kwargs = dict(
            strategy=strategy,
            prompts_dataloader=self.prompts_dataloader,
            eval_dataloader=self.eval_dataloader,
            tokenizer=self.tokenizer,
            vllm_engines=vllm_engines,
            coordinator=self.coordinator,
            tracer=self.tracer,
        )
        if not oppo.inter_step:
            return OPPOSamplesGenerator(**kwargs)
        bounds = dict(
            initial=oppo.carry.overcommit.initial,
            auto=oppo.carry.overcommit.auto,
            window=oppo.carry.overcommit.window,
            inc=oppo.carry.overcommit.inc,
            dec=oppo.carry.overcommit.dec,
            minimum=oppo.carry.overcommit.minimum,
            maximum=oppo.carry.overcommit.maximum,
        )
        if oppo.carry.overcommit.rule == "throughput":
            controller = ThroughputController(batch=args.rollout.batch_size, **bounds)
        else:
            controller = OvercommitController(**bounds)
        return OvercommitSamplesGenerator(**kwargs, controller=controller, max_defer_steps=oppo.carry.max_defer_steps)

    # -- set-up once the models are loaded ----------------------------------------------------

    def fit(self, global_step: int = 0) -> None:
        oppo = self.plan
        self.coordinator.connect(
            ScorerSettings(
                cache_budget_bytes=int(oppo.stream.cache_budget_gb * 2**30),
                temperature=self.args.rollout.temperature,
                max_tokens_per_forward=oppo.stream.max_prefill_tokens,
                max_cached_tokens_per_forward=oppo.stream.max_prefill_cached_tokens,
                trace=self.tracer.enabled,
            ),
            StreamSettings(
                chunk_size=self.chunk_controller.chunk_size,
                salt_prompts=oppo.inter_step,
                calls_in_flight=oppo.stream.prefill_calls_in_flight,
                flush_interval_s=oppo.stream.flush_interval_ms / 1000,
                trace=self.tracer.enabled,
            ),
            affinity=self._frozen_affinity(),
        )
        super().fit(global_step)

    def _frozen_affinity(self) -> dict:
        """With the frozen models on the engines' GPUs, each engine streams to the rank on its own first GPU
        (placement.train puts rank r and engine r // TP on bundle r of the engines' placement group)."""
        tp = self.args.vllm.tensor_parallel_size
        first_gpus = [engine * tp for engine in range(len(self.vllm_engines))]
        return {role: first_gpus for role in self.plan.topology.frozen_beside_engines}

    # -- one step -----------------------------------------------------------------------------------

    def train_step(self, rollout_samples, global_step):
        """Upstream's ``train_step`` (0.11.2), COPIED as a list of phases, with OPPO's own marked ``OPPO change``.
        Upstream's ``fit`` made the step's generation before calling it (with inter-step overlap: top up the groups
        to B + Delta and wait for B of them, ``OvercommitSamplesGenerator``). Each phase is a method whose docstring
        says which of upstream's lines it stands for and what OPPO changes there. A timed phase is one span of the
        trace's "trainer" track, whose seconds the step logs as ``timing/<phase>`` (``_timed``)."""
        self.timings = {}
        # --- OPPO change: the end of generation, and the scores training will not see. ---
        lag = self._policy_lag(rollout_samples)  # before this step's update bumps the version
        self._end_generation()
        discarded = self._discard_dropped()
        # Upstream's body, one method a block.
        experiences = self._make_experience(rollout_samples)
        sample0 = self._first_sample(experiences)
        rollout_stats = self._compute_rollout_stats(experiences)  # ground truth, before dynamic batch splitting
        self._push_experiences(experiences)
        status = self._train(global_step)
        self._sync_weights_and_release()
        self._update_kl_controller(status)
        status.update(self.timings)  # per-phase timing breakdown
        status.update(rollout_stats)
        status["generated_samples"] = sample0
        # --- OPPO change: the oppo/* metrics, and the step's trace. ---
        status.update(lag)
        status.update(discarded)
        status.update(self._oppo_metrics(status))
        global_step += 1
        self._write_trace(global_step)
        return status, global_step

    @contextmanager
    def _timed(self, name: str):
        """Time a phase once for both the trace (a span of its "trainer" track) and the step's metrics
        (``timing/<name>``)."""
        with self.tracer.timed(name, track="trainer") as timed:
            yield
        self.timings[f"timing/{name}"] = timed.seconds

    def _end_generation(self) -> None:
        """OPPO's phase, with inter-step overlap: the step's groups are done, and those it carries go on. Hold:
        until the weight sync, the carried sequences' chunks for the models about to train only queue (their scores
        would use weights about to change). New prompts for the next step may start now (``--oppo.top_up
        step_end``) and decode through training. Then the engines do what the plan picked for them
        (``engines_after_generation``); engines that pause take the new prompts after the pause, queued until training
        starts (``Plan.top_up_while_paused``). Without inter-step overlap upstream's generation ended it all."""
        if not self.plan.inter_step:
            return
        top_up = self.plan.carry.top_up == "step_end"
        with self._timed("end_of_generation"):
            with self.tracer.span("hold", track="trainer"):
                self.coordinator.hold()
            if top_up and not self.plan.top_up_while_paused:
                self._top_up_next_step()
            self.engines_after_generation()
            if top_up and self.plan.top_up_while_paused:
                self._top_up_next_step()

    def _top_up_next_step(self) -> None:
        with self.tracer.span("top_up", track="trainer"):
            self.samples_generator.top_up_next_step(self.generate_kwargs)

    def _pick_engines_after_generation(self):
        """What the engines do when the step's groups are done, from the placement: asleep between steps
        (``--vllm.enable_sleep``, upstream's hybrid engine) they sleep, as upstream's generation puts them to sleep;
        awake on the models' GPUs they pause their carried requests, so that the models have the GPU to themselves
        (unless ``--oppo.colocated_decode continue``); on GPUs of their own they decode on."""
        if self.args.vllm.enable_sleep:
            return lambda: batch_vllm_engine_call(self.vllm_engines, "sleep")
        if self.plan.pauses_after_generation:
            return self._pause_carried_requests
        return lambda: None

    def _pause_carried_requests(self) -> None:
        # With no carried request the engines pause all the same where the next step's prompts follow: they wait
        # queued until training starts, rather than decode beside the experiences.
        if self.samples_generator.groups or self.plan.top_up_while_paused:
            with self.tracer.span("pause", track="trainer"):
                self.coordinator.pause(clear_cache=False)

    def _unpause_carried_requests(self) -> dict:
        """``--oppo.colocated_decode during_training``: the experiences are made, so the carried requests, which the
        end of generation paused, decode beside training, and so do the next step's prompts queued behind the pause."""
        if not (self.samples_generator.groups or self.plan.top_up_while_paused):
            return {}
        with self.tracer.span("unpause", track="trainer"):
            return {"oppo/decoding_paused_s": self.coordinator.unpause()}

    def _discard_dropped(self) -> dict:
        """OPPO's phase: free the scores of the streamed sequences that training will not see (dropped by dynamic
        filtering, or replaced by a ``-full`` stream): nothing else would, and the critic and policy would re-score
        them after every weight update."""
        with self.tracer.span("discard", track="trainer"):
            dropped = self.samples_generator.take_dropped()
            if not self.coordinator.roles:
                return {}
            self.coordinator.discard(dropped)
        return {"oppo/discarded_sequences": float(len(dropped))}

    def _make_experience(self, rollout_samples) -> list:
        """Upstream's "Turn raw rollouts into PPO-ready trajectories with rewards" (its ``make_experience_batch``
        call, timed as ``timing/make_experience``). OPPO's change: with streaming, the streamed scores are flushed
        and collected first; the critic then has nothing more to score this step, so its states may start loading
        (``--oppo.state_moves overlap``)."""
        with self._timed("make_experience"):
            if not self.coordinator.roles:
                return self.experience_maker.make_experience_batch(rollout_samples)
            streamed = self.experience_maker.collect_scores(rollout_samples)
            oppo = self.plan
            if streamed.collected and oppo.sync.state_moves == "overlap" and "critic" in oppo.stream.roles:
                self._prefetch_critic_states()
            return self.experience_maker.make_experience_batch(rollout_samples, streamed)

    def _first_sample(self, experiences) -> list:
        """Upstream's "Peek at the first decoded sample for quick sanity check", COPIED."""
        sample0 = [
            self.tokenizer.decode(experiences[0].sequences[0].unsqueeze(0), skip_special_tokens=True)[0],
            experiences[0].info["reward"][0].item(),
        ]
        logger.info(f"Sample: {sample0}")
        return sample0

    def _push_experiences(self, experiences) -> None:
        """Upstream's "Balance experiences across DP ranks if needed" and "Push experiences to actor (and critic)
        shards before PPO", COPIED."""
        if self.args.train.dynamic_batch_enable:
            experiences = balance_experiences(experiences, self.args)
        refs = self.actor_model_group.async_run_method_batch(method_name="append", experience=experiences)
        if self.critic_model_group is not None:
            refs.extend(self.critic_model_group.async_run_method_batch(method_name="append", experience=experiences))
        ray.get(refs)

    def _train(self, global_step) -> dict:
        """Upstream's "Perform PPO optimization for actor/critic and gather metrics" (its ``ppo_train`` call, timed
        as ``timing/ppo_train``; the critic's hook is inside, ``ppo_train``). OPPO's change: first, the engines do
        what the plan picked for them (``engines_before_training``)."""
        with self._timed("ppo_train"):
            paused = self.engines_before_training()
            with phase("training"):
                status = self.ppo_train(global_step)
            status.update(paused)
        return status

    def _sync_weights_and_release(self) -> None:
        """Upstream's "Sync weights to vLLM" (timed as ``timing/broadcast``). OPPO's changes: the engines score
        the policy's log-probs with the new weights (``--oppo.policy_logprobs vllm``), and, with inter-step
        overlap, every model has its new weights, so the chunks held through training go out (except those that
        the critic's and the engines' catch-up sent, and those they keep held until their batch)."""
        with self._timed("broadcast"):
            if self.vllm_engines is not None:
                self.broadcast_to_vllm()
                if self.coordinator.scored_by_engines:
                    self._release_engine_scoring()
            if self.plan.inter_step:
                with self.tracer.span("release", track="trainer"):
                    self.coordinator.release()

    def _release_engine_scoring(self) -> None:
        """The engines hold the new weights, so the policy's log-probs they score need not wait for the next step's
        start, which comes after this step's metrics, and those can wait on the critic's catch-up. Once the next
        step's groups are all done, only theirs."""
        with self.tracer.span("engine_scoring", track="trainer"):
            next_batch = self.samples_generator.next_batch_streams()
            self.coordinator.release_engine_scoring(next_batch)
        self.weight_sync_metrics["oppo/engine_scoring_batch_only"] = float(next_batch is not None)

    def _update_kl_controller(self, status) -> None:
        """Upstream's "Refresh KL controller with the latest measurement", COPIED."""
        if "kl" in status:
            # TODO: KL controller must be FixedKLController; AdaptiveKLController is incompatible here.
            self.kl_ctl.update(status["kl"], self.args.rollout.batch_size * self.args.rollout.n_samples_per_prompt)

    def _write_trace(self, global_step) -> None:
        """The step's spans, this process's and every actor's, in one file (``--oppo.trace_dir``)."""
        if self.tracer.enabled:
            events = self.tracer.drain() + self.coordinator.drain_traces()
            write_trace(os.path.join(self.plan.observe.trace_dir, f"step_{global_step:05d}.json"), events)

    def _policy_lag(self, rollout_samples) -> dict:
        """How many weight versions the first token of each sample is behind the policy it trains (0: on-policy),
        checked against ``--oppo.max_lag``: the sampler's deadlines keep every sample within it, so a sample above
        it is a bug, and training on it would break the bound the user set."""
        streams = [getattr(s, "stream", None) for s in rollout_samples]
        lags = [
            self.policy_version - s.first_version for s in streams if s is not None and s.first_version is not None
        ]
        if not lags:
            return {}
        if self.plan.inter_step and max(lags) > self.plan.carry.max_lag:
            raise RuntimeError(
                f"a sample {max(lags)} weight versions behind reached training, above --oppo.max_lag "
                f"{self.plan.carry.max_lag}"
            )
        return {
            "oppo/policy_lag_mean": sum(lags) / len(lags),
            "oppo/policy_lag_max": float(max(lags)),
            "oppo/max_lag": float(self.plan.carry.max_lag),
        }

    def _oppo_metrics(self, status) -> dict:
        metrics = dict(getattr(self.experience_maker, "metrics", {}))
        metrics.update(getattr(self.samples_generator, "metrics", {}))
        metrics.update(self.weight_sync_metrics)  # this step's sync
        if self.plan.inter_step:
            self.samples_generator.record_reward(status["rollout/reward_mean"])
        if self.coordinator.roles:
            stats = self.coordinator.stats()  # once a step: it drains the scorers' call records
            metrics.update(self._update_chunk_size(stats))
            metrics.update(scorer_metrics(stats))
        metrics.update(resource_metrics(self.coordinator.resources(), self.cpu_seconds))
        if self.plan.memory.estimated:
            # The memory plan's estimate of the fullest GPU, beside what the actors hold (oppo/memory/*_gpu_*).
            metrics["oppo/memory/estimate_gb"] = self.plan.memory.estimate.worst.peak_gib
            metrics["oppo/memory/upstream_estimate_gb"] = self.plan.memory.upstream.worst.peak_gib
        return metrics

    def _update_chunk_size(self, stats: dict) -> dict:
        # An engine scores whole sequences (--oppo.policy_logprobs vllm): the chunk size does not set its load.
        calls_by_scorer = {
            f"{role}:{rank}": rank_stats.calls
            for role, ranks in stats.items()
            if role not in self.coordinator.scored_by_engines
            for rank, rank_stats in enumerate(ranks)
        }
        before = self.chunk_controller.chunk_size
        after = self.chunk_controller.update(calls_by_scorer)
        if after != before:
            self.coordinator.set_chunk_size(after)
        metrics = {"oppo/chunk_size": float(before)}
        if self.chunk_controller.utilization:
            metrics["oppo/scorer_utilization_max"] = max(self.chunk_controller.utilization.values())
        return metrics

    def ppo_train(self, global_steps):
        """Upstream's ``ppo_train`` (0.11.2). Its branch without sleep mode is COPIED in the shape patch 0009 gives
        it: the critic's results first, then its hook (``--oppo.critic_catch_up after_fit`` or ``next_batch``: its
        held chunks go out while the policy may still train). Its sleep-mode branch is upstream's, or with
        ``--oppo.state_moves overlap`` (which needs sleep mode) ``_train_overlapping_state_moves``."""
        if self.args.ds.enable_sleep:
            # --- OPPO change: the states' moves beside the other model's fit. ---
            if self.plan.sync.state_moves == "overlap" and self.critic_model_group is not None:
                return self._train_overlapping_state_moves(global_steps)  # --oppo.critic_catch_up too
            return super().ppo_train(global_steps)

        status: dict = {}
        run_critic = self.critic_model_group is not None
        run_actor = global_steps > self.args.critic.freezing_steps and self.actor_model_group is not None
        critic_refs, actor_refs = [], []
        if run_critic:
            critic_refs = self.critic_model_group.async_run_method(method_name="fit")
        if run_actor:
            actor_refs = self.actor_model_group.async_run_method(method_name="fit", kl_ctl=self.kl_ctl.value)
        # --- OPPO change: the critic's results first (upstream: one ray.get of both, in this order), then its
        # hook while the policy may still train. ---
        for result in ray.get(critic_refs):
            status.update(result)
        if run_critic and self.plan.stream.critic_catches_up_after_fit:
            status.update(self._critic_catch_up())
        for result in ray.get(actor_refs):
            status.update(result)
        return status

    def _critic_catch_up(self) -> dict:
        """The critic's weights are final: send it the chunks held through training. With ``--oppo.critic_catch_up
        next_batch``, once the next step's groups are all done, only theirs: the critic prefills a sequence again
        after each update of its weights, so the others' would be prefilled twice. They stay held until that
        step's ``make_experience`` sends those of its batch (an overdue group that took the place of one included)."""
        streams = None
        if self.plan.stream.critic_catch_up == "next_batch":
            streams = self.samples_generator.next_batch_streams()
        self.coordinator.catch_up("critic", streams)
        return {"oppo/critic_catch_up_batch_only": float(streams is not None)}

    def _train_overlapping_state_moves(self, global_steps) -> dict:
        """``--oppo.state_moves overlap``: upstream's ``ppo_train`` (0.11.2, its sleep-mode branch), COPIED, with
        the policy's states loaded while the critic trains and the critic's offloaded while the policy trains.
        With the critic streaming, its states start loading once its scores are in (``_prefetch_critic_states``),
        and with ``--oppo.critic_catch_up after_fit`` its held chunks go out after its fit; with the engines awake,
        the policy's states go back after the weight sync (``_offload_policy_states``).
        Upstream runs reload, fit, offload for one model, then for the other. ``patches/openrlhf/0010`` adds the
        hook that would retire this copy."""
        status: dict = {}
        waited = 0.0

        def wait_for_move(refs):
            nonlocal waited
            started = time.time()
            ray.get(refs)
            waited += time.time() - started

        critic, actor = self.critic_model_group, self.actor_model_group
        run_actor = global_steps > self.args.critic.freezing_steps and actor is not None
        wait_for_move(self.policy_offload)  # the last step's, started after its weight sync
        # --- OPPO change: the critic's states may have started loading when its scores were in. ---
        wait_for_move(self.critic_reload or critic.async_run_method(method_name="reload_states"))
        self.critic_reload, self.policy_offload = [], []
        critic_fit = critic.async_run_method(method_name="fit")
        # --- OPPO change: the policy's states load during the critic's fit (upstream: after its offload). ---
        actor_reload = actor.async_run_method(method_name="reload_states") if run_actor else []
        status.update(ray.get(critic_fit)[0])
        # --- OPPO change: the critic's states go back during the policy's fit (upstream: before its reload). ---
        critic_offload = critic.async_run_method(method_name="offload_states")
        if self.plan.stream.critic_catches_up_after_fit:
            # Its weights are final: its held chunks are scored beside the policy's fit (the calls queue behind the
            # offload, which leaves the weights on the GPU).
            status.update(self._critic_catch_up())
        if run_actor:
            wait_for_move(actor_reload)
            status.update(ray.get(actor.async_run_method(method_name="fit", kl_ctl=self.kl_ctl.value))[0])
            # --- OPPO change: with the engines awake, the weight sync reads only the policy's weights, so its
            # states go back after the sync, beside the next step's start. Asleep engines wake up for the sync
            # and need the room first. ---
            if self.args.vllm.enable_sleep:
                wait_for_move(actor.async_run_method(method_name="offload_states"))
            else:
                self.policy_offload_due = True
        wait_for_move(critic_offload)
        status["oppo/state_moves_wait_s"] = waited
        return status

    def broadcast_to_vllm(self) -> None:
        """Upstream's weight sync, in buckets (``weight_sync.py``); with requests in flight the engines pause
        around it, or only to load the new weights that they received while decoding (``--oppo.weight_sync``).
        Upstream's ``fit`` calls it on resume too."""
        oppo = self.plan
        self.policy_version += 1
        with self.tracer.span("weight_sync", track="trainer"), phase("syncing the weights to vLLM"):
            self.weight_sync_metrics = self.coordinator.sync_weights(
                super().broadcast_to_vllm,
                staged=self.plan.staged_sync,
                pause=oppo.inter_step and not oppo.sync.vllm_sleeps,
                clear_cache=oppo.carry.kv == "recompute",
                weight_version=self.policy_version,
            )
        self._offload_policy_states()

    def _prefetch_critic_states(self) -> None:
        """``--oppo.state_moves overlap``: the step's critic scores are in (the critic has nothing more to score
        until the next step), so its states load while the policy's log-probs and the advantages are computed."""
        self.critic_reload = self.critic_model_group.async_run_method(method_name="reload_states")

    def _offload_policy_states(self) -> None:
        """``--oppo.state_moves overlap`` with the engines awake: the policy's states go back once the weights are
        synced; the next step's first call to the policy queues behind the move, the scorers' catch-up does not."""
        if self.policy_offload_due:
            self.policy_offload_due = False
            self.policy_offload = self.actor_model_group.async_run_method(method_name="offload_states")

    # -- checkpoints ------------------------------------------------------------------------------------

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        if client_states is not None:
            # Upstream saves the episode its loop is in. After the step that ends it, the dataloader's state
            # starts the next epoch, so a resume must start the next episode too, or the epoch trains twice.
            client_states["episode"] = self.samples_generator.episodes_done
        if client_states is not None and self.plan.inter_step:
            client_states["overcommit_sampler"] = self.samples_generator.state_dict()
        with phase("saving the logs and checkpoints"):
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        self.samples_generator.episodes_done = states["episode"]
        if "overcommit_sampler" in states and self.plan.inter_step:
            self.samples_generator.load_state_dict(states["overcommit_sampler"])
        return states


def scorer_metrics(stats: dict) -> dict:
    """The scoring actors' counters as ``oppo/*`` metrics: for each, the role that holds most (summed over
    its ranks), since every role holds one entry per sequence streamed to it.

    ``scores_waiting``: finished sequences whose scores wait to be collected: the carried groups' samples;
    a count that grows step after step is a leak, as is ``score_tombstones`` (discarded sequences whose last
    chunk has not landed). ``scorer_cached_gb``: KV caches of sequences still streaming. ``scorer_evictions``:
    sequences that lost their cache to ``--oppo.cache_budget_gb`` since the start (scored in full at the end).
    ``scorer_busy_s``: seconds the busiest scorer spent in prefill calls since the last step; ``busy_s/<role>``:
    the same for that role's busiest rank (for the policy under ``--oppo.policy_logprobs vllm``, the busiest
    engine's time scoring its log-probs). ``streaming_off/<role>``: 1 once a rank of that role ran out of GPU
    memory in a prefill and stopped streaming (its micro-batches are scored after generation from then on).
    """

    def most(value):
        return float(max(sum(value(rank) for rank in ranks) for ranks in stats.values()))

    busy = {role: max(sum(seconds for _, seconds, _ in rank.calls) for rank in ranks) for role, ranks in stats.items()}
    return {
        "oppo/scores_waiting": most(lambda rank: rank.waiting),
        "oppo/score_tombstones": most(lambda rank: rank.tombstones),
        "oppo/scorer_cached_gb": most(lambda rank: rank.cached_bytes) / 2**30,
        "oppo/scorer_evictions": most(lambda rank: rank.evictions),
        "oppo/scorer_busy_s": float(max(busy.values())),
        **{f"oppo/busy_s/{role}": float(seconds) for role, seconds in busy.items()},
        **{
            f"oppo/streaming_off/{role}": float(any(rank.streaming_off for rank in ranks))
            for role, ranks in stats.items()
        },
    }


def resource_metrics(readings: dict, cpu_seconds: dict) -> dict:
    """The memory and CPU time of every actor as ``oppo/memory/*`` and ``oppo/cpu/*`` metrics, for the rank
    that holds or uses most: ``<kind>_host_gb`` (resident host memory) for ``trainer`` (this process),
    ``rollout`` and each role, and, for the roles, ``<kind>_gpu_gb`` (allocated tensors: weights, optimizer
    states, the scorer's KV caches) and ``<kind>_gpu_reserved_gb`` (PyTorch's allocator), and
    ``<kind>_alloc_retries`` (times the allocator had to free its cache, since the start), and
    ``<kind>_<phase>_peak_gb``, the most the allocator reserved during that phase (generation, make_experience,
    training, weight_sync) since the start (``_peak_allocated_gb``: the tensors' own), what docs/memory.md compares
    the memory plan with, role by role. Over a long run, a
    value that keeps climbing is a leak. ``oppo/cpu/<kind>_s``: CPU seconds used since the last step (the
    rollout actor's include its vLLM engine core), to tell a host short of cores from a slow GPU.
    ``cpu_seconds`` holds each actor's total from the last step and is updated here.
    """
    readings = dict(readings, trainer=[ResourceReading.of_this_process()])
    metrics = {}
    for kind, per_rank in readings.items():
        metrics[f"oppo/memory/{kind}_host_gb"] = max(r.host_bytes for r in per_rank) / 2**30
        if kind in ROLES:
            metrics[f"oppo/memory/{kind}_gpu_gb"] = max(r.gpu_allocated_bytes for r in per_rank) / 2**30
            metrics[f"oppo/memory/{kind}_gpu_reserved_gb"] = max(r.gpu_reserved_bytes for r in per_rank) / 2**30
            metrics[f"oppo/memory/{kind}_alloc_retries"] = float(max(r.gpu_alloc_retries for r in per_rank))
            for phase in sorted({phase for r in per_rank for phase in r.phase_peaks}):
                allocated, reserved = (max(r.phase_peaks.get(phase, (0, 0))[i] for r in per_rank) for i in (0, 1))
                metrics[f"oppo/memory/{kind}_{phase}_peak_gb"] = reserved / 2**30
                metrics[f"oppo/memory/{kind}_{phase}_peak_allocated_gb"] = allocated / 2**30
        used = [max(r.cpu_s - cpu_seconds.get((kind, i), 0.0), 0.0) for i, r in enumerate(per_rank)]
        metrics[f"oppo/cpu/{kind}_s"] = max(used)
        cpu_seconds.update({(kind, i): r.cpu_s for i, r in enumerate(per_rank)})
    return metrics


OPPOTrainerRayActor = ray.remote(OPPOTrainer)
