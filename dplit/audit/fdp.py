"""The one-run f-DP audit: a lower bound on μ (Gaussian DP) from canary guesses (Mahloujifar, Melis & Chaudhuri 2025).

Auditing f-Differential Privacy in One Run (ICML 2025, arXiv 2410.22235). m canaries are each in the run with
probability 1/2; the auditor guesses on r of them and gets v right. Where Steinke et al. bound v through an (ε, δ)
pair, this analysis bounds it through a whole trade-off curve f: a mechanism that is f-DP cannot make v right
guesses out of r with probability above τ unless a recursion over v, v − 1, …, 0 (each step spends the curve once)
fits in the probability r/m that is available (the paper's Theorem and Algorithm; the authors' own implementation
is Meta's PrivacyGuard ``FDPAnalysisNode``). Here f is the Gaussian curve G_μ (μ-GDP, Dong, Roth & Su 2022):
an event of probability x under one neighbour has probability at least Φ(Φ⁻¹(x) − μ) under the other. The
observation refutes every μ whose recursion does not fit; refuted μ form an interval [0, μ*), and μ̂ is its end,
never overstated. μ̂ is also stated as ε̂ at the run's δ through G_μ's privacy profile: exact for the Gaussian
curve of full-batch DP-SGD as the white-box auditor sees it, the GDP reading of the curve otherwise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import special
from torch import Tensor

from dplit.audit.bound import correct_guesses

MU_CEILING = 40.0
"""The largest μ searched: beyond it Φ(Φ⁻¹(x) − μ) underflows in float64 (μ̂ = 40 means "at least 40")."""
GRID_POINTS = 16
"""μ values tried at once in each of :data:`GRID_PASSES` refinements of the search."""
GRID_PASSES = 5
"""Refinements: the bracket of μ̂ narrows by GRID_POINTS − 1 each pass (40 / 15⁵ ≈ 5e-5 at the end)."""


def gdp_least_probability(probability: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Under μ-GDP, the least probability under one neighbour of an event of ``probability`` under the other.

    Φ(Φ⁻¹(x) − μ): the Gaussian trade-off curve read as a lower bound (elementwise, broadcast).
    """
    return special.ndtr(special.ndtri(np.clip(probability, 0.0, 1.0)) - mu)


LeastProbability = Callable[[np.ndarray], np.ndarray]
"""A trade-off curve f read as x ↦ f(1 − x): the least probability under one neighbour of an event of probability x
under the other (elementwise)."""


def refutes(
    least_probability: LeastProbability, *, canaries: int, guesses: np.ndarray, correct: np.ndarray, level: float
) -> np.ndarray:
    """Whether ``correct`` of ``guesses`` right refutes the curve at p-value ``level`` (elementwise over lanes).

    The recursion of Mahloujifar et al.: start from the mass the claim "≥ v right with probability ≥ τ" puts on
    v right and r − v wrong guesses (τ·v/m and τ·(r − v)/m), walk down to 0 right guesses, each step raising the wrong
    mass to what the trade-off curve forces and the right mass with it; the claim is impossible, and the curve
    refuted, when the total exceeds r/m, the probability that any one canary is guessed on.

    Args:
        least_probability: the curve, applied to arrays of the lanes' shape.
        canaries: m.
        guesses: r of each lane (0 < r ≤ m).
        correct: v of each lane (0 ≤ v ≤ r), of the same shape.
        level: τ, e.g. 0.05 for 95% confidence.
    """
    available = guesses / canaries  # r/m
    right, wrong = np.zeros(guesses.shape), np.zeros(guesses.shape)  # the recursion's r_i and h_i
    for step in range(int(correct.max(initial=0)), -1, -1):
        walking = correct > step
        forced = np.maximum(wrong, least_probability(right))
        right = np.where(walking, right + step / np.maximum(guesses - step, 1) * (forced - wrong), right)
        wrong = np.where(walking, forced, wrong)
        starting = correct == step
        right = np.where(starting, level * available * correct / guesses, right)
        wrong = np.where(starting, level * available * (guesses - correct) / guesses, wrong)
    return right + wrong > available


