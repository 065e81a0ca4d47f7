"""DP is never dropped without saying so, and the ledger accounts for every step that touched the data."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from dplit.cli.lightning_cli import run_cli
from dplit.privacy.ledger import history_steps
from dplit.privacy.warnings import PrivacyWarning
from dplit.strategy import INTERRUPT_CHECKPOINT, DPStrategy
from tests.helpers.commands import quickstart_args, steps
from tests.helpers.executable import dplit_executable, popen_receiving_ctrl_c, user_environment
from tests.helpers.fitting import CrashAtStep, fit, make_model
from tests.helpers.tiny import RandomTokenData


def _ledger(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "privacy_ledger.json").read_text())


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_a_fit_without_dp_strategy_is_refused_unless_non_private(strategy: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"trainer.strategy='{strategy}' trains WITHOUT differential privacy"):
        run_cli(["fit", *quickstart_args(tmp_path, *steps(1), "--trainer.strategy", strategy)])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_non_private_run_says_so_first_and_in_its_hyperparameters(tmp_path: Path) -> None:
    args = quickstart_args(tmp_path, *steps(1), "--trainer.strategy", "auto", "--non_private", "true")
    with pytest.warns(PrivacyWarning, match="NON-PRIVATE run"):
        cli = run_cli(["fit", *args])
    assert not isinstance(cli.trainer.strategy, DPStrategy)
    assert yaml.safe_load((Path(cli.trainer.log_dir) / "hparams.yaml").read_text())["non_private"] is True
    assert not list(tmp_path.rglob("privacy_ledger.json"))


def test_a_private_run_logs_non_private_false(tmp_path: Path) -> None:
    cli = run_cli(["fit", *quickstart_args(tmp_path, *steps(1))])
    assert yaml.safe_load((Path(cli.trainer.log_dir) / "hparams.yaml").read_text())["non_private"] is False


def test_non_private_beside_dp_strategy_is_a_contradiction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--non_private true contradicts trainer.strategy=DPStrategy"):
        run_cli(["fit", *quickstart_args(tmp_path, *steps(1), "--non_private", "true")])


def test_resuming_a_dp_checkpoint_without_dp_is_refused(tmp_path: Path) -> None:
    first = run_cli(["fit", *quickstart_args(tmp_path / "a", *steps(1))])
    checkpoint = next(Path(first.trainer.log_dir).rglob("*.ckpt"))
    args = quickstart_args(tmp_path / "b", *steps(2), "--trainer.strategy", "auto", "--ckpt_path", str(checkpoint))
    with pytest.raises(ValueError, match="WITHOUT differential privacy"):
        run_cli(["fit", *args])


@pytest.mark.parametrize(
    ("trainer_kwargs", "message"),
    [
        ({"fast_dev_run": 1}, "trainer.fast_dev_run is refused with DPStrategy"),
        ({"precision": "16-true"}, "trainer.precision='16-true' is not supported with DPStrategy"),
        ({"precision": "bf16-true"}, "trainer.precision='bf16-true' is not supported with DPStrategy"),
    ],
)
def test_settings_that_spend_privacy_wrongly_are_refused(tmp_path: Path, trainer_kwargs: dict, message: str) -> None:
    strategy = DPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, accelerator="cpu")
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=2, default_root_dir=tmp_path, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(make_model().float(), RandomTokenData())
    assert trainer.global_step == 0 and not list(tmp_path.rglob("privacy_ledger.json"))


def test_delta_of_one_over_n_or_more_is_refused_unless_allowed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"target_delta=0.0156 is ≥ 1/N = 0.0156 for N=64 .*allow_large_delta"):
        fit(tmp_path / "a", make_model(), max_steps=1, noise_multiplier=1.0, target_delta=1 / 64)
    assert not list((tmp_path / "a").rglob("privacy_ledger.json"))
    with pytest.warns(PrivacyWarning, match="allowed by DPStrategy.allow_large_delta"):
        _, strategy = fit(
            tmp_path / "b", make_model(), max_steps=1, noise_multiplier=1.0, target_delta=0.1, allow_large_delta=True
        )
    assert strategy.accountant.steps == 1


def test_no_noise_warns_and_writes_strict_json(tmp_path: Path) -> None:
    with pytest.warns(PrivacyWarning, match="NOT differentially private"):
        trainer, _ = fit(tmp_path, make_model(), max_steps=1, noise_multiplier=0.0)
    text = (Path(trainer.log_dir) / "privacy_ledger.json").read_text()
    assert "Infinity" not in text and json.loads(text)["epsilon"] is None and json.loads(text)["epsilon_infinite"]


def test_a_spent_budget_stops_before_the_step_and_a_zero_step_resume_writes_its_ledger(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    first, _ = fit(tmp_path, make_model(), max_steps=4, target_epsilon=2.0, noise_multiplier=None, callbacks=[checkpoints])
    with pytest.warns(PrivacyWarning, match=r"privacy budget spent: .* after 4 DP steps"):
        second, strategy = fit(
            tmp_path, make_model(), max_steps=8, target_epsilon=2.0, noise_multiplier=None,
            ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        )  # fmt: skip
    assert second.global_step == strategy.accountant.steps == 4  # no refused step advanced the step counter
    assert second.log_dir != first.log_dir and _ledger(Path(second.log_dir))["accountant"]["history"][0][2] == 4
    assert _ledger(Path(second.log_dir))["epsilon"] <= 2.0


def test_the_budget_stop_comes_before_the_step_that_would_exceed_it(tmp_path: Path) -> None:
    """A plan longer than the calibrated one (a resume with more epochs) ends the moment the budget is spent."""
    _, planned = fit(tmp_path / "plan", make_model(), max_steps=3, target_epsilon=1.0, noise_multiplier=None)
    sigma = planned.noise_multiplier
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    fit(tmp_path, make_model(), max_steps=3, target_epsilon=1.0, noise_multiplier=None, callbacks=[checkpoints])
    lr_seen: list[float] = []

    class LearningRates(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            lr_seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer, strategy = fit(
        tmp_path, make_model(), max_steps=10, target_epsilon=1.0, noise_multiplier=None,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), callbacks=[LearningRates()],
    )  # fmt: skip
    assert strategy.noise_multiplier == sigma and trainer.global_step == strategy.accountant.steps == 3
    assert lr_seen == []  # not one more batch was drawn


def test_an_interrupt_saves_a_checkpoint_with_the_ledger(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(SystemExit):
        fit(tmp_path, make_model(), max_steps=8, noise_multiplier=1.0, callbacks=[checkpoints, CrashAtStep(3, KeyboardInterrupt())])
    saved = torch.load(tmp_path / "ckpt" / INTERRUPT_CHECKPOINT, weights_only=True)
    assert saved["global_step"] == 3 and saved["dplit_privacy"]["accountant"]["history"] == [(1.0, 0.25, 3)]
    _, strategy = fit(tmp_path, make_model(), max_steps=5, noise_multiplier=1.0, ckpt_path=str(tmp_path / "ckpt" / INTERRUPT_CHECKPOINT))
    assert strategy.accountant.steps == 5


def test_a_refusal_before_the_first_step_saves_no_interrupt_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="target_delta"):
        fit(tmp_path, make_model(), max_steps=2, noise_multiplier=1.0, target_delta=0.5)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_resuming_an_older_checkpoint_keeps_counting_the_steps_after_it(tmp_path: Path) -> None:
    """Steps taken after the last checkpoint touched the data: a resume from that checkpoint still counts them."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(RuntimeError, match="disk on fire"):  # on a crash with DDP no checkpoint may be written
        fit(tmp_path, make_model(), max_steps=8, noise_multiplier=1.0,
            callbacks=[checkpoints, CrashAtStep(3, RuntimeError("disk on fire"))])  # fmt: skip
    (tmp_path / "ckpt" / INTERRUPT_CHECKPOINT).unlink()  # as if killed (-9) before it was written
    older = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    with pytest.warns(PrivacyWarning, match=r"has 2 DP steps, but this run's newest ledger .* records 3: .* last 1 steps"):
        trainer, strategy = fit(tmp_path, make_model(), max_steps=4, noise_multiplier=1.0, ckpt_path=str(older))
    assert trainer.global_step == 4 and strategy.accountant.steps == 5  # 2 + 1 discarded + 2 new
    assert _ledger(Path(trainer.log_dir))["accountant"]["history"] == [[1.0, 0.25, 5]]


