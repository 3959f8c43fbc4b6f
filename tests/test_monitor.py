"""The benchmark samples only its own GPUs (CUDA_VISIBLE_DEVICES), so that several benchmarks can share a machine."""

from openrlhf_oppo.bench.monitor import visible_gpus


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus(4) == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-482c0a46")  # UUIDs: NVML indices unknown, sample all
    assert visible_gpus(2) == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(3) == [0, 1, 2]
