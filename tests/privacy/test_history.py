"""The privacy history belongs to the weights: no refit, resume, seed or non-private step can shorten it (issue 31)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from dplit.cli.lightning_cli import run_cli
from dplit.privacy.accounting import PrivacyAccountant, default_delta
from dplit.privacy.accounting.relations import epsilon_under
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.history import (
    HISTORY_KEY,
    NON_PRIVATE_STEP,
    PrivacyHistory,
    history_in_checkpoint,
    inherited_history,
)
from dplit.privacy.ledger import CHECKPOINT_KEY, LEDGER_FILE
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.warnings import PrivacyWarning
from dplit.release.card import model_card
from dplit.release.export import export_checkpoint
from dplit.release.guarantee import GUARANTEE_FILE, guarantee_of
from dplit.strategy import DPStrategy
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
    assert guarantee["differentially_private"] is False and "outside dplit's DP-SGD step" in guarantee["reason"]
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
    segments, origin = inherited_history(str(tmp_path / "export"))
    assert segments[0]["accountant"] == [[1.0, 0.1, 3]] and origin is not None and "seal intact" in origin
    elsewhere = tmp_path / "deployed"  # loaded and saved by plain transformers into a new folder
    AutoModelForCausalLM.from_pretrained(tmp_path / "export").save_pretrained(elsewhere)
    segments, origin = inherited_history(str(elsewhere))
    assert PrivacyHistory(segments).reason_not_private() is not None and "unknown history" in str(origin)
    edited = _trained_further_by_plain_transformers(tmp_path / "export", tmp_path / "edited")
    from_edited = ["--model.config", "null", "--model.pretrained", str(edited)]
    cli = run_cli(["fit", *quickstart_args(tmp_path / "from-edited", *steps(1), *sigma, *from_edited)])
    reason = cli.model.privacy_history.reason_not_private()
    assert reason is not None and "model.safetensors is not the file exported with dp_guarantee.json" in reason
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


def _trained_further_by_plain_transformers(export: Path, folder: Path) -> Path:
    """A copy of ``export`` whose weights took 3 AdamW steps through plain transformers, saved back in place."""
    shutil.copytree(export, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (4, 8))
    for _ in range(3):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    return folder


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


def test_an_export_from_before_exports_were_sealed_is_weights_of_unknown_history(tmp_path: Path) -> None:
    old = {
        "differentially_private": True, "epsilon": 1.0, "delta": 1e-5, "accountant": "prv",
        "accountant_history": [[2.0, 0.01, 50]], "noise": "os_entropy", "max_grad_norm": 1.0, "dataset_size": 1000,
    }  # fmt: skip
    (tmp_path / GUARANTEE_FILE).write_text(json.dumps(old))
    segments, origin = inherited_history(str(tmp_path))
    history = PrivacyHistory(segments)
    assert history.accountant_history() == [] and origin is not None and "unknown history" in origin
    reason = history.reason_not_private()
    assert reason is not None and "no seal binding it to the weight files" in reason
    assert inherited_history("gpt2") == ([], None) and inherited_history(None) == ([], None)


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


# --- issue 49: the history is bound to the weights' content ---------------------------------------------------------


def _train_without_dplit(model: Any, *, steps: int = 3) -> None:
    """A plain PyTorch loop on the private rows: AdamW on the summed per-example loss."""
    batch = next(iter(RandomTokenData().train_dataloader()))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model.per_example_loss(batch).sum().backward()
        optimizer.step()


def _edit_through_data(model: Any) -> None:
    """An in-place edit through ``.data``: no version counter sees it."""
    next(p for p in model.parameters() if p.requires_grad).data.add_(1e-3)


CHANGES = {
    "plain loop": (_train_without_dplit, NON_PRIVATE_STEP, "NOT differentially private, whatever this run does: 3 of"),
    "data edit": (
        _edit_through_data, "changed outside any step dplit recorded (found before a DP-SGD fit)",
        "NOT differentially private: they changed outside any step dplit recorded",
    ),
}  # fmt: skip
"""A plain loop's optimizer steps are seen as they happen; an edit that is no step is found by the digest."""


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_made_outside_dplit_makes_the_next_dp_fit_not_private(tmp_path: Path, change: str) -> None:
    make_change, reason, said = CHANGES[change]
    model = make_model()
    make_change(model)
    with pytest.warns(PrivacyWarning, match=said):
        trainer, _ = fit(tmp_path, model, max_steps=1, noise_multiplier=1.0, seed=None)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and reason in guarantee["reason"]
    assert model.privacy_history.dp_steps == 1  # the DP step still counts