def test_another_runs_ledger_is_not_adopted(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path, make_model(), max_steps=2, noise_multiplier=1.0, callbacks=[checkpoints])
    fit(tmp_path, make_model(), max_steps=6, noise_multiplier=1.0)  # a different run in the same root
    _, strategy = fit(tmp_path, make_model(), max_steps=3, noise_multiplier=1.0, ckpt_path=str(next((tmp_path / "ckpt").glob("*.ckpt"))))
    assert strategy.accountant.steps == 3


def test_ckpt_path_last_resumes_the_newest_checkpoint_of_the_run(tmp_path: Path) -> None:
    sigma = ["--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1"]
    first = run_cli(["fit", *quickstart_args(tmp_path, *steps(2), *sigma)])
    assert first.trainer.strategy.accountant.steps == 2
    second = run_cli(["fit", *quickstart_args(tmp_path, *steps(2), *sigma, "--trainer.max_epochs", "2", "--ckpt_path", "last")])
    assert second.trainer.strategy.accountant.steps == second.trainer.global_step == 4
    assert second.trainer.log_dir != first.trainer.log_dir


def test_ckpt_path_last_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--ckpt_path last: no .*checkpoint.* nothing to resume"):
        run_cli(["fit", *quickstart_args(tmp_path, *steps(1), "--ckpt_path", "last")])


@pytest.mark.parametrize("subcommand", ["predict"])
def test_subcommands_that_cannot_work_are_not_offered(subcommand: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        run_cli([subcommand, *quickstart_args(tmp_path)])
    assert stop.value.code == 2 and "dplit: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_keeps_every_step_in_a_checkpoint(tmp_path: Path) -> None:
    """SIGINT to the real executable mid-run: interrupted.ckpt holds exactly the steps the ledger file counts."""
    sigma = ["--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1"]
    command = [dplit_executable(), "fit", *quickstart_args(tmp_path, *sigma,
               "--trainer.max_steps", "200", "--trainer.max_epochs", "100",  # never done before the interrupt
               "--trainer.limit_val_batches", "0")]  # fmt: skip
    process = popen_receiving_ctrl_c(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=user_environment())
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        ledgers = list(tmp_path.rglob("privacy_ledger.json"))
        if ledgers and _steps(json.loads(ledgers[0].read_text())) >= 2:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=300)  # a loaded machine: the shutdown after the interrupt can be slow
    assert process.returncode == 128 + signal.SIGINT and "Traceback" not in output, output  # 130, as a shell says
    saved = torch.load(next(tmp_path.rglob(INTERRUPT_CHECKPOINT)), weights_only=True)
    counted = _steps(json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text()))
    assert _steps(saved["dplit_privacy"]) == counted >= 2
    assert saved["global_step"] in (counted - 1, counted)  # Ctrl-C during an optimizer update: that step is counted
    assert re.search(rf"dplit: WARNING: DP-SGD: training stopped by KeyboardInterrupt after {counted} DP steps", output)


def _steps(ledger: dict[str, Any]) -> int:
    return history_steps(ledger["accountant"]["history"])
