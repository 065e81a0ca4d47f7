"""``dplit dpo fit`` end to end: the quickstart config trains privately offline, above chance, and says the unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dplit.cli.lightning_cli import run_dpo_cli
from tests.helpers.commands import dpo_args
from tests.helpers.executable import run_dplit_in_process


@pytest.mark.slow
def test_dpo_quickstart_learns_the_preference_privately_and_its_card_says_pair(tmp_path: Path) -> None:
    args = dpo_args(tmp_path, "--data.builtin_train_size", "600", "--data.builtin_val_size", "100",
                    "--data.batch_size", "60", "--trainer.max_epochs", "1", "--trainer.val_check_interval", "1.0")  # fmt: skip
    before = run_dpo_cli(["validate", *args]).trainer.callback_metrics
    assert float(before["val/reward_accuracy"]) == 0.0 and float(before["val/margin"]) == 0.0  # policy = reference
    cli = run_dpo_cli(["fit", *args])
    metrics = cli.trainer.callback_metrics
    assert float(metrics["val/reward_accuracy"]) > 0.6 and float(metrics["val/margin"]) > 0
    assert float(metrics["val/logp_chosen"]) > float(metrics["val/logp_rejected"])
    dpsgd = cli.trainer.strategy.dpsgd
    assert dpsgd.dataset_size == 600 and dpsgd.sample_rate == pytest.approx(60 / 600)  # q over pairs
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    assert ledger["privacy_unit"] == "pair" and ledger["dataset_size"] == 600 and 0 < ledger["epsilon"] <= 8
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    again = run_dpo_cli(["validate", *args, "--ckpt_path", str(checkpoint)]).trainer.callback_metrics
    assert float(again["val/reward_accuracy"]) == pytest.approx(float(metrics["val/reward_accuracy"]))
    with pytest.raises(ValueError, match="DPO reference .* is not the one the checkpoint was trained against"):
        run_dpo_cli(["validate", *args, "--seed_everything", "1", "--ckpt_path", str(checkpoint)])
    out = run_dplit_in_process("export", "--ckpt_path", str(checkpoint), "--output_dir", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "DP per preference pair" in out.stdout + out.stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "with respect to one preference pair" in card and "of the 600 training pairs" in card
    (tmp_path / "prompts.txt").write_text("the movie is\n")
    samples = run_dplit_in_process("lm", "generate", "--model", str(tmp_path / "out"), "--prompts_file",
                                   str(tmp_path / "prompts.txt"), "--max_new_tokens", "3", "--num_samples", "1",
                                   "--output_file", str(tmp_path / "samples.jsonl"))  # fmt: skip
    assert samples.returncode == 0, samples.stderr
    assert "differentially private per preference pair" in samples.stdout + samples.stderr


@pytest.mark.slow
def test_user_level_dpo_samples_and_accounts_users(tmp_path: Path) -> None:
    args = dpo_args(tmp_path, "--data.builtin_train_size", "300", "--data.batch_size", "20", "--trainer.max_epochs", "1",
                    "--data.privacy_unit", "user", "--data.max_rows_per_user", "2")  # fmt: skip
    cli = run_dpo_cli(["fit", *args])
    dpsgd, dataset = cli.trainer.strategy.dpsgd, cli.datamodule.dataset("train")
    users = len(set(dataset.users))
    assert dpsgd.dataset_size == users < len(dataset) and dpsgd.sample_rate == pytest.approx(20 / users)
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    assert ledger["privacy_unit"] == "user" and ledger["users"] == users and ledger["max_rows_per_user"] == 2
