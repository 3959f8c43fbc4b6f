"""OPPO's PPO trainer: upstream's ``PPOTrainer`` with OPPO's samples generator and experience maker.

Upstream builds its ``SamplesGenerator`` and ``RemoteExperienceMaker`` inside the trainer actor, so
they are replaced here, after ``super().__init__``. The rest of the step is upstream's; this class adds
the set-up of streaming (once the models are loaded), the weight-sync protocol for requests that
outlive a step, the chunk-size and overcommit controllers, checkpointing of carried prompts, and the
``oppo/*`` metrics and traces.
"""

import os
import time

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
from openrlhf.utils.logging_utils import init_logger

from openrlhf_oppo.config import describe
from openrlhf_oppo.overcommit.controller import OvercommitController
from openrlhf_oppo.overcommit.sampler import OvercommitSamplesGenerator
from openrlhf_oppo.samples import OPPOSamplesGenerator
from openrlhf_oppo.streaming.chunking import ChunkSizeController
from openrlhf_oppo.streaming.experience import StreamingExperienceMaker
from openrlhf_oppo.trace import Tracer, write_trace

logger = init_logger(__name__)


class OPPOTrainer(PPOTrainer.__ray_actor_class__):
    def __init__(
        self,
        pretrain,
        strategy,
        actor_model_group,
        critic_model_group,
        reward_model_group,
        reference_model_group,
        vllm_engines,
        **generate_kwargs,
    ):
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
        oppo = self.args.oppo
        logger.info(describe(self.args))
        self.tracer = Tracer(enabled=oppo.trace_dir is not None, process="trainer")
        self.policy_version = 0
        self.chunk_controller = ChunkSizeController(fixed=None if oppo.chunk_size == "auto" else oppo.chunk_size)
        self.scorer_groups = {
            "reward": reward_model_group,
            "critic": critic_model_group,
            "ref": reference_model_group,
            "actor": actor_model_group,
        }
        self.samples_generator = self._make_samples_generator(strategy, vllm_engines)
        if oppo.streamed_models:
            self.experience_maker = StreamingExperienceMaker(
                actor_model_group,
                critic_model_group,
                reward_model_group,
                reference_model_group,
                self.kl_ctl,
                strategy,
                self.tokenizer,
                streamed_models=oppo.streamed_models,
                vllm_engines=vllm_engines,
                tracer=self.tracer,
            )

    def _make_samples_generator(self, strategy, vllm_engines):
        oppo, args = self.args.oppo, self.args
        kwargs = dict(
            strategy=strategy,
            prompts_dataloader=self.prompts_dataloader,
            eval_dataloader=self.eval_dataloader,
            tokenizer=self.tokenizer,
            vllm_engines=vllm_engines,
            tracer=self.tracer,
        )
        if not oppo.inter_step:
            return OPPOSamplesGenerator(**kwargs)
        controller = OvercommitController(
            initial=oppo.overcommit_initial,
            auto=oppo.overcommit == "auto",
            window=oppo.overcommit_window,
            inc=oppo.overcommit_inc,
            dec=oppo.overcommit_dec,
            minimum=oppo.overcommit_min,
            maximum=oppo.overcommit_max,
        )
        return OvercommitSamplesGenerator(
            **kwargs,
            controller=controller,
            max_defer_steps=oppo.max_defer_steps,
            pause_between_steps=args.train.colocate_all and not args.vllm.enable_sleep,
            top_up_at_step_end=oppo.top_up == "step_end",
        )

    # -- set-up once the models are loaded ----------------------------------------------------

    def fit(self, global_step: int = 0) -> None:
        self._connect_streaming()
        super().fit(global_step)

    def _connect_streaming(self) -> None:
        oppo = self.args.oppo
        scorers = {}
        for name in oppo.streamed_models:
            group = self.scorer_groups[name]
            ray.get(
                group.async_run_method(
                    method_name="oppo_setup",
                    cache_budget_bytes=int(oppo.cache_budget_gb * 2**30),
                    temperature=self.args.rollout.temperature,
                    trace=self.tracer.enabled,
                )
            )
            scorers[name] = group._actor_handlers  # noqa: SLF001 - RayActorGroup exposes no accessor
        ray.get(
            [
                engine.oppo_connect.remote(scorers, self.chunk_controller.chunk_size, salt_prompts=oppo.inter_step)
                for engine in self.vllm_engines
            ]
        )

    # -- one step -----------------------------------------------------------------------------------

    def train_step(self, rollout_samples, global_step):
        step_start = time.time()
        lag = self._policy_lag(rollout_samples)  # before this step's update bumps the version
        discarded = self._discard_dropped()
        status, global_step = super().train_step(rollout_samples, global_step)
        self.tracer.add("make_experience", step_start, step_start + status["timing/make_experience"], track="trainer")
        status.update(lag)
        status.update(discarded)
        status.update(self._oppo_metrics(status))
        if self.tracer.enabled:
            self._write_trace(global_step)
        return status, global_step

    def _policy_lag(self, rollout_samples) -> dict:
        """How many weight versions the first token of each sample is behind the policy it trains (0: on-policy)."""
        firsts = [s.oppo["first_version"] for s in rollout_samples if getattr(s, "oppo", None)]
        lags = [self.policy_version - v for v in firsts if v is not None]
        if not lags:
            return {}
        return {"oppo/policy_lag_mean": sum(lags) / len(lags), "oppo/policy_lag_max": float(max(lags))}

    def _discard_dropped(self) -> dict:
        """Free the scores of the streamed sequences that training will not see (dropped by dynamic filtering,
        or replaced by a ``-full`` stream): nothing else would, and the critic and policy would re-score
        them after every weight update."""
        dropped = self.samples_generator.take_dropped()
        if not self.args.oppo.streamed_models:
            return {}
        self.experience_maker.discard(dropped)
        return {"oppo/discarded_sequences": float(len(dropped))}

    def _oppo_metrics(self, status) -> dict:
        metrics = dict(getattr(self.experience_maker, "metrics", {}))
        metrics.update(getattr(self.samples_generator, "metrics", {}))
        if isinstance(self.samples_generator, OvercommitSamplesGenerator):
            self.samples_generator.record_reward(status["rollout/reward_mean"])
        if self.args.oppo.streamed_models:
            stats = self._scorer_stats()
            metrics.update(self._update_chunk_size(stats))
            metrics.update(_waiting_scores(stats))
        return metrics

    def _scorer_stats(self) -> dict:
        """Model name -> ``oppo_stats`` of each rank (which drains the prefill calls: once a step)."""
        refs = {
            name: self.scorer_groups[name].async_run_method(method_name="oppo_stats")
            for name in self.args.oppo.streamed_models
        }
        return {name: ray.get(ranks) for name, ranks in refs.items()}

    def _update_chunk_size(self, stats: dict) -> dict:
        calls_by_scorer = {}
        for name, ranks in stats.items():
            for rank, rank_stats in enumerate(ranks):
                calls_by_scorer[f"{name}:{rank}"] = rank_stats["calls"]
        before = self.chunk_controller.chunk_size
        after = self.chunk_controller.update(calls_by_scorer, self.samples_generator.last_generation_s)
        if after != before:
            ray.get([engine.oppo_set_chunk_size.remote(after) for engine in self.vllm_engines])
        metrics = {"oppo/chunk_size": float(before)}
        if self.chunk_controller.utilization:
            metrics["oppo/scorer_utilization_max"] = max(self.chunk_controller.utilization.values())
        return metrics

    def ppo_train(self, global_steps):
        with self.tracer.span("ppo_train", track="trainer"):
            return super().ppo_train(global_steps)

    def broadcast_to_vllm(self) -> None:
        """Upstream's weight sync; with requests in flight, paused around it (``--oppo.carry_kv``)."""
        oppo = self.args.oppo
        self.policy_version += 1
        pause = oppo.inter_step and not self.args.vllm.enable_sleep
        with self.tracer.span("weight_sync", track="trainer"):
            if pause:
                batch_vllm_engine_call(self.vllm_engines, "oppo_pause", clear_cache=oppo.carry_kv == "recompute")
            try:
                super().broadcast_to_vllm()
            finally:
                # A sleeping engine resumes when it wakes up; it only learns the version here.
                batch_vllm_engine_call(
                    self.vllm_engines, "oppo_resume", weight_version=self.policy_version, resume=pause
                )

    # -- checkpoints and traces ---------------------------------------------------------------------

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        if client_states is not None:
            # Upstream saves the episode its loop is in. After the step that ends it, the dataloader's state
            # starts the next epoch, so a resume must start the next episode too, or the epoch trains twice.
            client_states["episode"] = self.samples_generator.episodes_done
        if client_states is not None and isinstance(self.samples_generator, OvercommitSamplesGenerator):
            client_states["oppo_carry"] = self.samples_generator.state_dict()
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        self.samples_generator.episodes_done = states["episode"]
        if "oppo_carry" in states and isinstance(self.samples_generator, OvercommitSamplesGenerator):
            self.samples_generator.load_state_dict(states["oppo_carry"])
        return states

    def _write_trace(self, global_step: int) -> None:
        refs = [engine.oppo_drain_trace.remote() for engine in self.vllm_engines]
        for name in self.args.oppo.streamed_models:
            refs += self.scorer_groups[name].async_run_method(method_name="oppo_drain_trace")
        events = self.tracer.drain()
        for part in ray.get(refs):
            events.extend(part)
        write_trace(os.path.join(self.args.oppo.trace_dir, f"step_{global_step:05d}.json"), events)


def _waiting_scores(stats: dict) -> dict:
    """Finished sequences whose scores wait in the scoring actors after the step, counted for the model
    that holds most (summed over its ranks; each model holds one entry per sequence streamed to it).

    Samples of carried groups wait there until a later step trains them; a count that grows step after
    step is a leak. ``score_tombstones``: discarded sequences whose last chunk had not landed yet.
    ``cached_bytes``: the KV cache held for streamed sequences (bounded by ``--oppo.cache_budget_gb``).
    """

    def most(key):
        return float(max(sum(rank[key] for rank in ranks) for ranks in stats.values()))

    return {
        "oppo/scores_waiting": most("waiting"),
        "oppo/score_tombstones": most("tombstones"),
        "oppo/cached_bytes": most("cached_bytes"),
    }


OPPOTrainerRayActor = ray.remote(OPPOTrainer)
