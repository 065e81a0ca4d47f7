"""The privacy history belongs to the weights: no refit, resume, seed or non-private step can shorten it (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from dplit.cli.lightning_cli import run_cli
from dplit.privacy.accounting import PrivacyAccountant, default_delta
from dplit.privacy.accounting.relations import epsilon_under
from dplit.privacy.history import (
    HISTORY_KEY,
    NON_PRIVATE_STEP,
    PrivacyHistory,
    history_in_checkpoint,
    inherited_segments,
)
from dplit.privacy.ledger import CHECKPOINT_KEY, LEDGER_FILE
from dplit.privacy.warnings import PrivacyWarning
from dplit.release.card import model_card
from dplit.release.export import export_checkpoint
from dplit.release.guarantee import GUARANTEE_FILE, guarantee_of
from tests.helpers.commands import quickstart_args, steps
from tests.helpers.executable import refusal_line, run_dplit_in_process
from tests.helpers.fitting import fit, make_model
from tests.helpers.tiny import RandomTokenData

TRAIN_SIZE, BATCH = 64, 16  # RandomTokenData's defaults
Q = BATCH / TRAIN_SIZE


def epsilon_of(history: list[tuple[float, float, int]], size: int = TRAIN_SIZE) -> float:
    accountant = PrivacyAccountant(delta=default_delta(size))
    accountant.load_state_dict({**accountant.state_dict(), "history": history})
    return accountant.epsilon()


def guarantee_after(trainer: L.Trainer, tmp_path: Path) -> dict[str, Any]:
    """What ``dplit export`` would state for the trainer's weights now (the checkpoint it would read)."""
    path = tmp_path / "now.ckpt"
    trainer.save_checkpoint(path)
    return guarantee_of(torch.load(path, map_location="cpu", weights_only=True))


def non_private_fit(tmp_path: Path, model: Any, max_steps: int) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=max_steps, default_root_dir=tmp_path, precision="64-true", enable_progress_bar=False,
        limit_val_batches=0, enable_model_summary=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, RandomTokenData())
    return trainer


# --- §1: a second fit continues the weights' ε ------------------------------------------------------------------


def test_a_second_fit_on_the_same_module_continues_its_epsilon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model()
    fit(tmp_path / "a", model, max_steps=4, noise_multiplier=1.0, seed=None)
    with caplog.at_level("INFO"):
        trainer, strategy = fit(tmp_path / "b", model, max_steps=4, noise_multiplier=1.0, seed=None)
    said = [
        record.getMessage() for record in caplog.records if "continues their privacy history" in record.getMessage()
    ]
    assert len(said) == 1 and "already took 4 DP steps (earlier training" in said[0]
    expected = epsilon_of([(1.0, Q, 8)])
    assert strategy.accountant is not None and strategy.accountant.steps == 8
    assert strategy.accountant.epsilon() == pytest.approx(expected, rel=1e-9)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is True and guarantee["steps"] == 8 and guarantee["segments"] == 2
    assert guarantee["epsilon"] == pytest.approx(expected, rel=1e-9)
    ledger = json.loads(next((tmp_path / "b").rglob(LEDGER_FILE)).read_text())
    assert ledger["epsilon"] == pytest.approx(expected, rel=1e-9) and ledger["differentially_private"] is True


def test_non_private_steps_make_the_weights_not_private_for_good(tmp_path: Path) -> None:
    model = make_model()
    non_private_fit(tmp_path / "plain", model, max_steps=3)
    assert model.privacy_history.non_private_steps == 3
    with pytest.warns(PrivacyWarning, match="NOT differentially private, whatever this run does: 3 of the weights"):
        trainer, _ = fit(tmp_path / "dp", model, max_steps=1, noise_multiplier=1.0, seed=None)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and "without dplit.strategy.DPStrategy" in guarantee["reason"]
    assert guarantee["non_private_steps"] == 3 and guarantee["steps"] == 1
    assert model_card(guarantee, kind="classifier").startswith("# NOT differentially private classifier")
    ledger = json.loads(next((tmp_path / "dp").rglob(LEDGER_FILE)).read_text())
    assert ledger["differentially_private"] is False and "3 of the weights' steps" in ledger["reason_not_private"]


