"""DPStrategy end to end on a tiny float64 model: exact clipped updates, noise, accounting, resume, refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from opacus.accountants import PRVAccountant

from dplit.privacy.accounting import default_delta
from dplit.privacy.clipping import PerExampleEngine, build_engine
from dplit.strategy import DPStrategy
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers import brute_force
from tests.helpers.fitting import BatchRecorder, CrashAtStep, fit, make_model
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, PadCollate, RandomTokenData, RandomTokens

ENGINES = ["per_example", "ghost"]


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("head", ["label_words", "linear"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("micro", [1, 4, 10])
def test_reference_engine_equals_brute_force(policy: str, head: str, side: str, micro: int) -> None:
    model = make_model(policy, head)
    batch = PadCollate(side)([RandomTokens(10, seed=3)[i] for i in range(10)])
    grads = brute_force.per_example_gradients(model, model.per_example_loss, batch)
    expected = brute_force.clipped_sum(grads, 0.5)
    engine = PerExampleEngine(model, max_grad_norm=0.5)
    norms = [
        engine.accumulate(model.per_example_loss, {k: v[s : s + micro] for k, v in batch.items()}).norms
        for s in range(0, 10, micro)
    ]
    torch.testing.assert_close(torch.cat(norms), brute_force.gradient_norms(grads), rtol=1e-10, atol=1e-12)
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_each_example_contributes_at_most_c_even_with_huge_gradients(engine: str) -> None:
    model = make_model("tied")
    batch = PadCollate()([RandomTokens(6)[i] for i in range(6)])
    clipper = build_engine(engine, model, max_grad_norm=0.01)
    for i in range(6):
        model.zero_grad(set_to_none=True)
        example = {k: v[i : i + 1] for k, v in batch.items()}
        stats = clipper.accumulate(lambda b: 1e8 * model.per_example_loss(b), example)  # huge gradients
        assert stats.norms[0] > 1e3
        total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
        assert total <= 0.01 * (1 + 1e-9)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["tied", "untied"])
def test_dp_step_is_clipped_sum_over_expected_batch(tmp_path: Path, engine: str, policy: str) -> None:
    model = make_model(policy)
    initial = copy.deepcopy(model)
    recorder = BatchRecorder()
    _, strategy = fit(tmp_path, model, max_steps=1, callbacks=[recorder], clipping=engine)
    batch = recorder.batches[0]
    assert 0 < batch["labels"].shape[0] and strategy.dpsgd.expected_batch_size == 16
    grads = brute_force.per_example_gradients(initial, initial.per_example_loss, batch)
    expected = brute_force.clipped_sum(grads, 0.1)
    for (name, param), (_, before) in zip(model.named_parameters(), initial.named_parameters(), strict=True):
        torch.testing.assert_close(param.grad, expected[name] / 16, rtol=1e-10, atol=1e-13)
        assert not torch.equal(param, before)


def test_noise_std_is_sigma_c_over_expected_batch(tmp_path: Path) -> None:
    model = make_model()
    initial = copy.deepcopy(model)
    recorder = BatchRecorder()
    _, strategy = fit(tmp_path, model, max_steps=1, callbacks=[recorder], noise_multiplier=2.0, max_grad_norm=0.5)
    grads = brute_force.per_example_gradients(initial, initial.per_example_loss, recorder.batches[0])
    expected = brute_force.clipped_sum(grads, 0.5)
    noise = torch.cat([(p.grad - expected[n] / 16).flatten() for n, p in model.named_parameters()])
    assert noise.numel() > 5000
    assert noise.std().item() == pytest.approx(2.0 * 0.5 / 16, rel=0.05)
    assert abs(noise.mean().item()) < 4 * noise.std().item() / noise.numel() ** 0.5


def test_micro_batches_are_bounded_and_cover_the_logical_batch(tmp_path: Path) -> None:
    sizes: list[int] = []

    class Spy(GPT2Classifier):
        def per_example_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            sizes.append(batch["labels"].shape[0])
            return super().per_example_loss(batch)

    torch.manual_seed(0)
    model = Spy(config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS).double()
    recorder = BatchRecorder()
    data = RandomTokenData(size=64, batch_size=32)
    fit(tmp_path, model, max_steps=3, callbacks=[recorder], data=data, self_check=False)  # only the clipping calls
    assert max(sizes) <= 5
    assert sum(sizes) == sum(b["labels"].shape[0] for b in recorder.batches)


def test_epsilon_equals_opacus_and_counts_every_step(tmp_path: Path) -> None:
    trainer, strategy = fit(tmp_path, make_model(), max_steps=5, noise_multiplier=1.0)
    reference = PRVAccountant()
    reference.history = [(1.0, 16 / 64, 5)]
    assert strategy.accountant.steps == trainer.global_step == 5
    assert strategy.accountant.epsilon() == pytest.approx(reference.get_epsilon(default_delta(64)), rel=1e-9)
    assert trainer.callback_metrics["privacy/epsilon"].item() == pytest.approx(strategy.accountant.epsilon())
    ledger = json.loads((Path(trainer.log_dir) / "privacy_ledger.json").read_text())
    assert ledger["accountant"]["history"] == [[1.0, 0.25, 5]]


def test_resume_continues_the_ledger(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    fit(tmp_path, make_model(), max_steps=3, noise_multiplier=1.0, callbacks=[checkpoints])
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["dplit_privacy"]["accountant"]["history"] == [(1.0, 0.25, 3)]
    trainer, strategy = fit(
        tmp_path, make_model(), max_steps=6, noise_multiplier=1.0, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    reference = PRVAccountant()
    reference.history = [(1.0, 0.25, 6)]
    assert strategy.accountant.steps == 6
    assert strategy.accountant.epsilon() == pytest.approx(reference.get_epsilon(default_delta(64)), rel=1e-9)


def test_target_epsilon_is_never_exceeded_even_when_resumed_for_longer(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    _, first = fit(
        tmp_path, make_model(), max_steps=4, target_epsilon=2.0, noise_multiplier=None, callbacks=[checkpoints]
    )
    assert first.accountant.steps == 4 and 1.9 < first.accountant.epsilon() <= 2.0
    _, second = fit(
        tmp_path,
        make_model(),
        max_steps=8,
        target_epsilon=2.0,
        noise_multiplier=None,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert second.noise_multiplier == first.noise_multiplier
    assert second.accountant.steps == 4 and second.accountant.epsilon() <= 2.0


def test_empty_poisson_batches_still_take_noisy_steps(tmp_path: Path) -> None:
    recorder = BatchRecorder()
    trainer, strategy = fit(
        tmp_path,
        make_model(),
        max_steps=12,
        noise_multiplier=1.0,
        data=RandomTokenData(size=64, batch_size=1),
        callbacks=[recorder],
    )
    assert any(b["labels"].shape[0] == 0 for b in recorder.batches)
    assert strategy.accountant.steps == trainer.global_step == 12


@pytest.mark.parametrize(
    ("trainer_kwargs", "message"),
    [({"gradient_clip_val": 1.0}, "gradient_clip_val"), ({"accumulate_grad_batches": 2}, "accumulate_grad_batches")],
)
def test_trainer_settings_that_break_dp_are_refused(tmp_path: Path, trainer_kwargs: dict, message: str) -> None:
    strategy = DPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, accelerator="cpu")
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=1, default_root_dir=tmp_path, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(make_model(), RandomTokenData())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_grad_norm": 0.0, "noise_multiplier": 1.0}, "max_grad_norm must be a finite number > 0"),
        ({"max_grad_norm": 1.0}, "exactly one of"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "target_epsilon": 3.0}, "exactly one of"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "target_delta": 2.0}, "target_delta"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "clipping": "magic"}, "clipping"),
    ],
)
def test_bad_privacy_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPStrategy(**kwargs)


def test_without_dp_the_same_module_trains_non_privately(tmp_path: Path) -> None:
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    trainer = L.Trainer(
        max_steps=2, default_root_dir=tmp_path, precision="64-true", enable_progress_bar=False, limit_val_batches=0
    )
    trainer.fit(model, RandomTokenData())
    assert "train/loss" in trainer.callback_metrics
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()], ids=["crash", "interrupt"])
def test_crash_or_interrupt_keeps_the_last_checkpoint_and_ledger(tmp_path: Path, error: BaseException) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    with pytest.raises((RuntimeError, SystemExit, KeyboardInterrupt)):
        fit(tmp_path, make_model(), max_steps=6, noise_multiplier=1.0, callbacks=[checkpoints, CrashAtStep(3, error)])
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    assert [tuple(entry) for entry in saved["dplit_privacy"]["accountant"]["history"]] == [(1.0, 0.25, 3)]
    ledgers = list(tmp_path.rglob("privacy_ledger.json"))
    assert len(ledgers) == 1 and json.loads(ledgers[0].read_text())["accountant"]["history"] == [[1.0, 0.25, 3]]
    resumed = str(tmp_path / "ckpt" / "last.ckpt")
    _, strategy = fit(tmp_path, make_model(), max_steps=5, noise_multiplier=1.0, ckpt_path=resumed)
    assert strategy.accountant.steps == 5


def test_uncovered_trainable_parameter_is_refused_at_setup_by_name(tmp_path: Path) -> None:
    class WithTemperature(GPT2Classifier):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.temperature = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

        def per_example_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return super().per_example_loss(batch) * self.temperature

    torch.manual_seed(0)
    model = WithTemperature(config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS).double()
    steps: list[int] = []

    class StepSpy(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            steps.append(trainer.global_step)

    with pytest.raises(ValueError, match="'temperature'"):
        fit(tmp_path, model, max_steps=1, clipping="ghost", callbacks=[StepSpy()])
    assert steps == []


def test_private_diagnostics_off_logs_only_the_public_privacy_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dplit.cli.lightning_cli import run_cli
    from tests.helpers.commands import quickstart_args, steps

    quiet = ["--trainer.strategy.init_args.private_diagnostics", "false"]
    with caplog.at_level("INFO"):
        cli = run_cli(["fit", *quickstart_args(tmp_path / "quiet", *steps(2), *quiet)])
    training = {key for key in cli.trainer.logged_metrics if not key.startswith("val/")}
    public = {"dp/clip_bound"}  # the bound the mechanism claims (quantile: moved by noisy counts only)
    assert training and all(key.startswith("privacy/") or key in public for key in training), training
    lines = [record.getMessage() for record in caplog.records if "examples from synthetic[train" in record.getMessage()]
    assert lines and all("longest prompt" not in line for line in lines)
    loud = run_cli(["fit", *quickstart_args(tmp_path / "loud", *steps(2))])
    assert {"dp/grad_norm", "dp/clip_fraction", "perf/samples_per_sec", "memory/peak_mb"} <= set(
        loud.trainer.logged_metrics
    )


def test_the_dp_strategies_take_exactly_the_dp_settings_with_their_defaults_and_types() -> None:
    """One source for the knobs: DPSGDHooks' keyword arguments are DPSGDSettings' fields (flag_owner aside)."""
    import dataclasses
    import inspect

    from dplit.privacy.settings import DPSGDSettings
    from dplit.strategy.hooks import DPSGDHooks

    fields = {field.name: field for field in dataclasses.fields(DPSGDSettings) if field.name != "flag_owner"}
    parameters = {
        name: parameter for name, parameter in inspect.signature(DPSGDHooks.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }  # fmt: skip
    assert list(parameters) == list(fields)  # the same knobs, in the same order
    for name, field in fields.items():
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert parameters[name].default == default, name
        # a number is typed dplit.flag_types.Number on the strategy: float as the command line reads it (inf, nan)
        assert str(parameters[name].annotation).replace("Number", "float") == str(field.type), name


def test_the_knobs_table_in_the_docs_is_the_one_the_settings_generate() -> None:
    from dplit.privacy.settings import knobs_table
    from tests.helpers.paths import REPOSITORY

    page = (REPOSITORY / "docs" / "reference" / "dp-knobs.md").read_text()
    assert knobs_table() in page, "regenerate it: python -m dplit.privacy.settings"
