"""Clipping without a C to tune: private quantile-adaptive clipping and automatic (normalised) clipping."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from opacus.accountants import PRVAccountant
from torch.utils.data import DataLoader

from dplit.backbone.embeddings import EmbeddingPolicy, TiedEmbeddings, UntiedEmbeddings
from dplit.cli.lightning_cli import run_cli
from dplit.privacy.clip_bound import QuantileClipBound
from dplit.privacy.clipping import build_engine
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.settings import DPSGDSettings
from dplit.release.export import export_checkpoint
from dplit.tasks.classifier import CausalLMClassifier
from tests.helpers.brute_force import gradient_norms, per_example_gradients
from tests.helpers.commands import checkpoint_of, quickstart_args, steps
from tests.helpers.oracles import assert_close, padded_batch, run
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, PadCollate, RandomTokens

POLICIES = {"tied": TiedEmbeddings(), "untied": UntiedEmbeddings()}


def classifier(policy: EmbeddingPolicy) -> CausalLMClassifier:
    torch.manual_seed(0)
    model = CausalLMClassifier(config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS, embeddings=policy)
    return model.double()


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("clipping", ["ghost", "per_example"])
def test_automatic_clipping_scales_each_example_by_c_over_its_norm_plus_gamma(policy: str, clipping: str) -> None:
    """float64: Σ_i C g_i / (‖g_i‖ + γ), every example's contribution below C, large or small."""
    model, batch = classifier(POLICIES[policy]), padded_batch([3, 7, 2, 5], "right", vocab=VOCAB)
    examples = per_example_gradients(model, model.per_example_loss, batch)
    norms = gradient_norms(examples)
    engine = build_engine(clipping, model, max_grad_norm=2.0, stability=0.01)
    stats, grads = run(engine, model, model.per_example_loss, batch)
    assert_close(stats.norms, norms)
    for name, grad in grads.items():
        expected = sum(2.0 / (n + 0.01) * example[name] for n, example in zip(norms, examples, strict=True))
        assert_close(grad, expected)


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize(("scale", "bound"), [(1e3, 0.3), (1e-3, 0.3), (1e3, None)])
def test_each_examples_contribution_is_at_most_the_bound_of_its_mode(
    policy: str, scale: float, bound: float | None
) -> None:
    """Adversarial inputs (embeddings ×1e3 or ×1e-3): ≤ C_t after a quantile move, < C under automatic clipping."""
    model = classifier(POLICIES[policy])
    with torch.no_grad():
        model.backbone.get_input_embeddings().weight.mul_(scale)
    engine = build_engine("ghost", model, max_grad_norm=1.0, stability=None if bound else 1e-6)
    if bound is not None:
        engine.set_max_grad_norm(bound)  # C_t of a later step
    limit = bound or 1.0
    batch = padded_batch([3, 7, 2, 5], "right", vocab=VOCAB)
    for row in range(4):
        _, grads = run(
            engine, model, model.per_example_loss, {key: value[row : row + 1] for key, value in batch.items()}
        )
        assert float(torch.sqrt(sum(grad.pow(2).sum() for grad in grads.values()))) <= limit * (1 + 1e-6)


def test_the_count_is_centred_so_one_example_moves_it_by_a_half() -> None:
    """Σ (1[‖g‖ ≤ C] − ½): adding an example (clipped or not) moves it by ½, the sensitivity σ_eff assumes."""
    tracker = QuantileClipBound(initial=1.0, target_quantile=0.5, learning_rate=0.2, count_noise_multiplier=1.0)
    norms = torch.tensor([0.5, 2.0, 0.9, 3.0, 0.1])
    base = tracker.centred_count(norms)
    for extra in (0.2, 5.0):
        assert abs(tracker.centred_count(torch.cat([norms, torch.tensor([extra])])) - base) == 0.5
    tracker.update(base, expected_batch=5)  # 3 of 5 unclipped: the estimate is 0.6, so C shrinks
    assert tracker.last_estimate == pytest.approx(0.6) and tracker.bound < 1.0


