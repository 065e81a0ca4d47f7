"""``dplit lm fit --data.packing true``: the LM quickstart trains privately on packed rows, end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.commands import lm_args
from tests.helpers.executable import run_dplit, run_dplit_in_process

FILL = re.compile(r"packing: \d+ rows of 32 tokens were \d+\.\d% full")


def ledger_of(run: Path) -> dict[str, object]:
    """The run's privacy ledger."""
    return json.loads(next(run.rglob("privacy_ledger.json")).read_text())


@pytest.mark.slow
def test_the_lm_quickstart_trains_privately_on_packed_rows_through_the_executable(tmp_path: Path) -> None:
    result = run_dplit("lm", "fit", *lm_args(tmp_path, "--data.packing", "true", "--trainer.max_steps", "2"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert FILL.search(output) and "ghost clipping self-check passed" in output
    ledger = ledger_of(tmp_path)
    assert ledger["differentially_private"] is True and ledger["privacy_unit"] == "example"
    assert "isolated" in str(ledger["packing"]) and "rows of 32 tokens" in str(ledger["packing"])


@pytest.mark.slow
def test_packed_rows_under_user_level_dp_keep_the_user_as_the_unit(tmp_path: Path) -> None:
    extra = ("--data.packing", "true", "--data.privacy_unit", "user", "--data.max_rows_per_user", "3")
    result = run_dplit_in_process("lm", "fit", *lm_args(tmp_path, *extra, "--trainer.max_steps", "2"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ledger = ledger_of(tmp_path)
    assert ledger["privacy_unit"] == "user" and "packing" in ledger


def test_an_unpacked_run_says_nothing_of_packing(tmp_path: Path) -> None:
    result = run_dplit_in_process("lm", "fit", *lm_args(tmp_path, "--trainer.max_steps", "1"))
    assert result.returncode == 0 and not FILL.search(result.stdout + result.stderr)
    assert "packing" not in ledger_of(tmp_path)