def test_weights_changed_after_a_dp_fit_are_caught_when_the_checkpoint_is_saved(tmp_path: Path) -> None:
    model = make_model()
    trainer, _ = fit(tmp_path, model, max_steps=2, noise_multiplier=1.0, seed=None)
    assert guarantee_after(trainer, tmp_path / "0")["differentially_private"] is True
    _edit_through_data(model)
    with pytest.warns(PrivacyWarning, match="found when a checkpoint was saved"):
        guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and guarantee["steps"] == 2


def test_load_state_dict_brings_weights_the_history_cannot_explain(tmp_path: Path) -> None:
    trained = make_model()
    non_private_fit(tmp_path / "plain", trained, max_steps=2)  # its own history says non-private
    model = make_model()
    model.load_state_dict(trained.state_dict())
    trainer, _ = fit(tmp_path / "dp", model, max_steps=1, noise_multiplier=1.0, seed=None)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and "found before a DP-SGD fit" in guarantee["reason"]


def test_a_dp_checkpoint_keeps_its_history_through_load_from_checkpoint_but_not_through_its_state_dict(
    tmp_path: Path,
) -> None:
    trainer, _ = fit(tmp_path / "first", make_model(), max_steps=2, noise_multiplier=1.0, seed=None)
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)
    restored = type(make_model()).load_from_checkpoint(path, map_location="cpu")
    trainer, _ = fit(tmp_path / "second", restored, max_steps=1, noise_multiplier=1.0, seed=None)
    guarantee = guarantee_after(trainer, tmp_path / "a")
    assert guarantee["differentially_private"] is True and guarantee["steps"] == 3
    idiom = make_model()
    idiom.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
    trainer, _ = fit(tmp_path / "third", idiom, max_steps=1, noise_multiplier=1.0, seed=None)
    guarantee = guarantee_after(trainer, tmp_path / "b")
    assert guarantee["differentially_private"] is False and guarantee["steps"] == 1


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"], ids=["before the first step", "mid-fit"])
def test_weights_loaded_while_a_dp_fit_runs_are_not_private(tmp_path: Path, hook: str) -> None:
    other = make_model()
    _train_without_dplit(other)

    class LoadInFit(L.Callback):
        pass

    setattr(LoadInFit, hook, lambda self, trainer, module, *args: module.load_state_dict(other.state_dict()))
    trainer, _ = fit(tmp_path, make_model(), max_steps=2, noise_multiplier=1.0, seed=None, callbacks=[LoadInFit()])
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and "while a DP-SGD fit was running" in guarantee["reason"]


def test_an_optimizer_of_a_callback_stepping_on_the_weights_inside_a_dp_fit_is_not_private(tmp_path: Path) -> None:
    class OwnOptimizer(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, *args: Any) -> None:
            optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
            module.zero_grad()
            module.per_example_loss(batch).sum().backward()
            optimizer.step()  # no clipping, no noise

    trainer, _ = fit(tmp_path, make_model(), max_steps=2, noise_multiplier=1.0, seed=None, callbacks=[OwnOptimizer()])
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and NON_PRIVATE_STEP in guarantee["reason"]


