"""Every system the benchmark compares is a valid train_ppo_ray command (upstream's parser and OPPO's checks)."""

import pytest
from openrlhf.utils import deepspeed

from openrlhf_oppo.bench.systems import SPLIT_ONLY, SYSTEMS, common_flags, system_flags
from openrlhf_oppo.cli.train_ppo_ray import parse_args


@pytest.mark.parametrize("placement,gpus", [("split", 2), ("split", 4), ("colocated", 1)])
@pytest.mark.parametrize("system", SYSTEMS)
def test_benchmark_system_is_a_valid_command(system, placement, gpus, monkeypatch):
    if system in SPLIT_ONLY and placement == "colocated":
        with pytest.raises(ValueError, match="GPUs of its own"):
            system_flags(system, placement, 16)
        return
    # --bench.seed_prompt_order swaps the strategy class; undo that after the test.
    monkeypatch.setattr(deepspeed, "DeepspeedStrategy", deepspeed.DeepspeedStrategy)
    flags = common_flags("/w", "/o", system, placement, gpus, 32, 1, 5, 4096, 64, 0, 2.0)
    args = parse_args(flags + system_flags(system, placement, 16))
    assert args.bench.lengths_from_label and args.bench.seed_prompt_order
    assert deepspeed.DeepspeedStrategy.__name__ == "SeededOrderStrategy"
    assert args.oppo.enable == system.startswith("oppo")
    assert args.train.async_enable == (system == "upstream-async")
    assert args.oppo.colocate_models == (placement == "split" and system != "upstream-async")
    if system.startswith("oppo"):
        assert args.oppo.inter_step == (system != "oppo-intra")
        assert args.oppo.top_up == ("step_end" if system == "oppo-both-early" else "step_start")
        assert bool(args.oppo.streamed_roles) == (system != "oppo-inter")
        # The frozen models go beside vLLM wherever they stream in the split placement.
        beside_vllm = placement == "split" and system not in ("oppo-inter", "oppo-both-frozen-with-models")
        assert args.oppo.frozen_scorers_on == ("generation" if beside_vllm else "models")
    if placement == "split":
        assert args.vllm.num_engines == gpus // 2 and args.actor.num_gpus_per_node == gpus // 2


def test_four_gpu_split_under_zero3_streams_every_role(monkeypatch):
    """examples/scripts/bench_4gpu_split.sh with ZERO=3: two engines, two ranks a model, ZeRO-3."""
    monkeypatch.setattr(deepspeed, "DeepspeedStrategy", deepspeed.DeepspeedStrategy)
    flags = common_flags("/w", "/o", "oppo-both", "split", 4, 64, 1, 5, 4096, 64, 0, 4.0)
    args = parse_args(flags + system_flags("oppo-both", "split", 32) + ["--ds.zero_stage", "3"])
    assert args.ds.zero_stage == 3 and args.oppo.streamed_roles == ["policy", "critic", "reward", "reference"]
    assert args.oppo.frozen_scorers_on == "generation" and args.reward.num_gpus_per_node == 2
