"""The guarantee against an adversary (issue 12): unpredictable noise, no training-only leaks, sound float arithmetic.

Each test reproduces a way the guarantee failed silently before, and shows it refused or fixed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from dplit.privacy.clipping import GhostEngine, PerExampleEngine
from dplit.privacy.clipping.engine import Batch
from dplit.privacy.clipping.norms import NORM_RULES
from dplit.privacy.clipping.norms.elementwise_affine import _BATCHED_REPLAY, elementwise_affine_gradients
from dplit.privacy.clipping.norms.registry import register_norm_rule
from dplit.privacy.clipping.self_check import check_ghost_norms
from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.noise import NoiseSource
from dplit.privacy.training_state import StateWriteGuard
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients
from tests.helpers.families import VOCAB, tiny_task
from tests.helpers.fitting import fit, make_model
from tests.helpers.oracles import padded_batch

# --- 1. noise that cannot be regenerated from the config -----------------------------------------------------------


def _one_noisy_step(tmp_path: Path, **strategy_kwargs: object) -> Tensor:
    """The parameters after one σ = 1 step of a run started with seed_everything(0)."""
    L.seed_everything(0)
    model = make_model()
    fit(tmp_path, model, max_steps=1, noise_multiplier=1.0, **strategy_kwargs)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_noise_and_sampling_are_not_determined_by_seed_everything(tmp_path: Path) -> None:
    first = _one_noisy_step(tmp_path / "a", seed=None)
    second = _one_noisy_step(tmp_path / "b", seed=None)
    assert not torch.equal(first, second)  # same config, same seed_everything: different noise
    ledger = json.loads(next((tmp_path / "a").rglob("privacy_ledger.json")).read_text())
    assert ledger["noise_secure"] is True and ledger["noise"] == "os_entropy"
    assert "seed" not in ledger


def test_an_explicit_seed_is_reproducible_warns_and_is_recorded_as_predictable(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="do not release"):
        first = _one_noisy_step(tmp_path / "a", seed=7)
    with pytest.warns(UserWarning, match="do not release"):
        second = _one_noisy_step(tmp_path / "b", seed=7)
    assert torch.equal(first, second)
    ledger = json.loads(next((tmp_path / "a").rglob("privacy_ledger.json")).read_text())
    assert ledger["noise_secure"] is False and "predictable" in ledger["noise"]


def test_entropy_seeds_are_fresh_for_every_draw_and_stream() -> None:
    source = NoiseSource()
    seeds = {source.seed("noise", steps=3) for _ in range(20)} | {source.seed("sampling", steps=3)}
    assert len(seeds) == 21 and source.secure
    explicit = NoiseSource.__new__(NoiseSource)  # no warning needed for this arithmetic check
    explicit._seed = 1
    assert explicit.seed("noise", steps=3) == explicit.seed("noise", steps=3) != explicit.seed("noise", steps=4)


def test_a_checkpoint_holds_no_seed(tmp_path: Path) -> None:
    L.seed_everything(0)
    model = make_model()
    trainer, _ = fit(tmp_path, model, max_steps=2, noise_multiplier=1.0, seed=None)
    path = tmp_path / "ckpt.ckpt"
    trainer.save_checkpoint(path)
    privacy = torch.load(path, weights_only=False)["dplit_privacy"]
    assert "seed" not in json.dumps(privacy) and privacy["noise_secure"] is True


# --- 2. state that private data changes in training ----------------------------------------------------------------


class WithModule(nn.Module):
    """A tiny model: ``extra`` between an embedding and a linear read-out."""

    def __init__(self, extra: nn.Module, embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        self.embedding = embedding or nn.Embedding(10, 4)
        self.extra = extra
        self.out = nn.Linear(4, 1)

    def per_example_loss(self, batch: Batch) -> Tensor:
        hidden = self.extra(self.embedding(batch["ids"]))  # [B, T, 4]
        return self.out(hidden).pow(2).sum((1, 2))


class ChannelLast(nn.Module):
    """BatchNorm1d over the last dim of [B, T, d]."""

    def __init__(self, affine: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4, affine=affine)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (lambda: WithModule(nn.Identity(), nn.Embedding(10, 4, max_norm=1.0)), "embedding"),
        (lambda: WithModule(ChannelLast(affine=False)), "extra.norm"),
        (lambda: WithModule(ChannelLast(affine=True)), "extra.norm"),
        (lambda: WithModule(nn.InstanceNorm1d(4, track_running_stats=True)), "extra"),
    ],
)
def test_modules_that_write_state_or_mix_examples_are_refused_at_setup_by_name(tmp_path: Path, model, name) -> None:
    from dplit.privacy.training_state import refuse_state_writing_modules

    with pytest.raises(ValueError, match=rf"module '{name}' .* cannot be trained with DP-SGD"):
        refuse_state_writing_modules(model())


def test_the_strategy_refuses_a_max_norm_embedding_before_training(tmp_path: Path) -> None:
    model = make_model()
    embedding = model.backbone.get_input_embeddings()
    embedding.max_norm = 1.0
    before = embedding.weight.detach().clone()
    with pytest.raises(ValueError, match=r"max_norm renormalises"):
        fit(tmp_path, model, max_steps=1)
    assert torch.equal(embedding.weight, before)  # refused before any forward touched it


class InPlaceCounter(nn.Module):
    """Writes a buffer in place in every forward (a running statistic of the training data)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        self.seen.add_(x.detach().mean((0, 1)))
        return x


