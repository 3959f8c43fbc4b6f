"""Lint as OpenRLHF does (pre-commit: black and isort at line length 119, autoflake)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["openrlhf_oppo", "tests", "examples", "setup.py"]


@pytest.mark.process
@pytest.mark.parametrize(
    "tool",
    [
        ["black", "--check", "--quiet"],
        ["isort", "--check-only", "--quiet"],
        ["autoflake", "--check", "--quiet", "--recursive", "--remove-all-unused-imports"],
    ],
    ids=["black", "isort", "autoflake"],
)
def test_formatting(tool):
    result = subprocess.run([sys.executable, "-m", *tool, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
