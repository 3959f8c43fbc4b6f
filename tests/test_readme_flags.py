"""The README's table of ``--oppo.*`` (and ``--bench.*``) flags is the map from a flag to the code it changes, the
metric it logs and the tests that check it: every flag the parser knows has a row, its default and choices are
the parser's, and every test the row names exists."""

import ast
import re
from pathlib import Path

from openrlhf_oppo.config import BENCH_OPTIONS, OPTIONS

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "openrlhf_oppo"


def _rows() -> list:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| flag | default | what it changes (code) | logged as | tested in |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def _flags(cell: str) -> list:
    """The flags a row's first cell names, with its values: ``--oppo.a_x/_y N`` is ``oppo.a_x`` and ``oppo.a_y``."""
    flags = []
    for group, name, values in re.findall(r"`--(oppo|bench)\.([\w/]+)\s*([^`]*)`", cell):
        first, *others = name.split("/")
        stem = first.rsplit("_", 1)[0]
        flags += [(f"{group}.{first}", values)] + [(f"{group}.{stem}{other}", values) for other in others]
    return flags


def _expected_default(default):
    if default is None:
        return None  # described in words ("off", "B/4")
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


def _test_names(path: Path) -> set:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def _options() -> dict:
    """Every flag the parser adds, as ``group.name``: (its add_argument keywords, its default)."""
    options = {f"oppo.{name}": spec for name, spec in OPTIONS.items()}
    options.update({f"bench.{name}": (kwargs, kwargs["default"]) for name, kwargs in BENCH_OPTIONS.items()})
    options["oppo.enable"] = ({"action": "store_true"}, False)
    return options


def test_every_flag_has_a_row_with_the_parsers_default_and_choices():
    rows, options = _rows(), _options()
    named = {}
    for row in rows:
        flags = _flags(row[0])
        assert flags, row[0]
        defaults = re.split(r", | / ", row[1].split(":")[0].split(" (")[0]) if len(flags) > 1 else [row[1]]
        for i, (name, values) in enumerate(flags):
            named[name] = row
            kwargs, default = options[name]
            expected = _expected_default(default)
            if expected is not None:
                shown = defaults[i] if len(defaults) == len(flags) else defaults[0]
                assert shown.split(":")[0].split(" (")[0].strip() == expected, (name, row[1])
            if "choices" in kwargs:
                assert set(values.replace("\\|", "|").split("|")) == set(kwargs["choices"]), (name, values)
    assert set(named) == set(options), set(options) ^ set(named)


def test_every_test_a_row_names_exists():
    missing = []
    for row in _rows():
        for file, name in re.findall(r"`(test_\w+\.py)(?:::(\w+))?(?:\.\.\.)?`", row[4]):
            path = TESTS / file
            if not path.exists():
                missing.append(file)
            elif name and not any(test.startswith(name) for test in _test_names(path)):
                missing.append(f"{file}::{name}")
    assert not missing, missing


def _defined(path: Path) -> set:
    """The names a module defines: its classes, functions and methods (at any depth), and its assignments."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _module(name: str):
    """``openrlhf_oppo``'s file for ``name``: a path (``overcommit/sampler.py``) or a module's last part."""
    if name.endswith(".py"):
        found = list(PACKAGE.glob(name)) + list(PACKAGE.glob(f"**/{name}"))
    else:
        found = list(PACKAGE.glob(f"**/{name}.py"))
    return found[0] if len(set(found)) == 1 else None


def test_the_code_a_row_points_to_exists():
    """A row's code column names files (``placement.py``) and definitions (``scorer.ChunkScorer._batches``, or
    ``_take`` in the module named just before it): each is in the package."""
    missing = []
    for row in _rows():
        module = None
        for ref in re.findall(r"`([\w./]+)`", row[2]):
            if ref.endswith(".py"):
                module = _module(ref)
                missing += [] if module else [ref]
                continue
            first, *rest = ref.split(".")
            if rest:
                module = _module(first)
                names = rest
            elif first.startswith("_"):
                names = [first]  # a name in the module named before it
            else:
                continue  # a value, such as `auto`
            if module is None or not set(names) <= _defined(module):
                missing.append(f"{row[0]}: {ref}")
    assert not missing, missing


def test_the_table_reader_sees_what_it_should():
    assert _flags("`--oppo.overcommit_window/_inc/_max N`") == [
        ("oppo.overcommit_window", "N"),
        ("oppo.overcommit_inc", "N"),
        ("oppo.overcommit_max", "N"),
    ]
    assert _flags("`--oppo.top_up step_start\\|step_end`, `--bench.x`") == [
        ("oppo.top_up", "step_start\\|step_end"),
        ("bench.x", ""),
    ]
    assert _expected_default(4.0) == "4" and _expected_default(False) == "off" and _expected_default(None) is None
