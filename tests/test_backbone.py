"""build_causal_lm's refusals that name the flag (the rest of its behaviour is tested in test_families.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.executable import dplit_executable, user_environment

CONFIGS = Path(__file__).parents[1] / "configs"


def test_a_folder_without_config_json_is_named_as_not_a_model_folder(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a model")
    command = [dplit_executable(), "fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.config", "null",
               "--model.pretrained", str(folder), "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=user_environment(), timeout=600, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("dplit: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"model.pretrained='{folder}': the folder is not a model folder (no config.json)" in errors[0]


def test_a_peft_method_that_cannot_wrap_gpt2s_conv1d_names_model_peft(tmp_path: Path) -> None:
    loha = '{"class_path": "peft.LoHaConfig", "init_args": {"r": 4, "target_modules": ["c_attn"]}}'
    command = [dplit_executable(), "fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.peft", loha,
               "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=user_environment(), timeout=600, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("dplit: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("dplit: error: model.peft: Target module of type") and "use LoRA" in errors[0]