def test_any_in_place_write_during_a_training_forward_is_caught_by_name() -> None:
    model = WithModule(InPlaceCounter())
    guard = StateWriteGuard(model)
    engine = GhostEngine(model, max_grad_norm=1.0)
    guard.arm()
    engine.accumulate(model.per_example_loss, {"ids": torch.randint(0, 10, (3, 5))})
    with pytest.raises(ValueError, match=r"'extra.seen' was written in place during a training forward"):
        guard.check()


class TrainOnlyMixing(nn.Module):
    """Subtracts the batch mean in train mode only (as batch statistics do): examples leak into each other."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0, keepdim=True) if self.training else x


def test_the_self_check_runs_in_train_mode_and_sees_examples_mixing() -> None:
    torch.manual_seed(0)
    model = WithModule(TrainOnlyMixing()).double().train()
    batch = {"ids": torch.randint(0, 10, (4, 5))}
    engine = GhostEngine(model, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"self-check failed for trainable parameter"):
        check_ghost_norms(engine, model, model.per_example_loss, batch)
    check_ghost_norms(engine, model.eval(), model.per_example_loss, batch)  # eval mode never saw it
    assert not model.training


def test_the_self_check_disables_dropout_without_changing_the_mode() -> None:
    torch.manual_seed(0)
    model = WithModule(nn.Dropout(0.5)).double().train()
    engine = GhostEngine(model, max_grad_norm=1.0)
    check_ghost_norms(engine, model, model.per_example_loss, {"ids": torch.randint(0, 10, (4, 5))})
    assert model.training and model.extra.training


# --- 3. one-time checks that a first batch could fool ----------------------------------------------------------------


class BatchMeanScale(nn.Module):
    """A norm-like module whose forward divides by a statistic over the WHOLE batch (mixes examples)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x / x.pow(2).mean().add(1).sqrt() * self.weight


@pytest.fixture
def batch_mean_rule():
    register_norm_rule(BatchMeanScale, ("weight",))(elementwise_affine_gradients)
    yield
    NORM_RULES.pop(BatchMeanScale, None)
    _BATCHED_REPLAY.pop(BatchMeanScale, None)


def test_a_single_example_call_does_not_mark_a_class_safe(batch_mean_rule) -> None:
    torch.manual_seed(0)
    module = BatchMeanScale().double()
    one = torch.randn(1, 5, 4, dtype=torch.double)
    elementwise_affine_gradients(module, one, torch.randn_like(one))
    assert BatchMeanScale not in _BATCHED_REPLAY  # nothing learned from one example
    same = one.expand(3, 5, 4).contiguous()
    elementwise_affine_gradients(module, same, torch.randn_like(same))
    assert BatchMeanScale not in _BATCHED_REPLAY  # identical examples cannot tell either
    several = torch.randn(3, 5, 4, dtype=torch.double)
    grads = torch.randn_like(several)
    result = elementwise_affine_gradients(module, several, grads)["weight"].values
    assert _BATCHED_REPLAY[BatchMeanScale] is False
    for i in range(3):  # each example's gradient is its own replay's (the vmap one), not the mixed batch's
        x = several[i : i + 1]
        weight = module.weight.detach().clone().requires_grad_()
        out = x / x.pow(2).mean().add(1).sqrt() * weight
        (expected,) = torch.autograd.grad(out, weight, grads[i : i + 1])
        torch.testing.assert_close(result[i], expected)


# --- 4. float arithmetic that broke the bound ------------------------------------------------------------------------


