"""bench/audit.py's sittings: ``--resume`` lists each sitting (commit, date, machine) and keeps the earlier record.

The audits themselves take minutes (tests/audit); here ``execute`` is faked, and the committed table re-renders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import audit
from bench.audit_tables import table
from bench.machine import git_info
from tests.bench.study_sitting import MACHINE, MACHINE_LINE

RUNS = [{"table": 4, "setup": "fake", "mode": "white_box", "claimed": c, "mechanism": "correct", "canaries": 1}
        for c in (1.0, 2.0)]  # fmt: skip
"""A plan of two runs that no table shows (``execute`` is faked)."""

OLD = {"machine": {**MACHINE, "cpu_model": "old cpu"}, "profile": "default", "wall_s": 60.0,
       "git": {"commit": "b" * 40, "uncommitted_changes": [], "describe": "b" * 12},
       "resumed_from": {"commit": "a" * 40, "uncommitted_changes": [], "describe": "a" * 12},
       "runs": [{**RUNS[0], "report": {}, "wall_s": 1.0}]}  # fmt: skip
"""results.json as a resume wrote it before sittings were listed (its ``git`` overwritten, the one before kept)."""


def resume(output: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``python -m bench.audit --resume --output output`` with the audits faked; the results it wrote."""
    monkeypatch.setattr(audit, "plan", lambda smoke: RUNS)
    monkeypatch.setattr(audit, "machine_info", lambda: MACHINE)
    monkeypatch.setattr(audit, "install_stop_handlers", lambda: None)
    monkeypatch.setattr(audit, "execute", lambda run, index, logs, timeout: {**run, "error": "faked", "wall_s": 0.0})
    audit.main(["--resume", "--output", str(output)])
    return json.loads((output / "results.json").read_text())


def test_a_resume_lists_the_sittings_and_keeps_the_earlier_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "results.json").write_text(json.dumps(OLD))
    results = resume(tmp_path, monkeypatch)
    assert results["git"] == OLD["git"] and results["machine"] == OLD["machine"] and "resumed_from" not in results
    first, second, now = results["sittings"]
    assert first == {**OLD["resumed_from"], "date": None, "machine": None}
    assert second == {**OLD["git"], "date": None, "machine": None}
    assert now["commit"] == git_info()["commit"] and now["machine"] == MACHINE_LINE and now["date"][:2] == "20"
    text = (tmp_path / "table.md").read_text()
    assert f"- `{'a' * 12}`, date not recorded, machine not recorded\n" in text
    assert f"- `{now['describe']}`, {now['date']}, {MACHINE_LINE}\n" in text
    again = resume(tmp_path, monkeypatch)["sittings"]
    assert again[:3] == results["sittings"] and len(again) == 4


def test_a_grid_run_in_one_sitting_lists_no_sittings() -> None:
    one = {**OLD, "sittings": [audit.sitting(MACHINE, OLD["git"])]}
    assert table(one) == table(OLD) and "Sittings" not in table(one)


def test_the_committed_table_renders_byte_for_byte(tmp_path: Path) -> None:
    recorded = Path(__file__).parents[2] / "bench" / "results" / "audit"
    (tmp_path / "results.json").write_bytes((recorded / "results.json").read_bytes())
    audit.main(["--render", "--output", str(tmp_path)])
    assert (tmp_path / "table.md").read_text() == (recorded / "table.md").read_text()
