"""The profile summary (``python -m openrlhf_oppo.bench.gaps``) on traces that torch.profiler wrote.

This machine has no GPU, so the kernels of two processes sharing one are written into the traces: policy
kernels at 0-1 ms and 3-4 ms of the window, critic kernels at 1-3 ms, and in the first millisecond of the
policy's gap its host waits on a stream synchronization.
"""

import json

import torch
from torch.profiler import ProfilerActivity, profile

from openrlhf_oppo.bench import gaps


def _trace(path, kernels_ms, sync_ms=None):
    """A real CPU trace over a 4 ms window, with ``kernels_ms`` (start, end) added as GPU kernels."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        torch.ones(8).sum()
    profiler.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") != "X"]  # the real ops ran at other times
    trace["baseTimeNanoseconds"] = 1_790_000_000_000_000_000  # one clock for both processes' traces
    start = 1000.0  # microseconds after it
    events.append(dict(ph="X", cat="cpu_op", name="train", ts=start, dur=4000.0, pid=1, tid=1))
    for k, (a, b) in enumerate(kernels_ms):
        events.append(dict(ph="X", cat="kernel", name=f"gemm{k}", ts=start + a * 1e3, dur=(b - a) * 1e3, pid=0, tid=7))
    if sync_ms:
        a, b = sync_ms
        events.append(
            dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=start + a * 1e3, dur=(b - a) * 1e3)
        )
    trace["traceEvents"] = events
    path.write_text(json.dumps(trace))
    return str(path)


def test_busy_share_gaps_and_the_host_work_in_them(tmp_path):
    policy = _trace(tmp_path / "policy.json", [(0, 1), (3, 4)], sync_ms=(1.0, 2.0))
    critic = _trace(tmp_path / "critic.json", [(1, 3)])

    lines = gaps.summarize(policy)
    assert "window 0.004 s, GPU busy 0.002 s (50.0%), kernels 2" in lines[0]
    assert "{'<10ms': 0.002}" in lines[1]  # the one 2 ms gap
    waits = [line.split() for line in lines if "cuda_runtime" in line]
    assert waits == [["0.001", "1", "cuda_runtime", "cudaStreamSynchronize"]]  # 1 ms of the gap
    assert any(line.strip().startswith("2.00 ms at 0.001 s") for line in lines)

    # Side by side on one GPU, the critic's kernels fill the policy's gap.
    assert gaps.together([policy, critic]).endswith("GPU busy 0.004 s (100.0%)")
