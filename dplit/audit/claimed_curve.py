"""The claimed mechanism's own trade-off curve: what the f-DP audit's verdict tests.

For full batches (q = 1), T Gaussian steps of noise multiplier σ are exactly √T/σ-GDP: the curve is G_μ. With
Poisson sampling (q < 1) the curve is not Gaussian, and a GDP curve does not bound it from the safe side, so the
verdict tests the curve itself: dp-accounting's privacy loss distribution of the Poisson-subsampled Gaussian,
composed T times (pessimistic discretisation, both neighbouring directions), read as a trade-off function through
its privacy profile, f(α) = max over ε of max(0, 1 − δ(ε) − e^ε·α, e^(−ε)·(1 − δ(ε) − α)). A finite grid of ε and a
stepwise reading of f only lower f: the claim tested is weaker than the real one, so refuting it stays sound.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from dp_accounting.pld import privacy_loss_distribution

from dplit.audit.fdp import LeastProbability, gdp_least_probability

EPSILON_POINTS = 400
"""ε values at which the privacy profile δ(ε) is read (from 0 to where δ falls below 10⁻¹²)."""
ALPHA_GRID = np.unique(np.concatenate([[0.0], np.logspace(-15, -1, 1400), np.linspace(0.1, 1.0, 901)]))
"""Where f is tabulated: dense near 0, where the recursion's first steps read it."""
DISCRETISATION = 1e-3
"""dp-accounting's value discretisation interval of the privacy loss."""


def claimed_least_probability(*, noise_multiplier: float, sample_rate: float, steps: int) -> LeastProbability:
    """The claimed DP-SGD curve as x ↦ f(1 − x): exact G_μ for q = 1, the PLD's curve (from below) for q < 1.

    Args:
        noise_multiplier: σ (> 0).
        sample_rate: q.
        steps: T.
    """
    if sample_rate >= 1:
        return functools.partial(gdp_least_probability, mu=math.sqrt(steps) / noise_multiplier)
    alphas, tradeoff = tabulated_tradeoff(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)

    def least(probability: np.ndarray) -> np.ndarray:
        # f is decreasing: f at the grid point at or above α = 1 − x is at most f(α) (never overstates the claim)
        index = np.searchsorted(alphas, 1.0 - np.clip(probability, 0.0, 1.0), side="left")
        return tradeoff[np.minimum(index, alphas.size - 1)]

    return least


def tabulated_tradeoff(*, noise_multiplier: float, sample_rate: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The trade-off curve f of T Poisson-subsampled Gaussian steps at :data:`ALPHA_GRID`: (α, f(α))."""
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0, sampling_prob=sample_rate,
        value_discretization_interval=DISCRETISATION, pessimistic_estimate=True,
    ).self_compose(steps)  # fmt: skip
    top = pld.get_epsilon_for_delta(1e-12)
    epsilons = np.linspace(0.0, max(top, 1e-3), EPSILON_POINTS)  # [K]
    deltas = np.asarray(pld.get_delta_for_epsilon(list(epsilons)))  # [K]
    alphas = ALPHA_GRID[:, None]  # [J, 1]
    lines = np.maximum(1 - deltas - np.exp(epsilons) * alphas, np.exp(-epsilons) * (1 - deltas - alphas))  # [J, K]
    return ALPHA_GRID, np.clip(lines.max(axis=1), 0.0, 1.0)
