"""The claimed mechanism's own curve: exact G_μ in full batches, dp-accounting's PLD (from below) with sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant

from dplit.audit.bound import correct_guesses
from dplit.audit.claimed_curve import claimed_least_probability, epsilon_at_least
from dplit.audit.fdp import gdp_least_probability, refutes
from dplit.audit.simulation import simulate_white_box

POINTS = np.array([1e-6, 1e-3, 0.01, 0.1, 0.3, 0.5, 0.9, 0.99])


def test_the_pld_curve_of_unsampled_steps_is_the_exact_gaussian_curve_from_below() -> None:
    """Q → 1 through the PLD path: within 0.3% of Φ(Φ⁻¹(x) − √T/σ) and never above it (never overstates the claim)."""
    pld = claimed_least_probability(noise_multiplier=3.0, sample_rate=1 - 1e-9, steps=20)(POINTS)
    exact = gdp_least_probability(POINTS, math.sqrt(20) / 3.0)
    assert (pld <= exact + 1e-12).all()
    assert np.allclose(pld[1:], exact[1:], rtol=3e-3)
    assert claimed_least_probability(noise_multiplier=3.0, sample_rate=1.0, steps=20)(POINTS).tolist() == exact.tolist()


def test_the_sampled_curve_reads_as_a_trade_off_function() -> None:
    least = claimed_least_probability(noise_multiplier=0.8, sample_rate=0.05, steps=30)
    x = np.linspace(0, 1, 201)
    values = least(x)
    assert values[0] == 0 and abs(values[-1] - 1) < 1e-9 and (np.diff(values) >= -1e-15).all()  # increasing
    assert (values <= x + 1e-12).all()  # never beyond perfect privacy
    assert least(np.array([5e-4]))[0] > 0  # read near α = 1 too, where the recursion starts


@pytest.mark.parametrize(("sigma", "rate", "steps"), [(0.8, 0.05, 60), (1.2, 0.01, 300), (3.0, 1.0, 20)])
def test_the_least_epsilon_is_just_below_the_accountants(sigma: float, rate: float, steps: int) -> None:
    """dp-accounting's optimistic PLD ε never exceeds opacus' PRV ε (an upper bound) and is within 5% of it."""
    least = epsilon_at_least(noise_multiplier=sigma, sample_rate=rate, steps=steps, delta=1e-6)
    reference = PRVAccountant()
    reference.history = [(sigma, rate, steps)]
    upper = reference.get_epsilon(1e-6)
    assert least <= upper * (1 + 1e-3) and least > 0.95 * upper


def guesses_refute(curve, sigma: float, *, k_plus: int, k_minus: int, seed: int) -> bool:
    """One simulated audit (m = 1000, q = 0.1, 30 steps) of a mechanism of noise ``sigma``: is ``curve`` refuted?"""
    scores, included = simulate_white_box(canaries=1000, noise_multiplier=sigma, sample_rate=0.1, steps=30,
                                          generator=torch.Generator().manual_seed(seed))  # fmt: skip
    right = correct_guesses(scores, included, k_plus=k_plus, k_minus=k_minus)
    guesses = np.array([k_plus + k_minus])
    return bool(refutes(curve, canaries=1000, guesses=guesses, correct=np.array([right]), level=0.05)[0])


def test_a_correct_sampled_mechanism_is_not_refuted_and_a_nearly_noiseless_one_is() -> None:
    curve = claimed_least_probability(noise_multiplier=0.8, sample_rate=0.1, steps=30)
    for k_plus, k_minus in ((200, 200), (400, 0)):
        assert not any(guesses_refute(curve, 0.8, k_plus=k_plus, k_minus=k_minus, seed=seed) for seed in range(10))
    assert all(guesses_refute(curve, 0.05, k_plus=400, k_minus=0, seed=seed) for seed in range(3))


def test_the_audit_fails_an_accountant_that_understates_epsilon() -> None:
    from dataclasses import replace

    from dplit.audit.command import ClaimedMechanism, _accounting_check

    reference = PRVAccountant()
    reference.history = [(1.2, 0.01, 300)]
    honest = reference.get_epsilon(1e-6)
    claim = ClaimedMechanism(noise_multiplier=1.2, gradient_noise_multiplier=1.2, sample_rate=0.01, steps=300,
                             delta=1e-6, epsilon=honest)  # fmt: skip
    assert _accounting_check(claim)["passed"]
    assert not _accounting_check(replace(claim, epsilon=0.8 * honest))["passed"]
    assert _accounting_check(replace(claim, noise_multiplier=0.0)) is None


def test_the_claim_reads_the_accounted_sigma_for_the_curve_and_the_gradients_sigma_for_the_readings() -> None:
    """Under quantile clipping σ_eff > σ: the verdict and accounting use σ, the plan and the scale checks σ_eff."""
    from types import SimpleNamespace

    from dplit.audit.command import ClaimedMechanism

    accountant = SimpleNamespace(steps=30, delta=1e-5, epsilon=lambda: 3.5)
    full = SimpleNamespace(noise_multiplier=1.0, accountant=accountant,
                           dpsgd=SimpleNamespace(gradient_noise_multiplier=1.3, sample_rate=None))  # fmt: skip
    claim = ClaimedMechanism.of(full)
    assert claim == ClaimedMechanism(noise_multiplier=1.0, gradient_noise_multiplier=1.3, sample_rate=1.0, steps=30,
                                     delta=1e-5, epsilon=3.5)  # fmt: skip
    sampled = SimpleNamespace(**{**vars(full), "noise_multiplier": None,
                                 "dpsgd": SimpleNamespace(gradient_noise_multiplier=0.0, sample_rate=0.02)})  # fmt: skip
    assert ClaimedMechanism.of(sampled).noise_multiplier == 0.0 and ClaimedMechanism.of(sampled).sample_rate == 0.02
