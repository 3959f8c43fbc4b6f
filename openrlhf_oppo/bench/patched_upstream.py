"""A copy of the installed OpenRLHF with ``patches/openrlhf`` applied (``--upstream_patches``).

The patches are the upstream changes OPPO would like merged (hooks and fixes). Some make upstream itself
faster, so a run on the patched copy compares OPPO with the upstream that would ship them.
"""

import shutil
import subprocess
from pathlib import Path
from typing import List

import openrlhf

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches" / "openrlhf"


def patches() -> List[Path]:
    found = sorted(PATCHES_DIR.glob("*.patch"))
    if not found:
        raise FileNotFoundError(f"no patches in {PATCHES_DIR}: run from a checkout of openrlhf-oppo")
    return found


def make_patched_copy(root: str) -> str:
    """Copy the installed ``openrlhf`` package under ``root``, apply the patches in order, and return the
    folder to put first on ``PYTHONPATH`` (it holds ``openrlhf/``). Made afresh on every call."""
    root = Path(root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copytree(Path(openrlhf.__file__).parent, root / "openrlhf", ignore=shutil.ignore_patterns("__pycache__"))
    for patch in patches():
        # ``git apply`` works outside a repository, with paths relative to the current folder.
        result = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=root, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to openrlhf {openrlhf.__version__}: {result.stderr}")
    return str(root)
