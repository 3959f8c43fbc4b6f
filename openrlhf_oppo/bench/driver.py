"""``python -m openrlhf_oppo.bench.driver``: one benchmark run, OPPO's ``train_ppo_ray`` with the workload's flags.

    python -m openrlhf_oppo.bench.driver <train_ppo_ray flags> --bench.lengths_from_label --bench.seed_prompt_order

The harness runs every system through this driver. It takes the benchmark's own flags off the command line, sets
up what they ask for in this process, and hands every other flag to the user CLI (``openrlhf_oppo.cli.train_ppo_ray``),
which neither lists nor knows them:

* ``--bench.lengths_from_label`` registers ``fixed_lengths.fixed_length_params`` as the rollout actors' sampling
  params hook (``extension.set_sampling_params_hook``): every response exactly as long as its prompt's label.
* ``--bench.seed_prompt_order`` swaps upstream's strategy class for ``seeded_order.SeededOrderStrategy``: the
  prompts in the same order in every run of one ``--train.seed``.
* ``--bench.kv_cache_gb GIB`` starts every vLLM engine with a KV cache of that size
  (``extension.set_engine_kwargs(kv_cache_memory_bytes=...)``) instead of the one vLLM sizes from the GPU memory
  free while it starts: runs that share a GPU start and free memory at any time.

A run's recorded flags (``results.json``) hold these flags among the CLI's: ``parse_args`` reads such a list as
the run parsed it, for the tools that rebuild a run from its record.
"""

import argparse
import sys

from openrlhf_oppo import extension, quiet
from openrlhf_oppo.cli import train_ppo_ray

# name: the sentence --help shows. Switches, off unless given.
OPTIONS = {
    "lengths_from_label": "Each prompt's label is its response length in tokens (max_tokens=label, ignore_eos), so "
    "every system decodes the same lengths. Use with --data.label_key.",
    "seed_prompt_order": "Shuffle the prompts with a generator seeded from --train.seed, so that every run sees them "
    "in the same order (upstream's trainer shuffles them with an unseeded generator).",
}


# name: (the sentence --help shows, metavar). Each takes a number; unset unless given.
VALUED = {
    "kv_cache_gb": (
        "Every vLLM engine's KV cache, in GiB (vLLM's kv_cache_memory_bytes), instead of the one vLLM sizes from "
        "the GPU memory free while it starts, which other runs on the GPU change.",
        "GIB",
    ),
}


def split(argv: list):
    """The benchmark's flags of ``argv`` (a namespace: the switches, and the valued options as floats or None) and
    the others, in their order: the CLI's."""
    flags = {f"--bench.{name}" for name in OPTIONS}
    workload = argparse.Namespace(
        **{name: f"--bench.{name}" in argv for name in OPTIONS}, **{name: None for name in VALUED}
    )
    rest, args = [], iter(argv)
    for arg in args:
        name = arg.removeprefix("--bench.")
        if arg.startswith("--bench.") and name in VALUED:
            setattr(workload, name, float(next(args)))
        elif arg not in flags:
            rest.append(arg)
    return workload, rest


def install(workload: argparse.Namespace) -> None:
    """Set up in this process what the benchmark's flags ask for, before the CLI starts the run."""
    if workload.lengths_from_label:
        from openrlhf_oppo.bench.fixed_lengths import fixed_length_params

        extension.set_sampling_params_hook(fixed_length_params)
    if workload.seed_prompt_order:
        from openrlhf_oppo.bench import seeded_order  # imports OpenRLHF's strategy

        seeded_order.install()
    if workload.kv_cache_gb is not None:
        extension.set_engine_kwargs(kv_cache_memory_bytes=int(workload.kv_cache_gb * 2**30))


def parse_args(argv: list):
    """The namespace a run of ``argv`` hands upstream's ``train``: the CLI's ``parse_args`` of its flags, with the
    benchmark's in ``args.bench``. It only parses: nothing is installed in this process."""
    workload, rest = split(argv)
    args = train_ppo_ray.parse_args(rest)
    args.bench = workload
    return args


def help_text() -> str:
    """What ``--help`` shows before the CLI's own help."""
    parser = argparse.ArgumentParser(
        prog="python -m openrlhf_oppo.bench.driver",
        usage="%(prog)s <train_ppo_ray flags> [--bench.lengths_from_label] [--bench.seed_prompt_order] "
        "[--bench.kv_cache_gb GIB]",
        add_help=False,
    )
    group = parser.add_argument_group("Benchmark workload", "This driver's own flags; every other flag is the CLI's.")
    for name, sentence in OPTIONS.items():
        group.add_argument(f"--bench.{name}", action="store_true", help=f"{sentence} Default: off.")
    for name, (sentence, metavar) in VALUED.items():
        group.add_argument(f"--bench.{name}", metavar=metavar, help=f"{sentence} Default: vLLM's own.")
    return parser.format_help()


def main() -> None:
    workload, rest = split(sys.argv[1:])
    if "-h" in rest or "--help" in rest:
        print(help_text(), flush=True)
    with quiet.filtered():  # the start-up notices of the libraries it imports, as the CLI keeps them
        install(workload)
    sys.argv = [sys.argv[0]] + rest
    train_ppo_ray.main()


if __name__ == "__main__":
    main()
