"""Where a torch.profiler trace leaves the GPU idle (the traces ``--oppo.profile_step`` writes).

    python -m openrlhf_oppo.bench.gaps profile_policy_rank0_step00003.json [profile_critic_rank0_step00003.json]

For each trace: the share of its window in which the process's own kernels ran, the idle time by gap size,
the host work that overlaps the gaps of 0.1 ms or more (summed by op: a ``cudaStreamSynchronize`` there is
a copy or an ``.item()`` that made the host wait, an autograd op is launch overhead), and the biggest gaps.
With several traces of processes that share one GPU (the policy and the critic train side by side), the last
line merges their kernels over the first trace's window: the GPU's busy share while both train.
"""

import argparse
import bisect
import gzip
import json
from collections import Counter
from typing import List, Tuple

KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation")
GAP_US = 100  # gaps below this are a launch's own latency, not work missing from the GPU


def load(path: str) -> List[dict]:
    """The trace's complete events, with times in absolute microseconds (so that traces compare)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        trace = json.load(f)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    for e in events:
        e["ts"] = float(e["ts"]) + base
    return events


def merge(intervals) -> List[List[float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def busy_intervals(events: List[dict], window: Tuple[float, float]) -> List[List[float]]:
    first, last = window
    clipped = [(max(e["ts"], first), min(e["ts"] + e["dur"], last)) for e in events if e.get("cat") in KERNELS]
    return merge((s, e) for s, e in clipped if e > s)


def host_events(events: List[dict]) -> List[dict]:
    """The host's ops, runtime calls and annotations, by start time."""
    return sorted((e for e in events if e.get("cat") in HOST), key=lambda e: e["ts"])


def host_window(host: List[dict]) -> Tuple[float, float]:
    return host[0]["ts"], max(e["ts"] + e["dur"] for e in host)


def overlapping(host: List[dict], starts: List[float], longest: float, start: float, end: float):
    """The host events (``host`` by start time, ``starts`` their starts) that overlap ``start``-``end``, each with
    the time it shares with it."""
    for e in host[bisect.bisect_left(starts, start - longest) :]:
        if e["ts"] > end:
            break
        shared = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
        if shared > 0:
            yield e, shared


def _size(gap_us: float) -> str:
    for bound, name in ((10, "<10us"), (100, "<100us"), (1e3, "<1ms"), (1e4, "<10ms")):
        if gap_us < bound:
            return name
    return ">=10ms"


def summarize(path: str, top: int = 25) -> List[str]:
    events = load(path)
    host = host_events(events)
    first, last = window = host_window(host)
    busy = busy_intervals(events, window)
    busy_us = sum(end - start for start, end in busy)
    edges = [first] + [t for interval in busy for t in interval] + [last]
    gaps = [(end - start, start, end) for start, end in zip(edges[::2], edges[1::2]) if end > start]
    kernels = sum(e.get("cat") in KERNELS for e in events)
    lines = [
        f"{path}: window {(last - first) / 1e6:.3f} s, GPU busy {busy_us / 1e6:.3f} s "
        f"({100 * busy_us / (last - first):.1f}%), kernels {kernels}"
    ]
    by_size = Counter()
    for gap, _, _ in gaps:
        by_size[_size(gap)] += gap
    lines.append(f"idle by gap size (s): { {size: round(us / 1e6, 3) for size, us in by_size.items()} }")

    starts = [e["ts"] for e in host]
    longest = max(e["dur"] for e in host)
    big = [g for g in gaps if g[0] >= GAP_US]
    overlap, count = Counter(), Counter()
    for _, start, end in big:
        for e, shared in overlapping(host, starts, longest, start, end):
            key = (e["cat"], e["name"][:90])
            overlap[key] += shared
            count[key] += 1
    lines.append(
        f"gaps >= {GAP_US}us: {len(big)}, idle {sum(g for g, _, _ in big) / 1e6:.3f} s; "
        "host events overlapping them (overlap s, count):"
    )
    for (cat, name), shared in overlap.most_common(top):
        lines.append(f"  {shared / 1e6:8.3f} {count[(cat, name)]:6d} {cat:16s} {name}")
    lines.append("biggest gaps:")
    for gap, start, end in sorted(big, reverse=True)[:12]:
        inside = [e for e, _ in overlapping(host, starts, longest, start, end) if e["cat"] != "cuda_driver"]
        innermost = sorted(inside, key=lambda e: e["dur"])[:4]
        lines.append(
            f"  {gap / 1e3:8.2f} ms at {(start - first) / 1e6:.3f} s: " + "; ".join(e["name"][:60] for e in innermost)
        )
    return lines


def together(paths: List[str]) -> str:
    """The GPU's busy share over the first trace's window, with the kernels of every trace."""
    traces = [load(path) for path in paths]
    window = host_window(host_events(traces[0]))
    busy = busy_intervals([e for events in traces for e in events], window)
    busy_us = sum(end - start for start, end in busy)
    span = window[1] - window[0]
    return (
        f"together over {paths[0]}'s window {span / 1e6:.3f} s: GPU busy {busy_us / 1e6:.3f} s "
        f"({100 * busy_us / span:.1f}%)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="torch.profiler Chrome traces (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=25, help="host ops listed for the gaps")
    args = parser.parse_args(argv)
    for path in args.traces:
        print("\n".join(summarize(path, args.top)))
    if len(args.traces) > 1:
        print(together(args.traces))


if __name__ == "__main__":
    main()
