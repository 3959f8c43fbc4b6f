"""Other libraries' output that tells a user nothing to do, kept off the console and in a log file.

Importing torch, vLLM, DeepSpeed and Ray prints deprecation notices and hardware probes (pynvml, Triton,
DeepSpeed's accelerator) before a run says anything; building the demo's checkpoints prints progress bars and
transformers' load reports. ``filtered`` keeps the lines of ``NOISE`` out of the console while the libraries
import and lets every other line through; ``to_log`` sends everything but the caller's own lines to the log. Both
write what they held back to the log, so nothing is lost.
"""

import os
import re
import sys
import tempfile
from contextlib import contextmanager

# Lines the libraries print while they import that ask nothing of the user. A Python warning's second line (the
# source line, indented) goes with it.
NOISE = [
    re.compile(p)
    for p in (
        r"FutureWarning: The pynvml package is deprecated",
        r"Triton is installed, but `triton\.backends` could not be imported",
        r"Triton not installed or not compatible",
        r"\[real_accelerator\.py:\d+:get_accelerator\] Setting (ds_)?accelerator to",
        r"FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator",
    )
]


def log_path() -> str:
    """Where the CLI keeps what it held back: one file a user, each run's lines appended."""
    folder = os.path.join(tempfile.gettempdir(), f"openrlhf-oppo-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, "library-output.log")


def shown(text: str) -> str:
    """``text`` without the lines of ``NOISE`` (and a warning's source line after one)."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        if dropping and line.startswith("  "):
            continue
        dropping = any(pattern.search(line) for pattern in NOISE)
        if not dropping:
            kept.append(line)
    return "".join(kept)


@contextmanager
def _captured():
    """What the process writes to stdout and stderr (C code included) goes to two temporary files, which it yields;
    the descriptors are put back whatever happens."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile(mode="w+b") for fd in (1, 2)}
    try:
        for fd, f in files.items():
            os.dup2(f.fileno(), fd)
        yield files
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


@contextmanager
def filtered(log: str = None):
    """Inside, stdout and stderr are held; on the way out (an error included) every line not of ``NOISE`` is
    written where it was going, and everything to ``log`` (default ``log_path()``). OPENRLHF_OPPO_VERBOSE=1 shows
    it all as it comes."""
    if os.environ.get("OPENRLHF_OPPO_VERBOSE") == "1":
        yield
        return
    try:
        with _captured() as files:
            yield
    finally:
        held = {fd: f.seek(0) or f.read().decode("utf-8", errors="replace") for fd, f in files.items()}
        with open(log or log_path(), "a", encoding="utf-8") as f:
            f.write(held[1] + held[2])
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.write(shown(held[fd]))
            stream.flush()


@contextmanager
def to_log(log: str):
    """Inside, whatever the process writes to stdout and stderr is appended to ``log``; yields a text stream to the
    console, for the caller's own lines. On the way out (an error included) the console is the console again."""
    with open(log, "a", encoding="utf-8") as target:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        console = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8")
        try:
            for fd in (1, 2):
                os.dup2(target.fileno(), fd)
            yield console
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            console.close()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
