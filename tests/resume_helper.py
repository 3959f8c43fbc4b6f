"""Run by test_overcommit in a fresh interpreter: resume the overcommit sampler from a checkpoint file,
attached to the test session's Ray cluster and engine, run the epoch to its end and write the prompts
trained after the resume (one per group) to a JSON file.

usage: resume_helper.py CHECKPOINT PROMPTS OUT ACTOR_PATH REWARD_PATH
"""

import json
import os
import sys
import tempfile

import ray
import torch


def main(checkpoint, prompts, out, actor, reward):
    from conftest import ENGINE_NAME, NAMESPACE, PPO_FLAGS
    from test_overcommit import groups_of

    from openrlhf_oppo.testing import cpu_pipeline

    # The test session's cluster (others may run on the same machine): ``RAY_ADDRESS``, set by the test.
    ray.init(address=os.environ["RAY_ADDRESS"], namespace=NAMESPACE, log_to_driver=False)
    args = cpu_pipeline.ppo_args(tempfile.mkdtemp(), actor, reward, *PPO_FLAGS)
    pipeline = cpu_pipeline.CPUPipeline(args, actor, reward, [ray.get_actor(ENGINE_NAME)], with_models=False)
    loader = cpu_pipeline.prompt_dataloader(prompts, args, pipeline.tokenizer)
    generator = pipeline.samples_generator(loader, "overcommit", delta=3)
    state = torch.load(checkpoint, weights_only=False)
    loader.load_state_dict(state["dataloader"])
    generator.load_state_dict(state["sampler"])
    trained = []
    while True:
        samples, _, _, exhausted = generator.generate_samples(**pipeline.generate_kwargs())
        trained += list(groups_of(samples))
        if exhausted:
            break
    json.dump(trained, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
