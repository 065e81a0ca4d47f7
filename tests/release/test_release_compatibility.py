"""Checkpoints a released dplit wrote keep working after the code moves: class paths, resume, export.

The checkpoints under ``tests/fixtures/release-0.1.0`` are 2-step runs of the two quickstarts, written by a clean
clone of the release (``tests/fixtures/make_release_checkpoints.sh``). A layout change that breaks a class path a
checkpoint or config names, or the way a checkpoint's ledger and history are read, fails here.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.helpers.executable import run_dplit_in_process
from tests.helpers.paths import REPOSITORY

FIXTURES = REPOSITORY / "tests" / "fixtures" / "release-0.1.0"
COMMANDS = {"quickstart": ("fit",), "lm_quickstart": ("lm", "fit")}
"""Each fixture run and the dplit command that wrote it."""


def checkpoint_of(name: str) -> Path:
    return FIXTURES / name / "checkpoints" / "last.ckpt"


def class_paths(config: Any) -> Iterator[str]:
    """Every ``class_path`` a (parsed) config names, at any depth."""
    if isinstance(config, dict):
        for key, value in config.items():
            if key == "class_path" and isinstance(value, str):
                yield value
            else:
                yield from class_paths(value)
    elif isinstance(config, list):
        for item in config:
            yield from class_paths(item)


def imports_a_class(path: str) -> bool:
    module, _, name = path.rpartition(".")
    return inspect.isclass(getattr(importlib.import_module(module), name, None))


@pytest.mark.parametrize("name", COMMANDS)
def test_every_class_path_a_released_checkpoint_and_its_config_name_still_imports(name: str) -> None:
    release = torch.load(checkpoint_of(name), weights_only=True)["dplit_release"]
    config = yaml.safe_load((FIXTURES / name / "config.yaml").read_text())
    named = [release["module"], release["datamodule"], release["embeddings"]["class_path"], *class_paths(config)]
    assert len(named) >= 5 and [path for path in named if not imports_a_class(path)] == []


@pytest.mark.parametrize("name", COMMANDS)
def test_a_released_checkpoint_resumes_and_its_privacy_history_continues(name: str, tmp_path: Path) -> None:
    result = run_dplit_in_process(
        *COMMANDS[name], "--config", str(FIXTURES / name / "config.yaml"), "--ckpt_path", str(checkpoint_of(name)),
        "--trainer.max_steps", "3", "--trainer.strategy.init_args.target_epsilon", "20",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    released = json.loads((FIXTURES / name / "privacy_ledger.json").read_text())
    assert ledger["run_id"] == released["run_id"]  # the same run, continued
    assert [count for _, _, count in ledger["accountant"]["history"]] == [3]
    assert ledger["epsilon_steps"] == 3 and ledger["epsilon"] > released["epsilon"]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_released_checkpoint_exports_with_the_epsilon_its_ledger_records(name: str, tmp_path: Path) -> None:
    result = run_dplit_in_process("export", "--ckpt_path", str(checkpoint_of(name)), "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    guarantee = json.loads((tmp_path / "out" / "dp_guarantee.json").read_text())
    released = json.loads((FIXTURES / name / "privacy_ledger.json").read_text())
    assert guarantee["differentially_private"] is True
    assert guarantee["epsilon"] == pytest.approx(released["epsilon"], rel=1e-9)
