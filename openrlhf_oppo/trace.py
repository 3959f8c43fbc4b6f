"""Chrome/Perfetto trace events (``--oppo.trace_dir``).

Each process records spans with wall-clock times; the trainer collects them at the end of a step and
writes one JSON file per step. Recording is a list append per span, and nothing at all when off. A ``timed``
span is measured either way: the trainer times its step's phases with them, for the trace and for the step's
``timing/*`` metrics.
"""

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Timed:
    start: float
    seconds: float = 0.0  # set when the span ends


class Tracer:
    def __init__(self, enabled: bool, process: str):
        self.enabled = enabled
        self.process = f"{process} {os.getpid()}"
        self._events = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, name: str, **args):
        if not self.enabled:
            yield
            return
        with self.timed(name, **args):
            yield

    @contextmanager
    def timed(self, name: str, **args):
        """A span measured whether or not tracing is on: yields its ``Timed``, whose ``seconds`` are set when it
        ends."""
        timed = Timed(start=time.time())
        try:
            yield timed
        finally:
            end = time.time()
            timed.seconds = end - timed.start
            self.add(name, timed.start, end, **args)

    def add(self, name: str, start: float, end: float, **args) -> None:
        if not self.enabled:
            return
        event = dict(name=name, ph="X", ts=start * 1e6, dur=(end - start) * 1e6, pid=self.process, args=args)
        event["tid"] = args.pop("track", name)
        with self._lock:
            self._events.append(event)

    def drain(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events


def write_trace(path: str, events: list) -> None:
    """Write ``events`` as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


@contextmanager
def profiled(path: str):
    """torch.profiler around the block (CPU ops, and CUDA kernels where there is a GPU), written to ``path`` as
    a Chrome trace: where a training step leaves the GPU idle, and which host work sits in the gaps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        yield
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    profiler.export_chrome_trace(path)