class ReadOut(nn.Module):
    """One bias-free Linear whose output gradient is the same vector v at every position."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)
        self.register_buffer("direction", torch.ones(width) / width**0.5)

    def per_example_loss(self, batch: Batch) -> Tensor:
        return (self.proj(batch["x"]) * self.direction).sum((1, 2))


def cancelling_examples(count: int, positions: int = 32, width: int = 64, tiny: float = 1e-4) -> Tensor:
    """The auditor's crafted inputs: rows alternating ±u plus a tiny remainder, so Σ_t a_t nearly cancels."""
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(count, 1, width, generator=generator)
    signs = torch.tensor([(-1.0) ** t for t in range(positions)]).reshape(1, positions, 1)
    return (u * signs + tiny * torch.randn(count, positions, width, generator=generator)).float()  # [B, T, d]


@pytest.mark.parametrize("engine_class", [GhostEngine, PerExampleEngine])
@pytest.mark.parametrize("positions", [16, 32], ids=["grams", "materialised"])  # ghost: T·(r + c) < r·c or not
def test_crafted_cancelling_examples_contribute_at_most_c(engine_class, positions: int) -> None:
    torch.manual_seed(0)
    model, clip = ReadOut(64), 1.0  # below every example's true norm (≈ 40): each one is clipped
    engine = engine_class(model, max_grad_norm=clip)
    inputs = cancelling_examples(16, positions) * 1e4  # norms ≫ the clip factor's 1e-6, which would hide ≈ 1e-6/40
    for i in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        stats = engine.accumulate(model.per_example_loss, {"x": inputs[i : i + 1]})
        assert bool(torch.isfinite(stats.norms).all())
        contribution = model.proj.weight.grad.double().norm()
        assert contribution <= clip  # no tolerance: the rounding slack is what keeps it


