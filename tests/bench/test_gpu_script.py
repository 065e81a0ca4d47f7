"""bench/gpu.sh on a machine without CUDA: it records every part as skipped, with the reason, and exits 0.

The script is run with ``CUDA_VISIBLE_DEVICES=""`` so that torch sees no GPU on any machine (a GPU machine would
otherwise run the whole 9-minute script here); its summary goes to a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY
SCRIPT = ROOT / "bench" / "gpu.sh"
PARTS = ["tests", "bench_gpt2", "bench_smollm2", "tying", "fsdp_smoke", "memory_smoke", "packing"]


def run_script(out: Path, work: Path, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess[str]:
    """``bash bench/gpu.sh`` (or ``script``) from the repository root with its outputs in ``out`` and ``work``."""
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "DPLIT_GPU_OUT": str(out),
        "DPLIT_GPU_WORK": str(work),
        "CUDA_VISIBLE_DEVICES": "",
        **env,
    }
    return subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.slow
def test_without_cuda_every_part_is_skipped_with_the_reason(tmp_path: Path) -> None:
    done = run_script(tmp_path / "out", tmp_path / "work", SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["complete"] and summary["exit_code"] == 0 and summary["cuda_available"] is False
    assert [part["name"] for part in summary["parts"]] == PARTS
    for part in summary["parts"]:
        assert part["status"] == "skipped" and part["exit_code"] is None, part
        assert "CUDA is not available" in part["reason"], part
        assert part["command"], part  # what it would have run
    packing = str(next(part["command"] for part in summary["parts"] if part["name"] == "packing"))
    assert all(word in packing for word in ("gpt2", "smollm2", "512", "1024")), packing  # issue 54's rows
    machine = summary["machine"]
    assert machine["torch"] and machine["cuda_available"] is False
    table = (tmp_path / "out" / "summary.md").read_text()
    for name in PARTS:
        assert f"| {name} | skipped |" in table
    assert "No CUDA" in table
    assert not (tmp_path / "out" / "parts.tsv").exists()


@pytest.mark.slow
def test_a_cpu_run_never_replaces_a_gpu_runs_summary_in_the_default_folder(tmp_path: Path) -> None:
    """Only without DPLIT_GPU_OUT: the committed folder's GPU summary stays; the CPU summary goes to the work folder."""
    script_dir = tmp_path / "checkout" / "bench"
    script_dir.mkdir(parents=True)
    (script_dir / "gpu.sh").write_text(SCRIPT.read_text())
    committed = script_dir / "results" / "gpu"
    committed.mkdir(parents=True)
    (committed / "summary.json").write_text(json.dumps({"cuda_available": True}, indent=1))
    environment = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT),
                   "DPLIT_GPU_WORK": str(tmp_path / "work")}
    environment.pop("DPLIT_GPU_OUT", None)
    done = subprocess.run(["bash", str(script_dir / "gpu.sh")], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((committed / "summary.json").read_text()) == {"cuda_available": True}
    assert json.loads((tmp_path / "work" / "cpu-check" / "summary.json").read_text())["cuda_available"] is False


