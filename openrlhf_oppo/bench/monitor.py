"""GPU utilization sampled with NVML while a system runs (no GPU samples where NVML is absent), and how many
of the host's CPU cores were busy."""

import os
import threading
import time

import psutil


class GPUMonitor:
    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.samples = []  # (wall time, [utilization % per GPU], [memory used GiB per GPU])
        self.cpu_samples = []  # (wall time, host CPU cores busy since the sample before)
        self.names = []
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None

    def __enter__(self):
        handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in visible_gpus(pynvml.nvmlDeviceGetCount())]
            self.names = [_text(pynvml.nvmlDeviceGetName(h)) for h in handles]
        except Exception:  # noqa: BLE001 - no NVIDIA driver: a CPU machine
            pass
        psutil.cpu_percent()  # the first call starts the count
        self._thread = threading.Thread(target=self._run, args=(handles,), daemon=True)
        self._thread.start()
        return self

    def _run(self, handles):
        cores = psutil.cpu_count()
        while not self._stop.wait(self.interval_s):
            now = time.time()
            self.cpu_samples.append(cpu_sample(now, psutil.cpu_percent() / 100 * cores))
            if handles:
                util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
                memory = [self._nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30 for h in handles]
                self.samples.append(gpu_sample(now, util, memory))

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean_utilization(self, start: float, end: float):
        window = [util for t, util, _ in self.samples if start <= t <= end]
        if not window:
            return []
        return [sum(column) / len(window) for column in zip(*window)]


# A sample keeps the precision it is read at: wall time to the millisecond (one comes every 100 ms), memory to the
# MiB, busy cores to a hundredth. With every digit of the floats, samples were half of a packed results file.
def gpu_sample(now: float, util: list, memory_gib: list) -> list:
    return [round(now, 3), util, [round(gib, 3) for gib in memory_gib]]


def cpu_sample(now: float, cores: float) -> list:
    return [round(now, 3), round(cores, 2)]


def memory_in_use() -> list:
    """``(NVML index, GiB used)`` of each of this run's GPUs; empty where NVML is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
        indices = visible_gpus(pynvml.nvmlDeviceGetCount())
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        return [(i, pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30) for i, h in zip(indices, handles)]
    except Exception:  # noqa: BLE001 - no NVIDIA driver: a CPU machine
        return []


def wait_for_free_gpus(wait_s: float = 30.0, min_gib: float = 2.0, read=memory_in_use) -> list:
    """Wait up to ``wait_s`` until no GPU of this run holds more than ``min_gib`` GiB, and return the ones that
    still do (``(index, GiB)``). vLLM sizes its KV cache from the memory it profiles at start-up: memory that
    the previous run's processes have not yet handed back, or that another run on the GPU allocates or frees
    meanwhile, fails the start or shrinks the cache. (The benchmark's own process keeps its CUDA context, well
    under ``min_gib``.)"""
    deadline = time.time() + wait_s
    while True:
        busy = [(i, gib) for i, gib in read() if gib > min_gib]
        if not busy or time.time() >= deadline:
            return busy
        time.sleep(1.0)


def visible_gpus(count: int) -> list:
    """NVML indices of the GPUs this run may use: CUDA_VISIBLE_DEVICES where it lists indices (one machine
    can then hold several benchmarks side by side, each sampling only its own GPUs), else all of them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if all(v.strip().isdigit() for v in visible):
        return [int(v) for v in visible if int(v) < count]
    return list(range(count))


def _text(value):
    return value.decode() if isinstance(value, bytes) else value
