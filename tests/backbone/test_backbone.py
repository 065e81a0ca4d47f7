"""build_causal_lm's refusals that name the flag (the rest of its behaviour is tested in test_families.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.executable import refusal_line, run_dplit_in_process
from tests.helpers.paths import REPOSITORY

CONFIGS = REPOSITORY / "configs"


def quickstart(*flags: str, root: Path) -> subprocess.CompletedProcess[str]:
    """``dplit fit`` of the quickstart config with ``flags``, logging under ``root``, run in this process."""
    config = ["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.default_root_dir", str(root / "run")]
    return run_dplit_in_process("fit", *config, *flags)


def test_a_folder_without_config_json_is_named_as_not_a_model_folder(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a model")
    error = refusal_line(quickstart("--model.config", "null", "--model.pretrained", str(folder), root=tmp_path))
    assert f"model.pretrained='{folder}': the folder is not a model folder (no config.json)" in error


def test_a_peft_method_that_cannot_wrap_gpt2s_conv1d_names_model_peft(tmp_path: Path) -> None:
    loha = '{"class_path": "peft.LoHaConfig", "init_args": {"r": 4, "target_modules": ["c_attn"]}}'
    error = refusal_line(quickstart("--model.peft", loha, root=tmp_path))
    assert error.startswith("dplit: error: model.peft: Target module of type") and "use LoRA" in error
