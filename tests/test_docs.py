"""What the README and docs/ show works: every command in their code blocks names a module or file that exists
and parses with the real parsers (``train_ppo_ray``'s with OPPO's checks; the benchmark's, then every run it would
start), every option of the CLI and of the benchmark's driver has a help sentence and a place in the docs, every
``--oppo.*`` / ``--bench.*`` flag they name is an option, the files and code they point to exist, and their links
resolve.

Nothing here reads the prose itself: the pages may be rewritten freely as long as what they show still works.
docs/RESULTS.md quotes the commands of past runs as they ran (flags may have changed since): only its links are
checked.
"""

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import bench_runs
import pytest

from openrlhf_oppo.bench import driver
from openrlhf_oppo.cli.train_ppo_ray import parse_args

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "RESULTS.md"]
PAGES = GUIDES + [ROOT / "docs" / "RESULTS.md"] + sorted((ROOT / "docs" / "results").rglob("*.md"))
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
REPO_FOLDERS = ("openrlhf_oppo/", "examples/", "tests/", "docs/", "patches/", ".ci/")
CLI = "openrlhf_oppo.cli.train_ppo_ray"
RUNNERS = r"(\S*/)?(python3?|bash|sh|pip|cd|pre-commit)"


def _shell_commands(page: Path) -> list:
    """``(where, argv)`` for each command of the page's shell code blocks: continuation lines joined, comments
    dropped, ``a && b`` two commands. Lines that start with no program the docs run (a folder tree) are left out."""
    commands = []
    text = page.read_text()
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if block.group(1) not in SHELL_BLOCKS:
            continue
        line_number = text[: block.start()].count("\n") + 2
        for line in re.split(r"(?<!\\)\n", block.group(2)):
            where = f"{page.relative_to(ROOT)}:{line_number}"
            line_number += line.count("\n") + 1
            if line.split()[:1] and re.fullmatch(RUNNERS, line.split()[0]):
                commands += [(where, argv) for argv in _split(line.replace("\\\n", " "))]
    return commands


def _split(line: str) -> list:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, argv = [], []
    for token in list(lexer) + [";"]:
        if token in ("&&", "||", ";", "|"):
            commands += [argv] if argv else []
            argv = []
        else:
            argv.append(token)
    return commands


def _python_module(argv: list):
    """``(module, its arguments)`` of ``python -m module ...``, else ``(None, None)``."""
    if Path(argv[0]).name.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        return argv[2], argv[3:]
    return None, None


def _is_synopsis(argv: list) -> bool:
    """A command with a ``<placeholder>``: it shows where flags go, not a command to run."""
    return "<" in argv


COMMANDS = [command for page in GUIDES for command in _shell_commands(page)]
CLI_COMMANDS = [(where, argv) for where, argv in COMMANDS if _python_module(argv)[0] == CLI]
BENCH_COMMANDS = [
    (where, _python_module(argv)[1]) for where, argv in COMMANDS if _python_module(argv)[0] == "openrlhf_oppo.bench"
]


def _repo_paths(argv: list) -> list:
    """The arguments that are paths into this repository (``--flag=path`` included); an all-capitals part
    (``docs/results/NAME/``) stands for any name."""
    values = [arg.split("=", 1)[-1] for arg in argv]
    return [re.sub(r"(?<=/)[A-Z_]+(?=/|$)", "*", value) for value in values if value.startswith(REPO_FOLDERS)]


def _exists(path: str) -> bool:
    """A path, a glob, or the start of a file's name (``patches/openrlhf/0008``)."""
    path = path.rstrip("/")
    return (ROOT / path).exists() or any(ROOT.glob(path if "*" in path else path + "*"))


def test_the_docs_show_commands_to_run():
    assert [argv for _, argv in CLI_COMMANDS if not _is_synopsis(argv)], "no complete train_ppo_ray command"
    assert BENCH_COMMANDS, "no benchmark command"


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_command_names_what_exists(where, argv):
    """The module of ``python -m``, the script that ``python`` or ``bash`` runs, and the repository's paths among
    the arguments."""
    module, _ = _python_module(argv)
    if module is not None:
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    elif argv[0] in ("bash", "sh") or (Path(argv[0]).name.startswith("python") and len(argv) > 1):
        assert (ROOT / argv[1]).is_file(), f"{where}: no file {argv[1]}"
    missing = [path for path in _repo_paths(argv) if not _exists(path)]
    assert not missing, f"{where}: {missing}"


@pytest.mark.parametrize("where, argv", CLI_COMMANDS, ids=[where for where, _ in CLI_COMMANDS])
def test_every_train_ppo_ray_command_parses(where, argv, cli_help):
    """A complete command passes upstream's parser and OPPO's checks; a synopsis's flags are the CLI's."""
    flags = _python_module(argv)[1]
    if _is_synopsis(argv):
        unknown = [flag for flag in flags if flag.startswith("--") and flag.split("=")[0] not in _options(cli_help)]
        assert not unknown, f"{where}: {unknown}"
    else:
        parse_args(flags)


@pytest.fixture(scope="module")
def patched_bench_checks(patched_openrlhf, bench_workdir):
    """``bench_runs.check`` of the benchmark commands with ``--upstream_patches``, with the patched parser."""
    wanted = [argv for _, argv in BENCH_COMMANDS if "--upstream_patches" in argv]
    return dict(zip(map(tuple, wanted), bench_runs.check_patched(patched_openrlhf, wanted, bench_workdir)))


def _bench_params():
    for where, argv in BENCH_COMMANDS:
        marks = [pytest.mark.process] if "--upstream_patches" in argv else []
        yield pytest.param(where, argv, marks=marks, id=where)


