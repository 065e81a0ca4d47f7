"""The claimed mechanism's own trade-off curve: what the f-DP audit's verdict tests.

For full batches (q = 1), T Gaussian steps of noise multiplier σ are exactly √T/σ-GDP: the curve is G_μ. With
Poisson sampling (q < 1) the curve is not Gaussian, and a GDP curve does not bound it from the safe side, so the
verdict tests the curve itself: dp-accounting's privacy loss distribution of the Poisson-subsampled Gaussian,
composed T times (pessimistic discretisation, both neighbouring directions), read as a trade-off function through
its privacy profile, f(α) = max over ε ≥ 0 of max(0, 1 − δ(ε) − e^ε·α, e^(−ε)·(1 − δ(ε) − α)) (each line bounds f
from below; negative ε add nothing the second family does not). A finite grid of ε only lowers f: the claim tested
is weaker than the real one, so refuting it stays sound. :func:`epsilon_at_least` is the other side: the ε no
correct accountant may go below, which the audit checks the run's claimed ε against.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from dp_accounting.pld import privacy_loss_distribution

from dplit.audit.fdp import LeastProbability, gdp_epsilon, gdp_least_probability

EPSILON_POINTS = 400
"""ε values at which the privacy profile δ(ε) is read (from 0 to where δ falls below 10⁻¹², at most 700)."""
DISCRETISATION = 1e-3
"""dp-accounting's value discretisation interval of the privacy loss (pessimistic, connect-the-dots: tight)."""
OPTIMISTIC_DISCRETISATION = 1e-4
"""The same for the optimistic estimate (privacy buckets, looser: at 10⁻³ it sits 18% under the truth, at 10⁻⁴ 3%)."""


def claimed_least_probability(*, noise_multiplier: float, sample_rate: float, steps: int) -> LeastProbability:
    """The claimed DP-SGD curve as x ↦ f(1 − x): exact G_μ for q = 1, the PLD's curve (from below) for q < 1.

    Args:
        noise_multiplier: σ (> 0).
        sample_rate: q.
        steps: T.
    """
    if sample_rate >= 1:
        return functools.partial(gdp_least_probability, mu=math.sqrt(steps) / noise_multiplier)
    epsilons, deltas = privacy_profile(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)

    def least(probability: np.ndarray) -> np.ndarray:
        alpha = 1.0 - np.clip(probability, 0.0, 1.0)[..., None]  # [..., 1]
        lines = np.maximum(1 - deltas - np.exp(epsilons) * alpha, np.exp(-epsilons) * (1 - deltas - alpha))  # [..., K]
        return np.clip(lines.max(axis=-1), 0.0, 1.0)

    return least


def privacy_profile(*, noise_multiplier: float, sample_rate: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(ε, δ(ε)) of T Poisson-subsampled Gaussian steps on a grid, δ the larger of the two neighbouring directions."""
    pld = _pld(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, pessimistic=True)
    top = min(pld.get_epsilon_for_delta(1e-12), 700.0)
    epsilons = np.linspace(0.0, max(top, 1e-3), EPSILON_POINTS)  # [K]
    return epsilons, np.asarray(pld.get_delta_for_epsilon(list(epsilons)))


def epsilon_at_least(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """A lower bound on the ε at ``delta`` of T DP-SGD steps (σ, q): dp-accounting's optimistic PLD estimate.

    No correct accountant may claim less.
    """
    if sample_rate >= 1:
        return gdp_epsilon(math.sqrt(steps) / noise_multiplier, delta)
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0, sampling_prob=sample_rate,
        value_discretization_interval=OPTIMISTIC_DISCRETISATION, pessimistic_estimate=False, use_connect_dots=False,
    ).self_compose(steps)  # fmt: skip
    return float(pld.get_epsilon_for_delta(delta))


def _pld(*, noise_multiplier: float, sample_rate: float, steps: int, pessimistic: bool) -> Any:
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0, sampling_prob=sample_rate,
        value_discretization_interval=DISCRETISATION, pessimistic_estimate=pessimistic,
    ).self_compose(steps)  # fmt: skip
