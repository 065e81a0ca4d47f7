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
    guesses, correct = np.broadcast_arrays(np.asarray(guesses), np.asarray(correct))
    masses = np.zeros(guesses.shape)  # [...]: the curve's argument, lanes not walking left at 0

    def least(probability: np.ndarray, lanes: np.ndarray) -> np.ndarray:
        masses.reshape(-1)[lanes] = probability  # the curve is elementwise: other lanes' entries change nothing
        return np.broadcast_to(least_probability(masses), guesses.shape).reshape(-1)[lanes]

    refuted = _walk(least, canaries=canaries, guesses=guesses.reshape(-1), correct=correct.reshape(-1), level=level)
    return refuted.reshape(guesses.shape)


LaneCurve = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""A curve per lane: (probabilities, the flat indices of their lanes) ↦ least probabilities (elementwise)."""


def _walk(
    least: LaneCurve, *, canaries: int, guesses: np.ndarray, correct: np.ndarray, level: float, settle: bool = False
) -> np.ndarray:
    """:func:`refutes`' recursion over flat lanes, stepping only the lanes that walk (v > step).

    Each lane's arithmetic is the same as a whole-array walk's, so its masses are the same to the last bit. With
    ``settle`` (for a curve that never returns NaN), a lane whose total already exceeds r/m leaves the walk refuted:
    both masses only grow along it (the forced wrong mass is at least the last, the right one gains a nonnegative
    amount, and rounding is monotone), so the walk's end would exceed r/m too.
    """
    available = guesses / canaries  # [lanes]: r/m
    right, wrong = np.zeros(guesses.shape), np.zeros(guesses.shape)  # the recursion's r_i and h_i
    by_start = np.argsort(-correct, kind="stable")  # [lanes]: most right guesses first, the order lanes start in
    steps = np.arange(int(correct.max(initial=0)), -1, -1)  # [steps]
    ends = np.searchsorted(-correct[by_start], -steps, side="right")  # [steps]: lanes started by the end of each
    walking = [np.empty(0, dtype=np.intp), np.empty(0), np.empty(0), np.empty(0, dtype=guesses.dtype), np.empty(0)]
    for step, started, ending in zip(steps.tolist(), [0, *ends[:-1].tolist()], ends.tolist(), strict=True):
        lanes, right_mass, wrong_mass, total, share = walking  # the walking lanes' indices, r_i, h_i, r and r/m
        if lanes.size:
            forced = np.maximum(wrong_mass, least(right_mass, lanes))
            right_mass = right_mass + step / np.maximum(total - step, 1) * (forced - wrong_mass)
            walking[1:3] = right_mass, forced
            if settle and (settled := right_mass + forced > share).any():
                right[lanes[settled]], wrong[lanes[settled]] = right_mass[settled], forced[settled]
                walking = [column[~settled] for column in walking]
        if ending > started:
            new = by_start[started:ending]  # the lanes of v = step
            start_right = level * available[new] * correct[new] / guesses[new]
            start_wrong = level * available[new] * (guesses[new] - correct[new]) / guesses[new]
            columns = (new, start_right, start_wrong, guesses[new], available[new])
            walking = [np.concatenate([column, more]) for column, more in zip(walking, columns, strict=True)]
    right[walking[0]], wrong[walking[0]] = walking[1], walking[2]
    return right + wrong > available


def mu_lower_bound(*, canaries: int, guesses: np.ndarray, correct: np.ndarray, level: float) -> np.ndarray:
    """μ̂ of each (r, v) lane: the end of the refuted interval [0, μ*), from below (0 when even μ = 0 stands).

    Lanes of the same (r, v) are computed once.

    Args:
        canaries: m.
        guesses: r of each lane.
        correct: v of each lane.
        level: τ, the p-value at which μ is refuted.
    """
    guesses, correct = np.broadcast_arrays(np.asarray(guesses), np.asarray(correct))
    flat_guesses, flat_correct = guesses.reshape(-1), correct.reshape(-1)
    _, first, lane = np.unique(np.stack([flat_guesses, flat_correct]), axis=1, return_index=True, return_inverse=True)
    bounds = _mu_lower_bound(canaries=canaries, guesses=flat_guesses[first], correct=flat_correct[first], level=level)
    return bounds[lane.reshape(-1)].reshape(guesses.shape)


def _mu_lower_bound(*, canaries: int, guesses: np.ndarray, correct: np.ndarray, level: float) -> np.ndarray:
    """:func:`mu_lower_bound` of flat lanes, each refined only while its bracket is open.

    A lane whose bracket has closed (low = high: μ = 0 stands, or μ = 40 is refuted) would stay where it is.
    """
    low, high = np.zeros(guesses.shape), np.full(guesses.shape, MU_CEILING)
    for _ in range(GRID_PASSES):
        lanes = np.flatnonzero(low < high)  # [open]
        fractions = np.linspace(0.0, 1.0, GRID_POINTS)  # [G]
        mus = low[lanes, None] + (high[lanes] - low[lanes])[:, None] * fractions  # [open, G]
        refuted = _walk(
            _gdp_lanes(mus.reshape(-1)), canaries=canaries, guesses=np.repeat(guesses[lanes], GRID_POINTS),
            correct=np.repeat(correct[lanes], GRID_POINTS), level=level, settle=True,
        ).reshape(mus.shape)  # fmt: skip
        last = GRID_POINTS - 1 - np.argmax(refuted[:, ::-1], axis=-1)  # [open]: the largest refuted grid index
        none = ~refuted.any(axis=-1)
        chosen = np.take_along_axis(mus, last[:, None], axis=-1)[:, 0]
        following = np.take_along_axis(mus, np.minimum(last + 1, GRID_POINTS - 1)[:, None], axis=-1)[:, 0]
        low[lanes], high[lanes] = np.where(none, low[lanes], chosen), np.where(none, low[lanes], following)
    return low


def _gdp_lanes(mus: np.ndarray) -> LaneCurve:
    """G_μ of each flat lane's own μ (``mus`` [lanes]), as :func:`_walk` applies it."""

    def least(probability: np.ndarray, lanes: np.ndarray) -> np.ndarray:
        return gdp_least_probability(probability, mus[lanes])

    return least


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
