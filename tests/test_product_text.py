"""The product speaks of the product: README, docs, examples and code describe what the software does and
how to run it, not how or by whom it was made (sessions, machines lent for it, issue numbers)."""

import gzip
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = re.compile(
    r"\bsessions?\b|\blanes?\b|\bleases?\b|\blent\b|device (call|time|tool)|wheel parts?|gpu.wheels|\bissue #?[0-9]"
    r"|not run here",
    re.IGNORECASE,
)


def _files():
    yield ROOT / "README.md"
    # The raw results too: the harness writes the machine's own folders as OUT, SCRATCH and WORKDIR.
    patterns = (
        "docs/**/*.md",
        "docs/**/*.txt",
        "docs/**/*.json",
        "docs/**/*.json.gz",
        "examples/**/*",
        "openrlhf_oppo/**/*.py",
    )
    for pattern in patterns:
        yield from (path for path in sorted(ROOT.glob(pattern)) if path.is_file())


def _text(path: Path) -> str:
    """A file's text; the raw results in docs/results are gzipped JSON."""
    if path.name.endswith(".json.gz"):
        return gzip.open(path, "rt", errors="replace").read()
    return path.read_text(errors="replace")


def test_no_words_about_how_the_project_was_made():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _files()
        for number, line in enumerate(_text(path).splitlines(), 1)
        if WORDS.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_the_check_finds_what_it_looks_for():
    for text in ("the second session", "lane a", "Lanes", "device time", "issue 3", "wheel part", "NOT RUN HERE"):
        assert WORDS.search(text), text
    for text in ("start_new_session=True", "release(uids)", "planes", "tissue 3"):
        assert not WORDS.search(text), text