def test_the_bound_converges_to_the_target_quantile_of_the_norms() -> None:
    """Log-normal norms, 64 examples a step, σ_b = 64/20: after 400 steps C sits at the median within ±15%."""
    generator = torch.Generator().manual_seed(0)
    tracker = QuantileClipBound(initial=0.01, target_quantile=0.5, learning_rate=0.2, count_noise_multiplier=3.2)
    for _ in range(400):
        norms = torch.exp(torch.randn(64, generator=generator, dtype=torch.float64))  # median 1
        noisy = tracker.centred_count(norms) + float(torch.randn((), generator=generator)) * 3.2
        tracker.update(noisy, 64)
    assert tracker.bound == pytest.approx(1.0, rel=0.15)


def dpsgd(settings: dict[str, Any], *, sigma: float = 1.0) -> tuple[DPSGD, CausalLMClassifier]:
    model = classifier(TiedEmbeddings())
    options = {"max_grad_norm": 1.0, "noise_multiplier": sigma, "target_delta": 1e-3, "self_check": False}
    mechanism = DPSGD(model, DPSGDSettings(**{**options, **settings}), history=PrivacyHistory())
    mechanism.sample(DataLoader(RandomTokens(64), batch_size=16, collate_fn=PadCollate()))
    return mechanism, model


def empty_step(mechanism: DPSGD, model: CausalLMClassifier) -> dict[str, torch.Tensor]:
    """One release of an empty batch: the update is the noise alone (÷ qN = 16)."""
    empty = {"input_ids": torch.zeros(0, 1, dtype=torch.long), "attention_mask": torch.zeros(0, 1, dtype=torch.long),
             "labels": torch.zeros(0, dtype=torch.long)}  # fmt: skip
    mechanism.clip(model.per_example_loss, empty)
    mechanism.release()
    noise = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return noise


def test_the_count_and_the_gradient_get_their_share_of_one_gaussian_mechanism() -> None:
    """σ = 1, σ_b = 0.6: the gradient's noise has std σ_eff C / B (σ_eff ≈ 1.81), the count's σ_b / B; ε is σ's."""
    mechanism, model = dpsgd({"clip_mode": "quantile", "count_noise_multiplier": 0.6, "clip_learning_rate": 1e-9})
    mechanism.start(planned_steps=200)
    sigma_eff = (1.0 - (2 * 0.6) ** -2) ** -0.5
    assert mechanism.gradient_noise_multiplier == pytest.approx(sigma_eff)
    estimates, weights = [], []
    for _ in range(200):
        weights.append(empty_step(mechanism, model)["backbone.transformer.wte.weight"].flatten())
        estimates.append(mechanism.bound.last_estimate)
    assert float(torch.stack(weights).std()) == pytest.approx(sigma_eff * 1.0 / 16, rel=0.03)
    assert float(torch.tensor(estimates).std()) == pytest.approx(0.6 / 16, rel=0.15)  # 200 draws: ±10% sampling
    reference = PRVAccountant()
    reference.history = [(1.0, 16 / 64, 200)]
    mechanism.finish()
    assert mechanism.budget.epsilon_spent == pytest.approx(reference.get_epsilon(1e-3), rel=1e-6)


