"""The structure the code promises: one module owns the trainer's calls to the rollout and scoring actors, and
the product never imports the CPU stand-ins."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "openrlhf_oppo"
# Calls between actors, which the trainer does not make: a rollout actor streams chunks to the scorers, the
# policy actor sends its weights to the engines (as OpenRLHF's own update_weight calls do).
ACTOR_TO_ACTOR = {"streaming/rollout.py": {"oppo_prefill"}, "weight_sync.py": {"oppo_receive_bucket"}}


def _product_files():
    return [p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts]


def test_only_the_coordinator_calls_the_actors_protocol():
    remote = re.compile(r"\.(oppo_[a-z_]+)\.remote\(|_each_engine\(\s*\"(oppo_[a-z_]+)\"")
    for path in _product_files():
        name = path.relative_to(PACKAGE).as_posix()
        calls = {a or b for a, b in remote.findall(path.read_text())}
        if name == "coordinator.py":
            assert calls, "the coordinator makes the calls"
            continue
        unexpected = {c for c in calls if not any(c.startswith(allowed) for allowed in ACTOR_TO_ACTOR.get(name, ()))}
        assert not unexpected, f"{name} calls {sorted(unexpected)}: only coordinator.py may"


def test_the_product_never_imports_the_cpu_stand_ins():
    for path in _product_files():
        if path.name == "demo.py":  # the CPU demo runs on them
            continue
        text = path.read_text()
        assert "openrlhf_oppo.testing" not in text and "from openrlhf_oppo import testing" not in text, path