def test_a_non_private_fit_after_dp_training_is_on_the_card(tmp_path: Path) -> None:
    model = make_model()
    fit(tmp_path / "dp", model, max_steps=2, noise_multiplier=1.0, seed=None)
    trainer = non_private_fit(tmp_path / "plain", model, max_steps=2)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and guarantee["non_private_steps"] == 2
    kinds = [segment["kind"] for segment in guarantee["privacy_history"]["segments"]]
    assert kinds == ["dp", "non_private"]


def test_target_epsilon_bounds_the_weights_total(tmp_path: Path) -> None:
    model = make_model()
    fit(tmp_path / "a", model, max_steps=3, noise_multiplier=1.0, seed=None)
    spent = epsilon_of([(1.0, Q, 3)])
    _, strategy = fit(tmp_path / "b", model, max_steps=3, noise_multiplier=None, target_epsilon=2 * spent, seed=None)
    assert strategy.accountant is not None and strategy.accountant.steps == 6
    assert 2 * spent - 0.02 <= strategy.accountant.epsilon() <= 2 * spent


def test_a_target_the_history_already_spent_is_refused_before_any_step(tmp_path: Path) -> None:
    model = make_model()
    fit(tmp_path / "a", model, max_steps=3, noise_multiplier=1.0, seed=None)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(
        ValueError, match="target_epsilon=0.5 is already spent: these weights' privacy history counts 3"
    ):
        fit(tmp_path / "b", model, max_steps=3, noise_multiplier=None, target_epsilon=0.5, seed=None)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


# --- §2: a seeded segment is never forgotten --------------------------------------------------------------------


def test_a_seeded_segment_resumed_without_the_seed_stays_not_private(tmp_path: Path) -> None:
    trainer, _ = fit(tmp_path / "seeded", make_model(), max_steps=3, noise_multiplier=1.0, seed=0)
    first = tmp_path / "first.ckpt"
    trainer.save_checkpoint(first)
    with pytest.warns(PrivacyWarning, match="NOT differentially private, whatever this run does: 3 of the weights' DP"):
        resumed, strategy = fit(
            tmp_path / "resumed", make_model(), max_steps=6, noise_multiplier=1.0, seed=None, ckpt_path=str(first)
        )
    assert strategy.accountant is not None and strategy.accountant.steps == 6
    guarantee = guarantee_after(resumed, tmp_path)
    assert guarantee["differentially_private"] is False and "predictable noise" in guarantee["reason"]
    assert guarantee["noise"] == "explicit_seed (predictable) + os_entropy" or "+" in guarantee["noise"]
    secure = [segment["noise_secure"] for segment in guarantee["privacy_history"]["segments"]]
    assert secure == [False, True]


# --- the history through checkpoints, exports and older files ---------------------------------------------------


