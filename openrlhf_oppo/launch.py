"""What the CLI adds around upstream's ``train`` when it starts a run (``guard``; not in ``parse_args``).

Before ``train``: ``preflight.check_launch`` (the required flags, the placement's GPUs and CPUs). While it
runs, in the names ``train`` reads (upstream's driver module, or ``placement.py``) and in upstream's modules
that build their own placement groups:

* ``placement_group`` checks the Ray cluster against the whole placement once Ray is up (the cluster of
  ``RAY_ADDRESS`` is not known before), and waits at most ``PLACEMENT_TIMEOUT_S`` for each group: Ray would
  wait forever for GPUs that never come (``ray.get(pg.ready())``), silently;
* ``RayActorGroup`` and ``create_vllm_engines`` name every actor they create ("critic rank 1", "vLLM engine
  0") for the one line the CLI prints when an actor fails (``actor_errors``).
"""

import os
from contextlib import contextmanager

import ray
from openrlhf.trainer.ray import launcher, vllm_engine
from openrlhf.trainer.ray.launcher import RayActorGroup
from ray.util.placement_group import placement_group, remove_placement_group

from openrlhf_oppo import actor_errors, preflight
from openrlhf_oppo.config import OPPOConfigError

# How long a placement group may wait for its GPUs; longer where an autoscaler adds nodes.
PLACEMENT_TIMEOUT_S = float(os.environ.get("OPENRLHF_OPPO_PLACEMENT_TIMEOUT_S", "30"))


class NamedActorGroup(RayActorGroup):
    """Upstream's group, its actors named by role and rank (also those created before one failed to start)."""

    def _initiate_actors(self, pg, num_gpus_per_actor):
        try:
            super()._initiate_actors(pg, num_gpus_per_actor)
        finally:
            class_name = self.ray_actor_type.__ray_metadata__.class_name
            actor_errors.register(getattr(self, "_actor_handlers", []), class_name)


def named_engines(create_vllm_engines):
    def create(*args, **kwargs):
        engines = create_vllm_engines(*args, **kwargs)
        for index, engine in enumerate(engines or []):
            actor_errors.NAMES[engine._actor_id.hex()] = f"vLLM engine {index}"
        return engines

    return create


def placed(bundles, timeout_s: float, *args, **options):
    """A placement group of ``bundles`` once Ray has placed it, or an ``OPPOConfigError`` after ``timeout_s``."""
    pg = placement_group(bundles, *args, **options)
    if pg.wait(timeout_seconds=timeout_s):
        return pg
    remove_placement_group(pg)
    gpus = sum(bundle.get("GPU", 0) for bundle in bundles)
    free, total = ray.available_resources().get("GPU", 0), ray.cluster_resources().get("GPU", 0)
    raise OPPOConfigError(
        f"Ray could not place a group of {preflight.plural(gpus, 'GPU')} within {timeout_s:g} s: {free:g} of the "
        f"cluster's {preflight.plural(total, 'GPU')} are free. Free them, lower the GPU counts, or wait longer with "
        "OPENRLHF_OPPO_PLACEMENT_TIMEOUT_S."
    )


def placement_group_within(args, timeout_s: float):
    """``placement_group`` for upstream's ``train``: the cluster checked against the whole placement at the first
    group (Ray is up by then), and each group ``placed`` within ``timeout_s``."""
    checked = []

    def create(bundles, *positional, **options):
        if not checked:
            preflight.check_resources(args, ray.cluster_resources(), "the Ray cluster")
            checked.append(True)
        return placed(bundles, timeout_s, *positional, **options)

    return create


@contextmanager
def _replaced(namespace: dict, **names):
    """Set the names that ``namespace`` holds, for the duration."""
    saved = {name: namespace[name] for name in names if name in namespace}
    namespace.update({name: names[name] for name in saved})
    try:
        yield
    finally:
        namespace.update(saved)


def guard(train):
    """``train`` with the launch checks before it and the hooks above while it runs."""

    def guarded(args):
        preflight.check_launch(args)
        within = placement_group_within(args, PLACEMENT_TIMEOUT_S)
        engines = named_engines(train.__globals__.get("create_vllm_engines", vllm_engine.create_vllm_engines))
        with (
            _replaced(train.__globals__, placement_group=within, RayActorGroup=NamedActorGroup,
                      create_vllm_engines=engines),
            _replaced(vars(launcher), placement_group=within),
            _replaced(vars(vllm_engine), placement_group=within),
        ):  # fmt: skip
            return train(args)

    return guarded
