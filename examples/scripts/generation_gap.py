"""Per step, how much shorter one system's generation phase is than another's on the same prompts.

With ``--bench.seed_prompt_order`` upstream-sync and a system without inter-step overlap (oppo-intra)
decode the same prompts in the same step; this checks that they did (equal mean response length per
step) and prints the difference of their ``timing/generation``. docs/results uses it to size what
upstream's per-call tokenizer costs (OPPO's samples generator sends it once):

    python examples/scripts/generation_gap.py docs/results/split-2gpu-1.5b-lognormal-unpatched/results.json.gz

It reads a results file as the benchmark writes it (``results.json``) or as docs/results keeps it, gzipped.
"""

import argparse
import gzip
import json
import statistics


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.json or results.json.gz")
    parser.add_argument("--slower", default="upstream-sync")
    parser.add_argument("--faster", default="oppo-intra")
    args = parser.parse_args()
    with (gzip.open if args.results.endswith(".gz") else open)(args.results, "rt") as f:
        results = json.load(f)
    warmup, measured = results["settings"]["warmup"], results["settings"]["steps"]
    slower, faster = (results["systems"][name]["steps"] for name in (args.slower, args.faster))
    gaps = []
    for index, (a, b) in enumerate(zip(slower, faster)):
        length = a["rollout/response_length_mean"]
        if abs(length - b["rollout/response_length_mean"]) > 1e-6:
            raise SystemExit(
                f"step {a['step']}: the systems decoded different prompts ({length} vs. {b['rollout/response_length_mean']})"
            )
        gap = a["timing/generation"] - b["timing/generation"]
        is_measured = warmup <= index < warmup + measured
        gaps.append((gap, is_measured))
        print(
            f"step {a['step']}: mean length {length:.0f}, generation {a['timing/generation']:.2f} - {b['timing/generation']:.2f} = {gap:.2f} s"
            + ("" if is_measured else " (not measured)")
        )
    every = [g for g, _ in gaps]
    print(
        f"{len(every)} steps: gap {min(every):.2f} to {max(every):.2f} s; measured steps: mean {statistics.mean(g for g, m in gaps if m):.2f} s"
    )


if __name__ == "__main__":
    main()
