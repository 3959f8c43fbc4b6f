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
