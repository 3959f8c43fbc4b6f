"""The benchmark samples only its own GPUs (CUDA_VISIBLE_DEVICES), so that several benchmarks can share a machine,
and the host's busy CPU cores."""

import statistics
import subprocess
import sys
import time

from openrlhf_oppo.bench.monitor import GPUMonitor, visible_gpus


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus(4) == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-482c0a46")  # UUIDs: NVML indices unknown, sample all
    assert visible_gpus(2) == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(3) == [0, 1, 2]


def test_host_cpu_samples_count_the_busy_cores():
    """Without NVML (this CPU machine) the monitor still samples the host's CPU: a process spinning one core
    for a second shows as about one core busy on top of what the machine was doing before."""
    with GPUMonitor(interval_s=0.1) as idle:
        time.sleep(1.0)
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    )
    with GPUMonitor(interval_s=0.1) as busy:
        time.sleep(1.0)
    spinner.wait()
    assert idle.samples == [] and len(busy.cpu_samples) >= 5
    before = statistics.mean(cores for _, cores in idle.cpu_samples)
    during = statistics.mean(cores for _, cores in busy.cpu_samples)
    assert 0.6 <= during - before <= 1.4 + before, (before, during)
