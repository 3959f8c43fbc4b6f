"""The benchmark samples only its own GPUs (CUDA_VISIBLE_DEVICES), so that several benchmarks can share a machine,
and the host's busy CPU cores; a run starts once its GPUs are free, or warns."""

import statistics
import subprocess
import sys
import time

import psutil
import pytest

from openrlhf_oppo.bench.monitor import GPUMonitor, visible_gpus, wait_for_free_gpus


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus(4) == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-482c0a46")  # UUIDs: NVML indices unknown, sample all
    assert visible_gpus(2) == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(3) == [0, 1, 2]


def test_a_run_waits_for_its_gpus_to_be_handed_back_and_names_the_ones_that_are_not():
    """The readings stand in for NVML, which this CPU machine lacks: memory the previous run's processes still
    held for two readings, then handed back; and memory another process keeps."""
    readings = iter([[(0, 40.0), (1, 0.5)], [(0, 12.0), (1, 0.5)], [(0, 0.6), (1, 0.5)]])
    started = time.time()
    assert wait_for_free_gpus(wait_s=30, read=lambda: next(readings)) == []
    assert 1.5 < time.time() - started < 10  # it polled, a second apart, and stopped once they were free
    assert wait_for_free_gpus(wait_s=0, read=lambda: [(0, 0.6), (3, 40.0)]) == [(3, 40.0)]


@pytest.mark.process
def test_host_cpu_samples_count_the_busy_cores():
    """Without NVML (this CPU machine) the monitor still samples the host's CPU, in cores: while a process
    spins, at least most of one core is busy and never more than the machine has (a percentage or a share
    of the machine would fail one bound or the other, whatever else runs). Samples keep the precision they are
    read at (milliseconds, hundredths of a core): every digit of the floats made them half of a packed run."""
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    time.sleep(0.5)  # the interpreter is up and spinning
    with GPUMonitor(interval_s=0.1) as monitor:
        time.sleep(1.0)
    spinner.wait()
    assert monitor.samples == [] and len(monitor.cpu_samples) >= 5
    busy = statistics.mean(cores for _, cores in monitor.cpu_samples)
    assert 0.6 <= busy <= psutil.cpu_count(), busy
    assert all(t == round(t, 3) and cores == round(cores, 2) for t, cores in monitor.cpu_samples)