@pytest.mark.parametrize("where, argv", _bench_params())
def test_every_benchmark_command_starts_valid_runs(where, argv, request, bench_workdir):
    """The benchmark's options, then every run's ``train_ppo_ray`` command line, through their parsers (the
    patched copy's where the command asks for it)."""
    if "--upstream_patches" in argv:
        checked = request.getfixturevalue("patched_bench_checks")[tuple(argv)]
        assert "error" not in checked, f"{where}: {checked.get('error')}"
    else:
        checked = bench_runs.check(argv, bench_workdir)
    assert checked["runs"] > 0, where


def _options(cli_help: str) -> dict:
    """Every option of the CLI's help with its entry (flag, value and sentence; whitespace folded)."""
    entries = re.split(r"\n  (?=--)", cli_help)[1:]
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}


def _oppo_options(cli_help: str) -> dict:
    """The CLI's ``--oppo.*`` options and the benchmark driver's ``--bench.*`` ones, each with its help entry."""
    options = {flag: entry for flag, entry in _options(cli_help).items() if flag.startswith("--oppo.")}
    return options | {
        flag: entry for flag, entry in _options(driver.help_text()).items() if flag.startswith("--bench.")
    }


def _flags_named(text: str) -> set:
    """The ``--oppo.*`` and ``--bench.*`` flags a text names; ``--oppo.a_x/_y`` names ``--oppo.a_x`` and
    ``--oppo.a_y``."""
    flags = set()
    for group, name in re.findall(r"--(oppo|bench)\.([a-z_]+(?:/_[a-z]+)*)", text):
        first, *others = name.split("/")
        stem = first.rsplit("_", 1)[0]
        flags |= {f"--{group}.{first}"} | {f"--{group}.{stem}{other}" for other in others}
    return flags


def test_the_flag_reader_sees_what_it_should():
    assert _flags_named("`--oppo.overcommit_window/_inc/_max N` and --bench.seed_prompt_order.") == {
        "--oppo.overcommit_window",
        "--oppo.overcommit_inc",
        "--oppo.overcommit_max",
        "--bench.seed_prompt_order",
    }
    assert _flags_named("--oppo.* and --oppo.FLAG") == set()


def test_every_option_has_a_help_sentence(cli_help):
    options = _oppo_options(cli_help)
    assert "--oppo.enable" in options
    for flag, entry in options.items():
        assert re.search(r"[a-z]{3,}.*\.", entry[len(flag) :]), f"{flag} has no help sentence: {entry}"


def test_every_option_is_in_the_docs(cli_help):
    named = set().union(*(_flags_named(page.read_text()) for page in GUIDES))
    missing = sorted(set(_oppo_options(cli_help)) - named)
    assert not missing, f"in no page of the README and docs/: {missing}"


def test_every_flag_the_docs_name_is_an_option(cli_help):
    options = _oppo_options(cli_help)
    unknown = {page.name: sorted(_flags_named(page.read_text()) - set(options)) for page in GUIDES}
    assert not any(unknown.values()), unknown


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[`*_\[\]]|\(http[^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
    return {_slug(heading) for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page):
    """Every relative link names a file of the repository, and its ``#anchor`` a heading of the page."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not checked here
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, broken


def _backticked(page: Path) -> list:
    return re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M))


def _names_code(ref: str, modules: dict) -> bool:
    """``module.Name``, ``module._name`` or ``module.a.b`` of one of ``modules``."""
    module, *names = ref.split(".")
    if module not in modules or not names or not all(name.isidentifier() for name in names):
        return False
    return len(names) > 1 or names[0][0].isupper() or names[0].startswith("_")


def _defined(path: Path) -> set:
    """The names a module defines: its classes, functions and methods (at any depth), and its assignments."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _modules() -> dict:
    """``openrlhf_oppo``'s modules by their last name, where that name is one module's."""
    found = {}
    for path in (ROOT / "openrlhf_oppo").rglob("*.py"):
        found.setdefault(path.stem, []).append(path)
    return {name: paths[0] for name, paths in found.items() if len(paths) == 1}


@pytest.mark.parametrize("page", GUIDES, ids=[str(p.relative_to(ROOT)) for p in GUIDES])
def test_the_code_a_page_points_to_exists(page):
    """What a page names in backticks: a repository path (``examples/scripts/*.sh``), a file (``placement.py``,
    ``test_cli.py::test_which_roles_stream``), or a module's definition (``scorer.ChunkScorer._batches``,
    ``config._resolve_plan``; a lowercase ``experience.stream`` may be an object's attribute: not checked)."""
    modules, tests, missing = _modules(), ROOT / "tests", []
    files = {path.name for path in ROOT.rglob("*.py") if ".venv" not in path.parts}
    for ref in _backticked(page):
        if ref.startswith(REPO_FOLDERS) and " " not in ref:
            missing += [] if _exists(ref) else [ref]
        elif re.fullmatch(r"test_\w+\.py(::\w+)?(\.\.\.)?(\[[^\]]*\])?", ref):
            file, _, name = ref.partition("::")
            test = re.match(r"\w+", name).group() if name else ""
            path = tests / file
            if not path.exists() or (test and not any(n.startswith(test) for n in _defined(path))):
                missing.append(ref)
        elif re.fullmatch(r"[\w/]+\.py", ref):
            missing += [] if Path(ref).name in files else [ref]
        elif _names_code(ref, modules):
            module, *names = ref.split(".")
            missing += [] if set(names) <= _defined(modules[module]) else [ref]
    assert not missing, missing