def test_a_dp_segment_left_open_explains_nothing_that_comes_after_it(tmp_path: Path) -> None:
    """DPSGD without ``finish()`` (the segment stays open), a plain loop, then a DP fit: the loop is found."""
    model = make_model()
    settings = DPSGDSettings(max_grad_norm=0.1, noise_multiplier=1.0, self_check=False)
    dpsgd = DPSGD(model, settings, history=model.privacy_history, weights_state=model.weights_state)
    loader = dpsgd.sample(RandomTokenData().train_dataloader())
    dpsgd.start(planned_steps=1)
    dpsgd.clip(model.per_example_loss, next(iter(loader)))
    dpsgd.release()
    plain_edit = next(p for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        plain_edit.add_(1.0)  # not an optimizer step: only the digest can see it
    trainer, _ = fit(tmp_path, model, max_steps=1, noise_multiplier=1.0, seed=None)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is False and "found before a DP-SGD fit" in guarantee["reason"]


def test_an_ema_of_the_dp_iterates_in_the_checkpoint_resumes_and_exports_as_dp(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    fit(tmp_path / "a", make_model(), max_steps=2, noise_multiplier=1.0, seed=None, callbacks=[EMAWeightAveraging()])
    first = _last_checkpoint(tmp_path / "a")
    assert guarantee_of(torch.load(first, map_location="cpu", weights_only=False))["differentially_private"] is True
    trainer, _ = fit(
        tmp_path / "b", make_model(), max_steps=3, noise_multiplier=1.0, seed=None, ckpt_path=first,
        callbacks=[EMAWeightAveraging()],
    )  # fmt: skip
    guarantee = guarantee_after(trainer, tmp_path / "b")
    assert guarantee["differentially_private"] is True and guarantee["steps"] == 3


def test_a_change_stated_public_is_recorded_verbatim_and_keeps_the_weights_private(tmp_path: Path) -> None:
    model = make_model()
    _train_without_dplit(model)
    statement = "3 AdamW steps on public | text (no private data)"
    trainer, _ = fit(tmp_path, model, max_steps=1, noise_multiplier=1.0, seed=None, public_change=statement)
    guarantee = guarantee_after(trainer, tmp_path)
    assert guarantee["differentially_private"] is True
    kinds = [segment["kind"] for segment in guarantee["privacy_history"]["segments"]]
    assert kinds == ["public_change", "dp"]
    assert guarantee["privacy_history"]["segments"][0]["statement"] == statement
    assert guarantee["privacy_history"]["segments"][0]["steps"] == 3  # the plain loop's optimizer steps
    model, edited = make_model(), tmp_path / "edited"
    _edit_through_data(model)  # no optimizer step: the digest finds it, the statement covers it
    trainer, _ = fit(edited, model, max_steps=1, noise_multiplier=1.0, seed=None, public_change=statement)
    guarantee = guarantee_after(trainer, edited)
    assert guarantee["differentially_private"] is True and guarantee["public_changes"] == 1
    assert statement.replace("|", "\\|") in model_card(guarantee, kind="classifier")  # verbatim, table-escaped


def test_the_origin_names_the_public_starting_point_and_its_digest() -> None:
    model = make_model()
    origin = model.privacy_history.origin
    assert origin is not None and origin["description"] == "random initialisation from model.config"
    assert origin["digest"] == model.digest_of_weights()  # .double() after construction: the same values
    assert model.privacy_history.digest == origin["digest"]


def test_lightnings_tuner_is_refused_in_one_line(tmp_path: Path) -> None:
    from lightning.pytorch.tuner import Tuner

    strategy = DPStrategy(accelerator="cpu", max_grad_norm=0.1, noise_multiplier=1.0)
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=3, default_root_dir=tmp_path, logger=False)
    with pytest.raises(ValueError, match=r"^Lightning's tuner \(LearningRateFinder"):
        Tuner(trainer).lr_find(make_model(), datamodule=RandomTokenData(), num_training=2)
    assert not list(tmp_path.rglob("*.ckpt"))


def _last_checkpoint(folder: Path) -> str:
    return str(max(folder.rglob("*.ckpt"), key=lambda path: path.stat().st_mtime))


def test_each_segment_records_its_mechanism_and_a_resume_that_changes_it_says_so(tmp_path: Path) -> None:
    quantile = {"clip_mode": "quantile", "noise_multiplier": 1.0, "seed": None, "max_grad_norm": 1.0}
    fit(tmp_path / "a", make_model(), max_steps=2, **quantile)
    first = _last_checkpoint(tmp_path / "a")
    trainer, _ = fit(tmp_path / "b", make_model(), max_steps=4, ckpt_path=first, **quantile)  # quantile again
    segments = guarantee_after(trainer, tmp_path / "b")["privacy_history"]["segments"]
    assert [segment["clip_mode"] for segment in segments] == ["quantile", "quantile"]
    assert segments[0]["clip_bound_start"] == 1.0 and segments[0]["clip_bound_end"] != 1.0  # C_t moved
    assert segments[1]["clip_bound_start"] == segments[0]["clip_bound_end"]  # restored, not reset
    learned = segments[1]["clip_bound_end"]
    fixed = {**quantile, "clip_mode": "fixed"}
    second = _last_checkpoint(tmp_path / "b")
    with pytest.warns(
        PrivacyWarning, match=r"this resume changes the mechanism .*clip_mode 'quantile' → 'fixed'"
    ) as seen:
        trainer, _ = fit(tmp_path / "c", make_model(), max_steps=5, ckpt_path=second, **fixed)
    line = next(str(w.message) for w in seen if "changes the mechanism" in str(w.message))
    assert f"the learned quantile bound C_t = {learned:.6g} is not used" in line
    segments = guarantee_after(trainer, tmp_path / "c")["privacy_history"]["segments"]
    assert [segment["clip_mode"] for segment in segments] == ["quantile", "quantile", "fixed"]
    assert "clip_bound_start" not in segments[2] and segments[2]["max_grad_norm"] == 1.0


def test_a_segment_closed_without_a_digest_explains_no_change_after_it() -> None:
    """An interrupted multi-process fit closes its segment unsealed: what changes later must match the last seal."""
    history = PrivacyHistory()
    history.record_origin("random initialisation from model.config", "a" * 64)
    history.open_dp_segment(run_id="r", facts={"noise_secure": True})
    history.record_dp_step(noise_multiplier=1.0, sample_rate=0.1)
    history.optimizer_stepped()
    history.close_dp_segment(None)  # no collective after an interrupt of several (sharded) processes
    line = history.verify("b" * 64, where="found before a DP-SGD fit")
    assert line is not None and history.reason_not_private() is not None
