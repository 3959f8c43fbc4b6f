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

    from openrlhf_oppo import tiny
    from openrlhf_oppo.testing import cpu_pipeline

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    actor, reward = tiny.make_checkpoints(os.path.join(workdir, "models"))
    prompts = os.path.join(workdir, "prompts.jsonl")
    tiny.write_prompts(prompts, [5, 7, 6, 9, 4, 8, 5, 6], seed=12)
    args = cpu_pipeline.ppo_args(
        workdir, actor, reward,
        "--data.prompt_dataset", prompts,
        "--data.max_len", "64",
        "--rollout.batch_size", "2",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", "4",
        "--train.batch_size", "4",
        "--train.micro_batch_size", "2",
        "--train.num_episodes", "100",  # runs until the head stops
        "--oppo.enable", "--oppo.overcommit", "1", "--oppo.chunk_size", "4",
    )  # fmt: skip
    engine = cpu_pipeline.start_engine(actor, MAX_LEN)
    pipeline = cpu_pipeline.CPUPipeline(args, actor, reward, [engine])
    pipeline.run_ppo(_marking_trainer(marker))


if __name__ == "__main__":
    main(*sys.argv[1:])
