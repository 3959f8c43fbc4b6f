"""``python -m openrlhf_oppo.cli.train_ppo_ray``: OpenRLHF's ``train_ppo_ray`` plus ``--oppo.*``.

Upstream builds its parser inside ``if __name__ == "__main__"``, so the driver runs upstream's module
unchanged (``runpy``) with three hooks around it:

1. before it runs, ``extension.install`` swaps in OPPO's classes (from the ``--oppo.enable`` flag, read
   ahead);
2. when upstream parses its arguments, the OPPO group is added to the same parser, so ``--help``
   lists it and the dotted flags land in ``args.oppo`` like upstream's own groups;
3. when upstream hierarchizes them, ``extension.configure`` checks them all (bad values and unsupported
   combinations fail here, before Ray starts, and ``preflight.check`` the files and folders they name) and
   ``--oppo.colocate_models`` swaps the placement; a run (``main``, not ``parse_args``) gets ``launch.guard``
   around upstream's ``train``: the GPUs and CPUs checked, placement groups that wait at most 30 s.

A run that stops because an actor failed ends with one line naming the actor and its own error
(``failure_line``), printed before the traceback as well; one that upstream's own checks of its flags refuse (its
assertions before ``train``), with the assertion's message.

Without OPPO flags the run is upstream's, step for step.
"""

import argparse
import importlib
import re
import runpy
import sys
import traceback
from contextlib import contextmanager

from openrlhf_oppo import actor_errors, compat, config, extension, quiet

UPSTREAM = "openrlhf.cli.train_ppo_ray"


def _read_ahead(argv):
    """The flag that decides the class swaps, which must happen before upstream imports them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--oppo.enable", dest="enable", action="store_true")
    known, _ = parser.parse_known_args(argv)
    return known


@contextmanager
def _upstream_hooks(train=None, wrap_train=None):
    """Hook OPPO into upstream's parsing; ``train``, if given, runs instead of the driver's ``train``, which
    ``wrap_train``, if given, wraps."""
    from openrlhf.utils import config as upstream_config

    parse_args, hierarchize = argparse.ArgumentParser.parse_args, upstream_config.hierarchize

    def parse_with_oppo(parser, args=None, namespace=None):
        if "--actor.model_name_or_path" in parser._option_string_actions and "--oppo.enable" not in (
            parser._option_string_actions
        ):
            config.add_arguments(parser)
            parser.error = _one_line_error(parser)
        return parse_args(parser, args, namespace)

    def hierarchize_and_validate(args):
        args = hierarchize(args)
        extension.configure(args)
        if args.oppo.colocate_models:
            extension.replace_placement(sys.modules["__main__"].__dict__)
        if train is not None:
            sys.modules["__main__"].__dict__["train"] = train
        if wrap_train is not None:
            sys.modules["__main__"].__dict__["train"] = wrap_train(sys.modules["__main__"].__dict__["train"])
        return args

    argparse.ArgumentParser.parse_args = parse_with_oppo
    upstream_config.hierarchize = hierarchize_and_validate
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = parse_args
        upstream_config.hierarchize = hierarchize


def _one_line_error(parser):
    """A parser error as one line and where to look, instead of argparse's usage of every option before it."""

    def error(message):
        message = re.sub(r"^argument (\S+): (?=\1 )", "", message)  # the option's own message names it
        parser.exit(2, f"openrlhf-oppo: error: {message} (see --help)\n")

    return error


def parse_args(argv):
    """Upstream's parsing and checks of a ``train_ppo_ray`` command line, OPPO's included, without training.

    Returns the namespace upstream's ``train`` would receive (the demo and the tests build on it).
    """
    captured = []
    saved_argv = sys.argv
    sys.argv = [UPSTREAM] + list(argv)
    try:
        with _upstream_hooks(train=captured.append):
            runpy.run_module(UPSTREAM, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
    return captured[0]


# What upstream's driver imports first: imported here, inside quiet.filtered, so that their start-up notices stay
# in the log.
UPSTREAM_IMPORTS = (
    "ray",
    "openrlhf.trainer.ray",
    "openrlhf.trainer.ray.launcher",
    "openrlhf.trainer.ray.ppo_actor",
    "openrlhf.trainer.ray.ppo_critic",
    "openrlhf.utils",
)


def main() -> None:
    try:
        compat.check_versions()
    except compat.UnsupportedVersion as error:
        sys.exit(f"openrlhf-oppo: {error}")
    ahead = _read_ahead(sys.argv[1:])
    with quiet.filtered():
        for module in UPSTREAM_IMPORTS:
            importlib.import_module(module)
        extension.install(ahead.enable)
    from openrlhf_oppo import launch

    started = []  # upstream's train() has been called: its flags passed upstream's own checks

    def guarded(train):
        def run(args):
            started.append(True)
            return launch.guard(train)(args)

        return run

    with _upstream_hooks(wrap_train=guarded):
        try:
            runpy.run_module(UPSTREAM, run_name="__main__", alter_sys=True)
        except config.OPPOConfigError as error:
            _exit_with(str(error))
        except AssertionError as error:
            if started or not str(error):
                raise
            # Upstream checks its flags with assertions after parsing them: the message is the whole story.
            _exit_with(f"{error} (OpenRLHF's check of its flags)")
        except Exception as error:  # noqa: BLE001 - everything else goes on as raised
            line = failure_line(error)
            if line is None:
                raise
            # The cause first, then the traceback for the log, and the cause again as the last line.
            print(f"openrlhf-oppo: error: {line}", file=sys.stderr, flush=True)
            traceback.print_exception(error)
            _exit_with(line)


def _exit_with(line: str) -> None:
    """End the run with ``line`` last: Ray, if up, is shut down first, since its workers' logs reach the driver's
    stderr at any time."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.exit(f"openrlhf-oppo: error: {line}")


def failure_line(error: BaseException):
    """One line for a run that stopped because a Ray actor failed, or None for any other error: the actor by role
    and rank ("critic rank 1 (CriticModelActor)", its class where the driver did not create it) and its own
    error, whether it raised in a call, failed in ``__init__``, or died. Raised in the trainer actor, the error
    reaches the driver wrapped in Ray's ``RayTaskError``, whose traceback buries that under Ray's own frames."""
    import ray.exceptions

    from openrlhf_oppo.coordinator import OPPOActorError

    outer = error
    while isinstance(error, ray.exceptions.RayTaskError) and getattr(error, "cause", None) is not None:
        error = error.cause
    if isinstance(error, OPPOActorError):
        return str(error)
    waited = re.search(r"ray::([\w.]+)\(\)", actor_errors.text(outer))
    waited = f" while {waited.group(1)} waited on it" if waited and outer is not error else ""
    if isinstance(error, ray.exceptions.RayActorError):
        subject = actor_errors.name(error.actor_id, actor_errors.actor_class(error))
        happened = "failed to start" if error.actor_init_failed else "died"
        return f"{subject} {happened}{waited}: {actor_errors.exception_line(error)}"
    call = actor_errors.innermost_call(outer) if isinstance(outer, ray.exceptions.RayTaskError) else None
    if call is None:
        return None
    class_name, method, actor_id = call
    return f"{actor_errors.name(actor_id, class_name)} failed in {method}: {actor_errors.exception_line(error)}"


if __name__ == "__main__":
    main()
