"""GLUE from the hub with no network: one line naming the flag that fixes it, through the real executable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.executable import refusal_line, run_dplit, user_environment
from tests.helpers.paths import REPOSITORY

CONFIGS = REPOSITORY / "configs"


@pytest.mark.slow
def test_glue_from_an_unreachable_hub_is_one_line_naming_data_data_dir(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    environment = {**user_environment(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = run_dplit(
        "fit", "--config", str(CONFIGS / "sst2_untied.yaml"),
        "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true", "--data.tokenizer", str(tiny_bpe_dir),
        "--model.pretrained", "null", "--model.config", '{"n_layer": 1, "n_embd": 16, "n_head": 2}',
        environment=environment,
    )  # fmt: skip
    error = refusal_line(result)
    assert "data.task=sst2: GLUE's sst2 could not be loaded from the Hugging Face hub" in error
    assert "set data.data_dir" in error
    assert not list(tmp_path.rglob("privacy_ledger.json")) and not list(tmp_path.rglob("*.ckpt"))
