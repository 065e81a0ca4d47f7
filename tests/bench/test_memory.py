"""bench/memory.py at the tiny size: the eight arms each in its own process, results.json and table.md written.

The resident-bytes ratio (b) is computed from the tensors' stored sizes, so it is checked against its target here;
the step times and peaks are not (this machine runs other tests beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPOSITORY

ARMS = [f"{kind}_{base}{ckpt}" for kind in ("dp", "non_private") for base in ("lora", "qlora")
        for ckpt in ("", "_checkpointed")]  # fmt: skip

pytest.importorskip("bitsandbytes")


@pytest.mark.slow
def test_the_tiny_benchmark_writes_every_arm_and_a_4bit_base_holds_a_third_of_the_bytes(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.memory", "--size", "tiny", "--batch-size", "2", "--seq-len", "32",
               "--warmup", "0", "--steps", "1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["arms"]) == ARMS
    for arm in results["arms"].values():
        assert arm["status"] == "ok", arm
        assert arm["step_time_s"] > 0 and arm["step_cpu_s"] > 0 and arm["peak_mem_mb"] >= arm["setup_mem_mb"] > 0
        assert arm["memory_kind"] == "peak_rss" and arm["trainable"] > 0
    lora, qlora = (results["arms"][arm]["model_bytes_detail"] for arm in ("dp_lora", "dp_qlora"))
    assert lora["quant_state"] == 0 and qlora["quant_state"] > 0
    assert results["arms"]["dp_lora"]["trainable"] == results["arms"]["dp_qlora"]["trainable"]  # the same adapters
    ratios = {ratio["name"]: ratio for ratio in results["ratios"]}
    resident = ratios["(b) model resident bytes dp_lora / dp_qlora"]
    assert resident["value"] >= 3 and resident["met"] is True
    assert all(ratio["value"] > 0 for ratio in ratios.values())
    table = (tmp_path / "table.md").read_text()
    for arm in ARMS:
        assert f"| {arm} | ok |" in table
    assert "| (b) model resident bytes dp_lora / dp_qlora |" in table and results["machine"]["cpu_model"] in table
