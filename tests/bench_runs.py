"""The ``train_ppo_ray`` command lines that a benchmark command line would run, each checked by upstream's parser
and OPPO's checks, without running anything (``test_examples.py``).

Run as a script (``python bench_runs.py PATCHED_COPY``), it checks the benchmark command lines given as a JSON list
on stdin with the patched copy of OpenRLHF first on the path (what ``--upstream_patches`` runs on), and prints one
result a command line.
"""

import json
import subprocess
import sys
import traceback


def check(argv: list, workdir: str) -> dict:
    """``argv`` is what follows ``python -m openrlhf_oppo.bench``: the harness's options, then every run's flags
    through the benchmark driver's ``parse_args``, on the checkpoints and prompts of ``workdir`` (the
    ``bench_workdir`` fixture's: the preflight looks for them). Returns the shape and the count of runs."""
    from openrlhf_oppo.bench.driver import parse_args

    saved_argv = sys.argv
    try:
        if "--task" in argv:
            from openrlhf_oppo.bench import learning

            args = learning.parse(argv)
            runs = [
                learning.run_flags(workdir, f"{workdir}/out", f"{system}-seed{seed}", system, int(seed), args)
                for system in args.systems.split(",")
                for seed in args.seeds.split(",")
            ]
        else:
            from openrlhf_oppo.bench import __main__ as bench

            sys.argv = ["openrlhf_oppo.bench", *argv]
            args = bench.parse()
            systems = [system for system in args.systems.split(",") if system]
            runs = [bench.system_command(args, system, workdir, args.overcommit) for system in systems]
        for flags in runs:
            parse_args(flags)
    finally:
        sys.argv = saved_argv
    return dict(shape=args.shape, runs=len(runs))


def check_patched(patched: str, commands: list, workdir: str) -> list:
    """``check`` of each of ``commands`` in one interpreter with the patched copy ``patched`` first on its path."""
    result = subprocess.run(
        [sys.executable, __file__, patched, workdir],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULTS ", 1)[1])


def _check_or_error(argv: list, workdir: str) -> dict:
    try:
        return check(argv, workdir)
    except BaseException:  # noqa: BLE001 - argparse's errors are SystemExit
        return dict(error=traceback.format_exc())


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # before anything imports openrlhf
    print("RESULTS", json.dumps([_check_or_error(argv, sys.argv[2]) for argv in json.load(sys.stdin)]))
