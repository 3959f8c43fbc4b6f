"""Run by test_faults in a fresh interpreter, with a Ray cluster of its own: OPPO's PPO on CPU (a real vLLM
engine, real scoring models, upstream's PPOTrainer.fit) that writes the number of each step to MARKER as the
step begins, so that the test can stop this cluster's head mid-step.

usage: head_stop_helper.py WORKDIR MARKER
"""

import os
import sys

import ray


def _marking_trainer(marker):
    """OPPOTrainer that writes each step's number to ``marker`` as it begins."""
    from openrlhf_oppo.trainer import OPPOTrainer

    class Marking(OPPOTrainer):
        def train_step(self, rollout_samples, global_step):
            with open(marker, "w") as f:
                f.write(str(global_step))
            return super().train_step(rollout_samples, global_step)

    return ray.remote(Marking)


def main(workdir, marker):
    from conftest import MAX_LEN
    from test_faults import fault_run_args

    from openrlhf_oppo import tiny
    from openrlhf_oppo.testing import cpu_pipeline

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    actor, reward = tiny.make_checkpoints(os.path.join(workdir, "models"))
    args = fault_run_args(workdir, actor, reward, "--train.num_episodes", "100")  # runs until the head stops
    engine = cpu_pipeline.start_engine(actor, MAX_LEN)
    pipeline = cpu_pipeline.CPUPipeline(args, actor, reward, [engine])
    pipeline.run_ppo(_marking_trainer(marker))


if __name__ == "__main__":
    main(*sys.argv[1:])
