"""Awake colocated engines are up before the driver loads the models beside them."""

import asyncio
import os
from types import SimpleNamespace

import pytest
import ray

from openrlhf_oppo.trainer import wait_for_awake_colocated_engines


@ray.remote
class _SlowStartingEngine:
    """Starts as a vLLM engine does: its creation task returns only once the engine is up."""

    async def __init__(self, marker: str):
        await asyncio.sleep(3)
        open(marker, "w").close()


def _args(colocate_all: bool, sleep: bool):
    return SimpleNamespace(train=SimpleNamespace(colocate_all=colocate_all), vllm=SimpleNamespace(enable_sleep=sleep))


@pytest.mark.parametrize("colocate_all,sleep,waits", [(True, False, True), (True, True, False), (False, False, False)])
def test_the_trainer_waits_for_awake_colocated_engines(ray_session, tmp_path, colocate_all, sleep, waits):
    marker = str(tmp_path / "up")
    engine = _SlowStartingEngine.remote(marker)
    try:
        wait_for_awake_colocated_engines(_args(colocate_all, sleep), [engine])
        # Sleeping engines were waited for by upstream already; engines on GPUs of their own need no wait.
        assert os.path.exists(marker) == waits
    finally:
        ray.kill(engine)


@pytest.mark.engine
def test_engine_arguments_a_tool_sets_reach_vllm(ray_session, checkpoints):
    """``extension.set_engine_kwargs`` (the benchmark driver's ``--bench.kv_cache_gb``): the rollout actor starts
    vLLM with them over upstream's, here a KV cache of 48 MiB where upstream's arguments asked for 64."""
    from openrlhf_oppo import extension
    from openrlhf_oppo.testing.cpu_pipeline import CPURolloutActor, engine_kwargs

    saved = extension._engine_kwargs
    extension.set_engine_kwargs(kv_cache_memory_bytes=48 << 20)
    try:
        config = vars(extension._rollout_config())
    finally:
        extension._engine_kwargs = saved
    engine = CPURolloutActor.options(num_cpus=0, num_gpus=0).remote(
        **engine_kwargs(checkpoints["actor"], 128, kv_cache_mb=64), oppo_config=config
    )
    try:
        size = ray.get(
            engine.__ray_call__.remote(lambda actor: actor.llm.vllm_config.cache_config.kv_cache_memory_bytes)
        )
        assert size == 48 << 20
    finally:
        ray.kill(engine)
