"""The structure the code promises: one module owns the trainer's calls to the rollout and scoring actors, the
product never imports the CPU stand-ins, and the runtime imports none of the tools built on it."""

import ast
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


# The tools: the benchmark, the step predictor, the CPU stand-ins and the demo. They build on the runtime (the CLI,
# the extension and every module a run imports), which must run without them.
TOOLING = ("bench", "predict", "testing", "demo")


def _runtime_files():
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).with_suffix("").parts[0] not in TOOLING]


def _imported_modules(source: str, package: str) -> set:
    """Every module that ``source`` imports anywhere (inside functions too), each imported name counted as a
    possible submodule, and the constant names it hands to ``import_module`` or ``__import__``. ``package``: the
    source's own package, which relative imports start from."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return found


def test_the_import_reader_sees_every_way_to_import():
    source = (
        "import openrlhf_oppo.bench.report\n"
        "def f():\n"
        "    from openrlhf_oppo import predict\n"
        "    from ..testing import cpu_bench\n"
        "    importlib.import_module('openrlhf_oppo.demo')\n"
    )
    found = _imported_modules(source, "openrlhf_oppo.streaming")
    assert {"openrlhf_oppo.bench.report", "openrlhf_oppo.predict", "openrlhf_oppo.testing.cpu_bench"} <= found
    assert "openrlhf_oppo.demo" in found


def test_the_runtime_imports_no_tooling():
    """The CLI, the extension and every module a run uses import nothing of the benchmark, the predictor, the CPU
    stand-ins or the demo, at module level or inside a function: a tool plugs into the runtime (the benchmark through
    ``extension.set_sampling_params_hook``), never the other way round."""
    tooling = tuple(f"openrlhf_oppo.{name}" for name in TOOLING)
    runtime = _runtime_files()
    assert {"extension.py", "train_ppo_ray.py", "rollout.py", "trainer.py"} <= {path.name for path in runtime}
    for path in runtime:
        package = ".".join(("openrlhf_oppo",) + path.relative_to(PACKAGE).parent.parts)
        imported = _imported_modules(path.read_text(), package)
        wrong = sorted(m for m in imported if m in tooling or m.startswith(tuple(f"{t}." for t in tooling)))
        assert not wrong, f"{path.relative_to(PACKAGE)} imports {wrong}"
