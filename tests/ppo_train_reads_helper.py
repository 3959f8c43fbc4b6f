"""Run by test_patches in a fresh interpreter, upstream's or the patched one: OpenRLHF's actor and critic
``ppo_train`` (with their real ``training_step``, losses and tiny models, on CPU) fit one replay buffer of 4 and
one of 8 micro-batches. Prints, as JSON, each fit's status, OpenRLHF's own reads of tensors to the host during the
fit (on a GPU, each read waits for the GPU to finish) and the weights' sums after it.

A one-rank stand-in for DeepspeedStrategy makes the strategy's calls (DeepSpeed is not needed to count reads).

usage: ppo_train_reads_helper.py ACTOR_PATH CRITIC_PATH
"""

import json
import os
import sys

import torch

MICRO_BATCH, ACCUMULATION = 2, 2


class OneRankStrategy:
    """DeepspeedStrategy's calls that ppo_train and training_step make, for one CPU rank: DeepSpeed's optimizer
    steps every ACCUMULATION micro-batches, and keeps the gradient norm of the last step as a tensor."""

    ring_attn_group = None
    accumulated_gradient = ACCUMULATION

    def __init__(self, args):
        self.args, self.calls, self.norms = args, {}, {}

    def is_rank_0(self):
        return True

    def all_reduce(self, data, op="mean"):
        return {k: self.all_reduce(v, op) for k, v in data.items()} if isinstance(data, dict) else data

    def backward(self, loss, model, optimizer):
        (loss / ACCUMULATION).backward()

    def optimizer_step(self, optimizer, model, scheduler, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] % ACCUMULATION == 0:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.norms[id(model)] = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

    def get_grad_norm(self, model, as_tensor=False):
        norm = self.norms.get(id(model), torch.tensor(0.0))
        return norm if as_tensor else norm.item()


def experiences(count, seed):
    """A batch as the experience maker hands it to the replay buffer: right-padded responses of 1-9 tokens, with
    per-sample info for the logs."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    generator = torch.Generator().manual_seed(seed)
    prompt, response = 5, 9
    lengths = torch.randint(1, response + 1, (count,), generator=generator)
    action_mask = torch.arange(response)[None, :] < lengths[:, None]
    attention_mask = torch.cat([torch.ones(count, prompt, dtype=torch.long), action_mask.long()], dim=1)
    sequences = torch.randint(1, 2000, attention_mask.shape, generator=generator) * attention_mask

    def step_tensor():
        return torch.randn(count, response, generator=generator) * action_mask

    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=step_tensor() - 3,
        base_action_log_probs=step_tensor() - 3,
        values=step_tensor(),
        returns=step_tensor(),
        advantages=step_tensor(),
        rewards=torch.randn(count, generator=generator),
        response_length=lengths.float(),
        total_length=(lengths + prompt).float(),
        info={"reward": torch.randn(count, generator=generator), "response_length": lengths.float()},
    )


def trainer(cls, model, args, micro_batches, *before_optimizer):
    """The trainer as the model actor builds it, on CPU (no vLLM engines, no process group), with a replay buffer
    of ``micro_batches`` micro-batches."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.trainer.ray.ppo_critic as ppo_critic
    from transformers.optimization import get_constant_schedule

    ppo_actor.torch_dist_barrier_and_cuda_sync = ppo_critic.torch_dist_barrier_and_cuda_sync = lambda: None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_constant_schedule(optimizer)
    made = cls(
        OneRankStrategy(args), model, *before_optimizer, optimizer, scheduler, micro_train_batch_size=MICRO_BATCH
    )
    made.dataloader_pin_memory = False  # no GPU to pin for
    made.replay_buffer.append(experiences(MICRO_BATCH * micro_batches, seed=1))
    return made


def host_reads(fit):
    """Run fit() counting OpenRLHF's own reads of tensors to the host (on a GPU, each one waits for it)."""
    counts = {"reads": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__bool__")}

    def counting(original):
        def read(self, *args):
            caller = sys._getframe(1).f_code.co_filename
            counts["reads"] += f"{os.sep}openrlhf{os.sep}" in caller
            return original(self, *args)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        status = fit()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return status, counts["reads"]


def fit(micro_batches):
    """A fresh actor and critic (same seed) fit a buffer of ``micro_batches`` micro-batches."""
    from openrlhf.models import Actor, get_llm_for_sequence_regression
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.trainer.ray.ppo_critic import CriticPPOTrainer

    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    argv = ["--actor.model_name_or_path", ACTOR, "--reward.model_name_or_path", CRITIC, "--vllm.num_engines", "1"]
    args = parse_args(argv + ["--algo.kl.use_loss", "--algo.kl.init_coef", "0.01"])
    torch.manual_seed(0)
    torch.cuda.current_device = lambda: 0  # the replay buffers note a target device they never use here
    actor = Actor(ACTOR, attn_implementation="sdpa", param_dtype="fp32")
    actor = trainer(ActorPPOTrainer, actor, args, micro_batches, None)  # no EMA model
    critic = get_llm_for_sequence_regression(CRITIC, "critic", param_dtype="fp32", attn_implementation="sdpa")
    critic = trainer(CriticPPOTrainer, critic, args, micro_batches)
    torch.cuda.current_device = lambda: "cpu"  # ppo_train places the batches there
    actor_status, actor_reads = host_reads(lambda: actor.ppo_train(0.01))
    critic_status, critic_reads = host_reads(critic.ppo_train)
    weights = [float(p.detach().double().sum()) for model in (actor.actor, critic.critic) for p in model.parameters()]
    return dict(
        actor=actor_status, critic=critic_status, actor_reads=actor_reads, critic_reads=critic_reads, weights=weights
    )


if __name__ == "__main__":
    import openrlhf.utils.utils

    ACTOR, CRITIC = sys.argv[1], sys.argv[2]
    # OpenRLHF loads bf16 or fp16 only; float32 keeps the comparison with upstream's to float32's precision.
    to_dtype = openrlhf.utils.utils.convert_to_torch_dtype
    openrlhf.utils.utils.convert_to_torch_dtype = lambda name: torch.float32 if name == "fp32" else to_dtype(name)
    print(json.dumps({count: fit(count) for count in (4, 8)}))
