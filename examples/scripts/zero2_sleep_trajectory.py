"""Does moving a ZeRO-2 policy's DeepSpeed states off the GPU and back between steps change its training?

Colocated runs (``--train.colocate_all --ds.enable_sleep``) move the optimizer states, gradients and fp32
master weights to the host after each training phase and back before the next, through OpenRLHF's
``offload_deepspeed_states`` and ``reload_deepspeed_states``. This trains two copies of one small Qwen2 model
with ZeRO-2, bf16 and AdamW on the same batches, one of them moved out and back around every step as
OpenRLHF does, and prints per step how far apart their weights and Adam moments are (0 means the same to the
bit), and how far training has moved the weights.

    python examples/scripts/zero2_sleep_trajectory.py [--steps 12] [--lr 5e-5]

On a GPU it runs OpenRLHF's functions. On a CPU (DeepSpeed's CPU accelerator) there is nothing to move, so it
calls DeepSpeed's ``offload_states``/``reload_states`` directly, which only checks that they run.
"""

import argparse
import copy
import os

import deepspeed
import torch
from openrlhf.utils.deepspeed.deepspeed_utils import (
    get_train_ds_config,
    offload_deepspeed_states,
    reload_deepspeed_states,
)
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB, BATCH, LENGTH = 512, 4, 64


def engine(base, lr):
    config = get_train_ds_config(
        offload=False,
        adam_offload=False,
        stage=2,
        param_dtype="bf16",
        max_norm=1.0,
        optim_config={"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
    )
    config.update(train_micro_batch_size_per_gpu=BATCH, train_batch_size=BATCH)
    model = copy.deepcopy(base)
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)[0]


def train_step(model, step, device):
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(100 + step)).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    model.step()
    return loss.item()


def largest_gap(xs, ys):
    return max((x.float().cpu() - y.float().cpu()).abs().max().item() for x, y in zip(xs, ys))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=5e-5)
    args = parser.parse_args()
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    offload = offload_deepspeed_states if on_gpu else lambda model: model.optimizer.offload_states()
    reload = reload_deepspeed_states if on_gpu else lambda model: model.optimizer.reload_states()

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    base = Qwen2ForCausalLM(config).to(torch.bfloat16)
    kept, moved = engine(base, args.lr), engine(base, args.lr)
    print(f"ZeRO-{kept.zero_optimization_stage()}, {type(kept.optimizer.optimizer).__name__}, on {device}")
    offload(moved)  # OpenRLHF moves the states out right after the model is set up
    for step in range(args.steps):
        reload(moved)
        loss_kept, loss_moved = train_step(kept, step, device), train_step(moved, step, device)
        weights = largest_gap(kept.module.parameters(), moved.module.parameters())
        travelled = largest_gap(kept.module.parameters(), base.parameters())
        moments = largest_gap(
            [s["exp_avg"] for s in kept.optimizer.optimizer.state.values()],
            [s["exp_avg"] for s in moved.optimizer.optimizer.state.values()],
        )
        print(
            f"step {step}: loss {loss_kept:.5f} kept, {loss_moved:.5f} moved | largest gap: weights {weights:.1e}, "
            f"Adam first moments {moments:.1e} | weights moved by training up to {travelled:.1e}",
            flush=True,
        )
        offload(moved)  # OpenRLHF sends the bf16 weights to vLLM, then moves the states out until the next step


if __name__ == "__main__":
    main()
