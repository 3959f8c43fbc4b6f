"""The benchmark harness's runs on CPU: ``CPURunner`` stands in for ``bench.__main__.run_system``.

On GPUs each run is a ``train_ppo_ray`` process. Here the same flags go through the same parser
(``bench.driver.parse_args``: upstream's options and OPPO's checks), and the run is OpenRLHF's trainer
(upstream's ``PPOTrainer`` as the CLI runs it, ``upstream_trainer.UpstreamPPOTrainer``, for upstream sync;
``OPPOTrainerRayActor`` for OPPO) driven by ``CPUPipeline``: a real vLLM
engine with the run's rule reward, the model groups upstream would build, and the CPU stand-in for DeepSpeed
training (the weights do not change). A run goes through every prompt of its dataset; the result has the
fields that ``run_system`` records and the reports read.
"""

import os
import time

import ray

from openrlhf_oppo.bench import report
from openrlhf_oppo.testing import cpu_pipeline


class CPURunner:
    """``runner(name, flags, args) -> result``. One engine for every run, started with the first run's policy
    checkpoint, rule reward and seed; each run gets fresh model actors, and the engine back at weight version 0."""

    SYSTEMS = ("upstream-sync", "oppo", "oppo-intra", "oppo-inter", "oppo-both", "oppo-both-keep")  # no async trainer

    def __init__(self):
        self.engine = None

    def __call__(self, name: str, flags: list, args) -> dict:
        from openrlhf_oppo.bench.driver import parse_args
        from openrlhf_oppo.trainer import OPPOTrainerRayActor
        from openrlhf_oppo.upstream_trainer import UpstreamPPOTrainer

        if not any(name.startswith(system + "-") for system in self.SYSTEMS):
            raise ValueError(f"{name}: the CPU runner runs {', '.join(self.SYSTEMS)}")
        ppo = parse_args(flags)
        actor, reward = ppo.actor.model_name_or_path, ppo.reward.model_name_or_path
        if self.engine is None:
            self.engine = cpu_pipeline.start_engine(
                actor,
                ppo.data.max_len,
                seed=ppo.train.seed,
                lengths_from_label=False,
                remote_rm_url=ppo.reward.remote_url,
            )
        pipeline = cpu_pipeline.CPUPipeline(ppo, actor, reward, [self.engine], roles=cpu_pipeline.upstream_roles(ppo))
        started = time.time()
        try:
            pipeline.run_ppo(OPPOTrainerRayActor if ppo.oppo.enable else UpstreamPPOTrainer)  # as the CLI runs them
        finally:
            pipeline.coordinator.resume(0, resume=False)
            pipeline.kill()
        steps = report.read_steps(os.path.join(ppo.logger.tensorboard_dir, name))
        return dict(
            flags=flags, returncode=0, wall_s=time.time() - started, steps=steps, summary=report.summarize(steps)
        )

    def close(self):
        if self.engine is not None:
            ray.kill(self.engine)
            self.engine = None