def test_a_resume_continues_with_the_same_bound() -> None:
    mechanism, model = dpsgd({"clip_mode": "quantile", "count_noise_multiplier": 2.0})
    mechanism.start(planned_steps=3)
    for _ in range(3):
        empty_step(mechanism, model)
    assert mechanism.clip_bound != 1.0
    resumed, _ = dpsgd({"clip_mode": "quantile", "count_noise_multiplier": 2.0})
    resumed.load_state_dict(mechanism.state_dict())
    resumed.start(planned_steps=6, steps_done=3)
    assert resumed.clip_bound == mechanism.clip_bound  # bit for bit
    assert resumed.engine.max_grad_norm == mechanism.clip_bound


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"clip_mode": "quantile", "target_quantile": 1.0}, "target_quantile must be in \\(0, 1\\)"),
        ({"clip_mode": "quantile", "target_quantile": 0.0}, "target_quantile must be in \\(0, 1\\)"),
        ({"clip_mode": "quantile", "clip_learning_rate": 0.0}, "clip_learning_rate must be a finite number > 0"),
        ({"clip_mode": "quantile", "count_noise_multiplier": -1.0}, "count_noise_multiplier must be a finite number"),
        ({"clip_mode": "quantile", "max_grad_norm": 0.0}, "max_grad_norm must be a finite number > 0"),
        ({"clip_mode": "automatic", "automatic_stability": 0.0}, "automatic_stability must be a finite number > 0"),
        ({"target_quantile": 0.5}, "target_quantile is a knob of clip_mode='quantile', but clip_mode='fixed'"),
        ({"clip_mode": "automatic", "count_noise_multiplier": 2.0}, "count_noise_multiplier is a knob of clip_mode="),
        ({"clip_mode": "quantile-ish"}, "clip_mode must be"),
    ],
)
def test_a_bad_clip_mode_setting_is_refused_in_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        DPSGDSettings(**{"max_grad_norm": 1.0, "noise_multiplier": 1.0, **settings})
    assert "\n" not in str(refused.value)


def test_a_count_noise_too_small_for_sigma_is_refused_before_any_step() -> None:
    mechanism, _ = dpsgd({"clip_mode": "quantile", "count_noise_multiplier": 0.4})
    with pytest.raises(ValueError, match="count_noise_multiplier=0.4 is too small for σ=1"):
        mechanism.start(planned_steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["quantile", "automatic"])
def test_a_run_logs_its_bound_and_its_card_states_the_mode(mode: str, tmp_path: Path) -> None:
    cli = run_cli(["fit", *quickstart_args(tmp_path, *steps(3), "--trainer.strategy.init_args.clip_mode", mode)])
    metrics = cli.trainer.callback_metrics
    assert "dp/clip_bound" in metrics and cli.trainer.strategy.dpsgd.budget.steps == 3
    if mode == "quantile":
        assert float(metrics["dp/clip_bound"]) != 1.0 and "dp/clip_quantile_estimate" in metrics
    export_checkpoint(checkpoint_of(tmp_path), tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    expected = "privately tracks the 0.5-quantile of the norms" if mode == "quantile" else "automatic clipping"
    assert expected in card and f"| clipping bound | {mode} |" in card
    assert math.isfinite(float(metrics["privacy/epsilon"]))


def test_units_counted_outside_the_engine_join_the_noisy_count_at_a_half_each() -> None:
    """Units counted outside the engine move the noisy count by ±½ each, like clipped examples.

    σ = 0 (no count noise): an empty batch's estimate is ½; two units at the bound and one above move it by
    (½ + ½ − ½) / B; in fixed mode counting does nothing.
    """
    mechanism, model = dpsgd({"clip_mode": "quantile", "clip_learning_rate": 1e-9}, sigma=0.0)
    mechanism.start(planned_steps=3)
    empty_step(mechanism, model)
    assert mechanism.bound.last_estimate == pytest.approx(0.5)
    handle = mechanism.register_before_noise_hook(
        lambda dpsgd, _: dpsgd.count_units(torch.tensor([1.0, 1.0, 5.0], dtype=torch.float64))
    )
    empty_step(mechanism, model)
    assert mechanism.bound.last_estimate == pytest.approx(0.5 + 0.5 / 16)
    handle.remove()
    with pytest.raises(RuntimeError, match="from a before-noise hook only"):  # it would land in no step's count
        mechanism.count_units(torch.ones(3))
