"""A sitting of a paired SST-2 study (bench.clip_modes, bench.user_level) on tiny local files, its arms faked.

The study's ``main`` then plans, stamps and records its runs as it would, in a second and without torch: the data and
GGUF files are a few bytes, the machine is :data:`MACHINE`, and each planned run "finishes" at once.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench.study import sst2

MACHINE = {"cpu_model": "test cpu", "logical_cpus": 2, "memory_gib": 1.0, "gpu": None, "torch": "x",
           "transformers": "x", "lightning": "x", "opacus": "x"}  # fmt: skip
MACHINE_LINE = "test cpu, 2 logical CPUs, 1.0 GiB, no GPU; torch x, transformers x, lightning x, opacus x"
"""``bench.machine.machine_description(MACHINE)``."""

FINISHED = {"status": "ok", "val_acc": 0.8, "epsilon_spent": 8.0, "delta": 1e-3, "noise_multiplier": 0.4, "steps": 10,
            "step_time_median_s": 1.0, "step_batch_sizes": [8], "clip": {"clip_mode": "fixed"}}  # fmt: skip
"""What a faked arm reports."""


def data_root(tmp_path: Path, rows: int = 40) -> Path:
    """A shared data folder: SST-2 train.tsv and dev.tsv of ``rows`` rows each, and a few-byte GGUF file."""
    root = tmp_path / "data"
    glue = root / sst2.SST2_DIR
    glue.mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv"):
        body = "".join(f"sentence {i} {'x' * (i % 7)}\t{i % 2}\n" for i in range(rows))
        (glue / name).write_text("sentence\tlabel\n" + body, encoding="utf-8")
    gguf = root / sst2.GGUF_DIR / sst2.GGUF_FILE
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF" + bytes(60))
    return root


def sitting(study: ModuleType, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[dict[str, Any]]:
    """Run ``study.main(argv)`` with its arms faked (:data:`FINISHED`); the runs it planned."""
    planned: list[dict[str, Any]] = []

    def run_all(runs: list[dict[str, Any]], results: dict[str, Any], **_: Any) -> None:
        planned.extend(runs)
        results["runs"] += [{**run, **FINISHED} for run in runs]

    monkeypatch.setattr(study, "machine_info", lambda *_: MACHINE)
    monkeypatch.setattr(study, "install_stop_handlers", lambda: None)
    monkeypatch.setattr(study, "run_all", run_all)
    study.main(argv)
    return planned


def study_argv(tmp_path: Path, root: Path, *extra: str) -> list[str]:
    """The flags of a sitting on ``root``'s files (GGUF loaded by every arm: no conversion), results in tmp_path."""
    return ["--data-root", str(root), "--no-cache", "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs"),
            "--eval-examples", "16", *extra]  # fmt: skip
