"""GLUE from the hub with no network: one line naming the flag that fixes it, through the real executable."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.executable import dplit_executable, user_environment

CONFIGS = Path(__file__).parents[1] / "configs"


def test_glue_from_an_unreachable_hub_is_one_line_naming_data_data_dir(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    environment = {**user_environment(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    command = [
        dplit_executable(), "fit", "--config", str(CONFIGS / "sst2_untied.yaml"),
        "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true", "--data.tokenizer", str(tiny_bpe_dir),
        "--model.pretrained", "null", "--model.config", '{"n_layer": 1, "n_embd": 16, "n_head": 2}',
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("dplit: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr and len(errors) == 1, result.stderr[-3000:]
    assert "data.task=sst2: GLUE's sst2 could not be loaded from the Hugging Face hub" in errors[0]
    assert "set data.data_dir" in errors[0]
    assert not list(tmp_path.rglob("privacy_ledger.json")) and not list(tmp_path.rglob("*.ckpt"))