@pytest.fixture
def reduced_matmul_precision() -> Iterator[tuple[str, str]]:
    """``torch.set_float32_matmul_precision("medium")`` (TF32 factors on cuBLAS, bf16 on oneDNN) during the test."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        yield matmul_precisions()
    finally:
        torch.set_float32_matmul_precision(saved)


def matmul_precisions() -> tuple[str, str]:
    """The float32 matmul precision of cuBLAS and of oneDNN, as set now."""
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision


@pytest.mark.parametrize("engine_class", [GhostEngine, PerExampleEngine])
def test_clipped_sums_use_ieee_float32_matmuls_whatever_the_users_precision(engine_class, reduced_matmul_precision):
    """TF32 or bf16 factors would round each contribution by ~2⁻¹¹ or 2⁻⁸ of b: far above the rounding slack."""
    model = ReadOut(16)
    engine = engine_class(model, max_grad_norm=1.0)
    during: list[tuple[str, str]] = []
    engine.register_summed_hook(lambda param: during.append(matmul_precisions()))
    engine.accumulate(model.per_example_loss, {"x": torch.randn(3, 4, 16)})
    assert reduced_matmul_precision == ("tf32", "bf16")
    assert during == [("ieee", "ieee")]  # while the norms and the clipped sum were formed
    assert matmul_precisions() == reduced_matmul_precision  # the user's setting is back


def test_norms_formed_in_the_backward_pass_use_ieee_float32_matmuls_too(reduced_matmul_precision) -> None:
    """Recomputed (checkpointed) calls are normed as they complete, inside autograd's backward pass."""
    model = tiny_task("classifier", "llama", "untied", gradient_checkpointing=True)
    assert any(getattr(m, "is_activation_checkpointing", False) for m in model.modules())
    linear = NORM_RULES[nn.Linear]
    during: list[tuple[str, str]] = []

    def recording(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict:
        during.append(matmul_precisions())
        return linear.gradients(module, activation, output_grad)

    engine = GhostEngine(model, max_grad_norm=1.0, rules={**NORM_RULES, nn.Linear: replace(linear, gradients=recording)})
    engine.accumulate(model.per_example_loss, padded_batch([5, 9, 2, 7], "right", vocab=VOCAB))
    assert during and set(during) == {("ieee", "ieee")}
    assert matmul_precisions() == reduced_matmul_precision


def test_float32_norms_of_normal_examples_are_still_tight() -> None:
    torch.manual_seed(0)
    model = ReadOut(64)
    x = torch.randn(6, 32, 64)
    norms = GhostEngine(model, max_grad_norm=1.0).accumulate(model.per_example_loss, {"x": x}).norms
    truth = gradient_norms(per_example_gradients(model.double(), model.per_example_loss, {"x": x.double()}))
    assert bool((norms >= truth * (1 - 1e-7)).all()) and bool((norms <= truth * (1 + 1e-4)).all())


class PoisonedExample(nn.Module):
    """A Linear model whose loss is NaN for examples whose first feature is negative."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def per_example_loss(self, batch: Batch) -> Tensor:
        x = batch["x"]  # [B, T, 4]
        bad = (x[:, 0, 0] < 0).reshape(-1, 1, 1)  # [B, 1, 1]
        scale = torch.where(bad, torch.tensor(float("nan"), dtype=x.dtype), torch.tensor(1.0, dtype=x.dtype))
        return (self.proj(x) * scale).pow(2).sum((1, 2))  # NaN only for the bad examples


@pytest.mark.parametrize("engine_class", [GhostEngine, PerExampleEngine])
def test_an_example_with_a_non_finite_gradient_is_dropped_not_spread(engine_class) -> None:
    torch.manual_seed(0)
    model = PoisonedExample().double()
    x = torch.randn(6, 3, 4, dtype=torch.double).abs()
    x[2, 0, 0] = -1.0
    stats = engine_class(model, max_grad_norm=0.5).accumulate(model.per_example_loss, {"x": x})
    assert int((~torch.isfinite(stats.norms)).sum()) == 1 and not bool(torch.isfinite(stats.norms[2]))
    keep = [i for i in range(6) if i != 2]
    expected = clipped_sum(per_example_gradients(model, model.per_example_loss, {"x": x[keep]}), 0.5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)


def test_a_non_finite_noisy_sum_stops_the_run_before_the_optimizer_steps(tmp_path: Path, monkeypatch) -> None:
    def overflowing_noise(self: GradientBuffer, std: float, generator: torch.Generator) -> None:
        self.flat[0] = float("inf")  # what an overflowing 16-bit sum or noise draw produces

    monkeypatch.setattr(GradientBuffer, "add_noise", overflowing_noise)
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match=r"step 1: the noisy gradient sum is not finite"):
        fit(tmp_path, model, max_steps=1, noise_multiplier=1.0)
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before, strict=True))
    assert not list(tmp_path.rglob("privacy_ledger.json"))  # nothing was released, nothing charged


def test_an_example_whose_norm_is_not_finite_is_counted_as_dropped(tmp_path: Path) -> None:
    model = make_model()
    with torch.no_grad():
        model.backbone.get_input_embeddings().weight[5].fill_(float("inf"))  # token 5's examples go non-finite
    trainer, _ = fit(tmp_path, model, max_steps=1, self_check=False)
    assert trainer.callback_metrics["dp/dropped_examples"] > 0
    assert all(bool(torch.isfinite(p).all()) for n, p in model.named_parameters() if "wte" not in n)


# --- 5. error messages computed from private data --------------------------------------------------------------------


def test_the_self_check_refusal_prints_no_norm_of_a_private_example() -> None:
    torch.manual_seed(0)
    model = WithModule(TrainOnlyMixing()).double().train()
    batch = {"ids": torch.randint(0, 10, (4, 5))}
    engine = GhostEngine(model, max_grad_norm=1.0)
    norms = gradient_norms(per_example_gradients(model.eval(), model.per_example_loss, batch))
    model.train()
    with pytest.raises(ValueError) as refusal:
        check_ghost_norms(engine, model, model.per_example_loss, batch)
    message = str(refusal.value)
    for value in norms.tolist():
        assert f"{value:.4g}" not in message and f"{value:.3g}" not in message
    assert "[" not in message


def test_the_self_check_runs_under_the_trainers_bf16_autocast(tmp_path: Path) -> None:
    from dplit.strategy import DPStrategy
    from dplit.tasks.classifier import GPT2Classifier
    from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, RandomTokenData

    autocast_seen: list[bool] = []

    class Recording(GPT2Classifier):
        def per_example_loss(self, batch: Batch) -> Tensor:
            autocast_seen.append(torch.is_autocast_enabled("cpu"))
            return super().per_example_loss(batch)

    torch.manual_seed(0)
    model = Recording(config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS)
    trainer = L.Trainer(
        strategy=DPStrategy(accelerator="cpu", max_grad_norm=0.1, noise_multiplier=1.0),
        devices=1,
        precision="bf16-mixed",
        max_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, RandomTokenData())
    assert autocast_seen and all(autocast_seen)  # the self-check's calls (the first ones) included
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
