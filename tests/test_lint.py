"""Lint: ruff with the rule selection in pyproject.toml ([tool.ruff.lint]) finds nothing in the code or the tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY
CHECKED = ("dplit", "bench", "tests")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed in this environment (it comes with the test extra: pip install -e '.[test]')",
)
def test_ruff_finds_nothing() -> None:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *CHECKED]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        pytest.fail(f"`ruff check {' '.join(CHECKED)}` found:\n{result.stdout}{result.stderr}", pytrace=False)
