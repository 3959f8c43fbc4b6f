"""A plain copy of a ZeRO-3 model's full weights, for streamed prefill.

Under ZeRO-3 (``--ds.zero_stage 3``) DeepSpeed's forward hooks all-gather each layer from every rank, so all
ranks must run the same forwards together; but a scoring model's ranks stream different sequences at different
times. Their ``ChunkScorer`` runs on an ``InferenceCopy`` instead: a module of the same class with the full
weights and no hooks. It is gathered once per weight version (at set-up and after each ``fit`` of the policy
and the critic, which upstream calls on every rank together, so the all-gathers line up).

Memory: one full bf16 copy per rank beside its shard (``2 * parameters`` bytes), gathered one parameter at a
time. Only the critic and the policy need it: the frozen models load unsharded when they stream (``actors.py``).
"""

import copy
import itertools
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from openrlhf.utils.logging_utils import init_logger

logger = init_logger(__name__)


def is_partitioned(model: torch.nn.Module) -> bool:
    """Whether ZeRO-3 shards ``model``'s parameters (it tags each one with a ``ds_id``)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


class InferenceCopy:
    """The full weights of a ZeRO-3 module, in a plain module of the same class on this rank's device.

    Works for any module its class builds from its ``config`` alone (HF causal LMs, the value-head models of
    ``get_llm_for_sequence_regression``). ZeRO-3 does not shard buffers (``mean``/``std``, rotary frequencies):
    they are copied as they are.

    Args:
        source: the module whose parameters ZeRO-3 shards (the DeepSpeed engine's ``module``).
        name: what the log line calls it.
    """

    def __init__(self, source: torch.nn.Module, name: str = "model"):
        self.source = source
        started = time.perf_counter()
        device = torch.device(get_accelerator().current_device_name())
        self.module = _empty_copy(source, device)
        self.refresh()
        logger.info(
            f"ZeRO-3: streamed prefill of the {name} runs on a full copy of its weights: "
            f"{self.nbytes() / 2**30:.2f} GiB on {device}, gathered in {time.perf_counter() - started:.1f} s"
        )

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the source's current weights in. A collective: every rank of the model must call it, a rank whose
        copy was released too (it joins the gathers and copies nothing)."""
        if self.module is None:  # released: the other ranks' gathers wait for this rank's share
            for parameter in self.source.parameters():
                with deepspeed.zero.GatheredParameters([parameter]):
                    pass
            return
        targets = dict(self.module.named_parameters())
        for name, parameter in self.source.named_parameters():  # the same order on every rank
            with deepspeed.zero.GatheredParameters([parameter]):
                targets[name].copy_(parameter)
        targets = dict(self.module.named_buffers())
        for name, buffer in self.source.named_buffers():
            targets[name].copy_(buffer)

    def release(self) -> None:
        """Free the copy (its scorer streams no more); ``refresh`` still takes part in the other ranks' gathers."""
        self.module = None

    def nbytes(self) -> int:
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)


def _empty_copy(source: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A module of ``source``'s class, built on the meta device (no memory, no init), then given uninitialised
    tensors of each source parameter's full shape and dtype. Parameters shared in the source (tied embeddings)
    stay shared."""
    with torch.device("meta"):
        module = type(source)(copy.deepcopy(source.config))
    module.requires_grad_(False)
    made = {}  # id(source tensor) -> its copy

    def empty_like(tensor, shape, parameter):
        if id(tensor) not in made:
            empty = torch.empty(shape, dtype=tensor.dtype, device=device)
            made[id(tensor)] = torch.nn.Parameter(empty, requires_grad=False) if parameter else empty
        return made[id(tensor)]

    originals = list(source.named_modules(remove_duplicate=False))
    targets = list(module.named_modules(remove_duplicate=False))
    if [path for path, _ in originals] != [path for path, _ in targets]:
        raise RuntimeError(f"{type(source).__name__} built from its config has other modules than the loaded model")
    for (_, original), (_, target) in zip(originals, targets):
        for name, parameter in original._parameters.items():
            if parameter is not None:
                shape = getattr(parameter, "ds_shape", parameter.shape)  # ZeRO-3 keeps the full shape there
                target._parameters[name] = empty_like(parameter, shape, parameter=True)
        for name, buffer in original._buffers.items():
            if buffer is not None:
                target._buffers[name] = empty_like(buffer, buffer.shape, parameter=False)
        for name, value in vars(target).items():  # tensors kept as plain attributes
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(target, name, getattr(original, name).to(device, copy=True))
    if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())) or is_partitioned(module):
        raise RuntimeError(f"could not build a plain copy of {type(source).__name__} from its config")
    return module.eval()
