"""Build a benchmark workload: random checkpoints of a named shape and a prompt set with response lengths.

    python -m openrlhf_oppo.bench.workload --out DIR --shape qwen2.5-1.5b --prompts 512 \\
        --lengths lognormal --mean 500 --sigma 1.0 --high 4096

writes ``DIR/models/actor``, ``DIR/models/reward`` and ``DIR/prompts.jsonl`` (``input``, and ``length``:
the response length that ``--bench.lengths_from_label`` makes every system decode), and prints DIR.
"""

import argparse
import json
import os

from openrlhf_oppo import tiny


def build(out, shape, dtype, prompts, lengths, seed, prompt_tokens, **params):
    os.makedirs(out, exist_ok=True)
    actor, reward = tiny.make_checkpoints(os.path.join(out, "models"), shape=shape, dtype=dtype, seed=seed)
    values = tiny.response_lengths(prompts, lengths, seed=seed, **params)
    tiny.write_prompts(os.path.join(out, "prompts.jsonl"), values, seed=seed, prompt_tokens=prompt_tokens)
    summary = dict(shape=shape, prompts=prompts, distribution=lengths, params=params, seed=seed)
    summary.update(mean_length=sum(values) / len(values), max_length=max(values))
    with open(os.path.join(out, "workload.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return actor, reward, summary


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Response lengths, prompt length and seed: this module's CLI and the benchmark harness take the same."""
    parser.add_argument("--lengths", default="lognormal", choices=["lognormal", "bimodal", "uniform"])
    parser.add_argument("--mean", type=float, default=500, help="lognormal: the mean length")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal: sigma of the underlying normal")
    parser.add_argument("--short", type=int, default=128, help="bimodal: the length of most responses")
    parser.add_argument("--long", type=int, default=2048, help="bimodal: the length of the others")
    parser.add_argument("--long_fraction", type=float, default=0.1, help="bimodal: the share of long responses")
    parser.add_argument("--low", type=int, default=16, help="no response shorter")
    parser.add_argument("--high", type=int, default=4096, help="no response longer (the rollouts' max_new_tokens)")
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)


def check_workload_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse lengths that the workload would silently clip or that make no sense."""
    if not 1 <= args.low <= args.high:
        parser.error(f"--low {args.low} and --high {args.high}: need 1 <= low <= high")
    if args.lengths == "lognormal" and not (args.mean > 0 and args.sigma > 0):
        parser.error(f"--mean {args.mean} and --sigma {args.sigma} must both be > 0")
    if args.lengths == "bimodal":
        if not 0 <= args.long_fraction <= 1:
            parser.error(f"--long_fraction {args.long_fraction} must be between 0 and 1")
        for name in ("short", "long"):
            if not args.low <= getattr(args, name) <= args.high:
                parser.error(
                    f"--{name} {getattr(args, name)} is outside [--low {args.low}, --high {args.high}]: every "
                    f"such response would be clipped; raise --high or lower --{name}"
                )


def length_params(args) -> dict:
    return dict(
        mean=args.mean,
        sigma=args.sigma,
        short=args.short,
        long=args.long,
        long_fraction=args.long_fraction,
        low=args.low,
        high=args.high,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="tiny", choices=sorted(tiny.SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=256)
    add_workload_arguments(parser)
    args = parser.parse_args()
    check_workload_arguments(parser, args)
    _, _, summary = build(
        args.out,
        args.shape,
        args.dtype,
        args.prompts,
        args.lengths,
        args.seed,
        args.prompt_tokens,
        **length_params(args),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
