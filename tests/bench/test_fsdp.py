"""bench/fsdp.py at the tiny size: three arms in two gloo processes each, results.json and table.md written.

The state ratio is computed from the tensors' local sizes, so it is checked against its target here; the step
times are not (this machine runs other tests beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPOSITORY

ARMS = ["dp_fsdp", "dp_ddp", "non_private_fsdp"]


@pytest.mark.slow
def test_the_tiny_benchmark_writes_every_arm_and_a_sharded_rank_holds_about_half_the_state(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.fsdp", "--size", "tiny", "--batch-size", "4", "--seq-len", "16",
               "--warmup", "0", "--steps", "1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["arms"]) == ARMS
    for arm in results["arms"].values():
        assert arm["status"] == "ok", arm
        assert len(arm["ranks"]) == 2 and arm["step_time_s"] > 0 and arm["peak_mem_mb"] > 0
    ratios = {ratio["field"]: ratio for ratio in results["ratios"]}
    assert ratios["state_bytes"]["value"] <= 0.55 and ratios["state_bytes"]["met"] is True
    assert ratios["step_time_s"]["value"] > 0 and ratios["peak_mem_mb"]["value"] > 0
    whole, shard = (results["arms"][arm]["ranks"][0]["state"] for arm in ("dp_ddp", "dp_fsdp"))
    assert whole["parameters"] == 4 * results["arms"]["dp_ddp"]["ranks"][0]["parameters"]  # float32, every weight
    assert shard["parameters"] <= 0.51 * whole["parameters"]
    table = (tmp_path / "table.md").read_text()
    for arm in ARMS:
        assert f"| {arm} | ok |" in table
    assert "| state per rank dp_fsdp / dp_ddp |" in table and results["machine"]["cpu_model"] in table