@pytest.mark.slow
def test_an_export_carries_the_history_into_a_model_built_from_it(tmp_path: Path) -> None:
    sigma = [
        "--trainer.strategy.init_args.target_epsilon",
        "null",
        "--trainer.strategy.init_args.noise_multiplier",
        "1",
    ]
    run_cli(["fit", *quickstart_args(tmp_path / "first", *steps(3), *sigma)])
    first = max((tmp_path / "first").rglob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    export_checkpoint(first, tmp_path / "export")
    assert inherited_segments(str(tmp_path / "export"))[0]["accountant"] == [[1.0, 0.1, 3]]
    built = ["--model.config", "null", "--model.pretrained", str(tmp_path / "export")]
    cli = run_cli(["fit", *quickstart_args(tmp_path / "second", *steps(2), *sigma, *built)])
    assert cli.model.privacy_history.dp_steps == 5
    second = max((tmp_path / "second").rglob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    export_checkpoint(second, tmp_path / "export2")
    guarantee = json.loads((tmp_path / "export2" / GUARANTEE_FILE).read_text())
    assert guarantee["steps"] == 5 and guarantee["segments"] == 2
    assert guarantee["epsilon"] == pytest.approx(epsilon_of([(1.0, 0.1, 5)], size=200), rel=1e-9)
    replace_one = epsilon_under("replace_one", [(1.0, 0.1, 5)], delta=guarantee["delta"])
    assert guarantee["epsilon_replace_one"] == pytest.approx(replace_one) and replace_one > guarantee["epsilon"]
    assert str(tmp_path) not in json.dumps(guarantee)  # the card names base names, never the user's folders
    spent = [
        *quickstart_args(tmp_path / "third", *steps(2), *built[:2]),
        "--model.pretrained",
        str(tmp_path / "export2"),
    ]
    spent += ["--trainer.strategy.init_args.target_epsilon", "0.2"]  # the export's 5 steps already spent more
    error = refusal_line(run_dplit_in_process("fit", *spent))
    assert "target_epsilon=0.2 is already spent: these weights' privacy history counts 5 DP steps" in error
    assert not list((tmp_path / "third").rglob("*.ckpt"))


def test_an_old_checkpoint_gets_the_history_its_ledger_implies() -> None:
    ledger = {
        "run_id": "abc", "accountant": {"delta": 1e-5, "mechanism": "prv", "history": [(1.0, 0.1, 4)]},
        "max_grad_norm": 0.1, "dataset_size": 200, "noise": "os_entropy", "noise_secure": True,
    }  # fmt: skip
    history = history_in_checkpoint({CHECKPOINT_KEY: ledger, "global_step": 4})
    assert history.accountant_history() == [(1.0, 0.1, 4)] and history.reason_not_private() is None
    unknown = history_in_checkpoint({"global_step": 7})
    assert unknown.non_private_steps == 7 and unknown.reason_not_private() is not None
    assert history_in_checkpoint({"global_step": 0}).segments == []
    saved = {HISTORY_KEY: history.state_dict(), CHECKPOINT_KEY: ledger}
    assert history_in_checkpoint(saved).segments == history.segments


def test_an_export_from_before_histories_is_inherited_from_its_guarantee(tmp_path: Path) -> None:
    old = {
        "differentially_private": True, "epsilon": 1.0, "delta": 1e-5, "accountant": "prv",
        "accountant_history": [[2.0, 0.01, 50]], "noise": "os_entropy", "max_grad_norm": 1.0, "dataset_size": 1000,
    }  # fmt: skip
    (tmp_path / GUARANTEE_FILE).write_text(json.dumps(old))
    assert PrivacyHistory(inherited_segments(str(tmp_path))).accountant_history() == [(2.0, 0.01, 50)]
    (tmp_path / GUARANTEE_FILE).write_text(json.dumps({**old, "differentially_private": False, "reason": "seeded"}))
    assert PrivacyHistory(inherited_segments(str(tmp_path))).reason_not_private() is not None
    assert inherited_segments("gpt2") == [] and inherited_segments(None) == []


def test_an_optimizer_step_no_dp_step_announced_is_non_private() -> None:
    history = PrivacyHistory()
    history.open_dp_segment(run_id="r", facts={"noise_secure": True})
    history.record_dp_step(noise_multiplier=1.0, sample_rate=0.1)
    history.optimizer_stepped()  # the DP step
    history.optimizer_stepped()  # a step nothing announced
    history.record_dp_step(noise_multiplier=1.0, sample_rate=0.1)
    history.optimizer_stepped()
    assert history.dp_steps == 2 and history.non_private_steps == 1
    assert [segment["kind"] for segment in history.segments] == ["dp", "non_private"]
    assert history.segments[1]["reason"] == NON_PRIVATE_STEP
    restored = PrivacyHistory()
    restored.load_state_dict(json.loads(json.dumps(history.state_dict())))
    assert restored.segments == history.segments
