"""``python -m bench.step --task dpo``: the DPO rows of the step benchmark run, private and not (issue 53)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.models import make_batch
from bench.step import parse_args, run
from dplit.privacy.clipping.units import UNIT_KEY
from dplit.tasks.preference import CHOSEN_KEY


def dpo_args(method: str, tmp_path: Path) -> list[str]:
    return ["--method", method, "--policy", "tied", "--model", "tiny", "--task", "dpo", "--batch-size", "2",
            "--seq-len", "16", "--warmup", "0", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "r.json")]  # fmt: skip


def test_a_dpo_batch_is_pairs_of_two_rows_sharing_a_prompt_and_a_unit(tmp_path: Path) -> None:
    batch = make_batch(parse_args(dpo_args("non_private", tmp_path)), torch.device("cpu"))
    ids = batch["input_ids"]
    assert ids.shape == (4, 16) and batch[CHOSEN_KEY].tolist() == [1, 0, 1, 0]
    assert batch[UNIT_KEY].tolist() == [0, 0, 1, 1] and torch.equal(ids[0, :8], ids[1, :8])
    assert (
        not torch.equal(ids[0, 8:], ids[1, 8:])
        and batch["loss_mask"][:, 8:].all()
        and not batch["loss_mask"][:, :8].any()
    )


@pytest.mark.parametrize("method", ["non_private_lora", "dplit_ghost_lora", "non_private", "dplit_ghost"])
def test_the_dpo_step_benchmark_runs_each_method(method: str, tmp_path: Path) -> None:
    result = run(parse_args(dpo_args(method, tmp_path)))
    assert result["status"] == "ok", result["message"]
    assert result["task"] == "dpo" and result["step_time_s"] > 0 and result["peak_mem_mb"] > 0