def mu_lower_bound(*, canaries: int, guesses: np.ndarray, correct: np.ndarray, level: float) -> np.ndarray:
    """μ̂ of each (r, v) lane: the end of the refuted interval [0, μ*), from below (0 when even μ = 0 stands).

    Args:
        canaries: m.
        guesses: r of each lane.
        correct: v of each lane.
        level: τ, the p-value at which μ is refuted.
    """
    guesses, correct = np.broadcast_arrays(np.asarray(guesses), np.asarray(correct))
    low, high = np.zeros(guesses.shape), np.full(guesses.shape, MU_CEILING)
    for _ in range(GRID_PASSES):
        fractions = np.linspace(0.0, 1.0, GRID_POINTS)  # [G]
        mus = low[..., None] + (high - low)[..., None] * fractions  # [..., G]
        refuted = refutes(
            functools.partial(gdp_least_probability, mu=mus), canaries=canaries, level=level,
            guesses=np.broadcast_to(guesses[..., None], mus.shape), correct=np.broadcast_to(correct[..., None], mus.shape),
        )  # fmt: skip
        last = GRID_POINTS - 1 - np.argmax(refuted[..., ::-1], axis=-1)  # [...]: the largest refuted grid index
        none = ~refuted.any(axis=-1)
        chosen = np.take_along_axis(mus, last[..., None], axis=-1)[..., 0]
        following = np.take_along_axis(mus, np.minimum(last + 1, GRID_POINTS - 1)[..., None], axis=-1)[..., 0]
        low, high = np.where(none, low, chosen), np.where(none, low, following)
    return low


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2022, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    return float(special.ndtr(-epsilon / mu + mu / 2) - math.exp(epsilon + special.log_ndtr(-epsilon / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float, *, tolerance: float = 1e-6) -> float:
    """The ε of μ-GDP at ``delta``, from below (the lower end of the last bisection bracket)."""
    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gdp_delta(high, mu) > delta:
        low, high = high, 2 * high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if gdp_delta(middle, mu) > delta else (low, middle)
    return low


def dpsgd_mu(*, noise_multiplier: float, sample_rate: float, steps: int) -> float:
    """The μ of DP-SGD: √T/σ exactly in full batches (q = 1), ∞ without noise.

    For q < 1, q·√(T(e^{1/σ²} − 1)): the central limit of Bu et al. 2020, an approximation.
    """
    if noise_multiplier <= 0:
        return math.inf
    if sample_rate >= 1:
        return math.sqrt(steps) / noise_multiplier
    return sample_rate * math.sqrt(steps * math.expm1(noise_multiplier**-2))


@dataclass(frozen=True)
class GdpBound:
    """μ̂ and its ε̂ at δ, with the guesses they came from."""

    mu: float
    epsilon: float
    k_plus: int
    k_minus: int
    correct: int


def gdp_bound(
    scores: Tensor, included: Tensor, *, k_plus: int, k_minus: int, delta: float, confidence: float
) -> GdpBound:
    """μ̂ and ε̂ from canary scores: "in" on the ``k_plus`` highest, "out" on the ``k_minus`` lowest.

    The pair must be fixed before the scores are seen (:func:`dplit.audit.simulation.plan_guesses`): it is tested
    once, at level 1 − ``confidence``.

    Args:
        scores: each canary's score [m] (higher = more likely in).
        included: whether each canary was in the run [m] (bool).
        k_plus: guesses "in".
        k_minus: guesses "out".
        delta: the δ at which μ̂ is read as ε̂.
        confidence: of the bound.
    """
    canaries = scores.shape[0]
    correct = correct_guesses(scores, included, k_plus=k_plus, k_minus=k_minus)
    mu = float(mu_lower_bound(canaries=canaries, guesses=np.array(k_plus + k_minus), correct=np.array(correct),
                              level=1 - confidence))  # fmt: skip
    return GdpBound(mu=mu, epsilon=gdp_epsilon(mu, delta), k_plus=k_plus, k_minus=k_minus, correct=correct)
