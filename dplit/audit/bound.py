"""The one-run audit's lower bound on ε (Steinke, Nasr and Jagielski 2023, arXiv 2305.08846, Appendix D).

m canaries are each included independently with probability 1/2; the auditor guesses "in" for the k₊ highest
scores and "out" for the k₋ lowest and abstains on the rest. Under (ε, δ)-DP the number of correct guesses v
among r = k₊ + k₋ is stochastically dominated by Binomial(r, e^ε / (1 + e^ε)) up to a δ term (the paper's
Theorem for approximate DP). A v so large that its p-value is below 1 − confidence refutes that ε: the largest
refuted ε is the empirical lower bound ε̂. Binomial tails are summed exactly from the probability mass
function (in float64 log space), never from a normal approximation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

SEARCH_TOLERANCE = 1e-5
"""Width of the bisection bracket at which ε̂ is returned (its lower end, so ε̂ is never overstated)."""


@functools.lru_cache(maxsize=128)
def _log_choose(trials: int) -> tuple[Tensor, Tensor]:
    """The k = 0..trials and log C(trials, k), float64 [trials + 1] each: cached, never to be written to."""
    k = torch.arange(trials + 1, dtype=torch.float64)
    return k, math.lgamma(trials + 1) - torch.lgamma(k + 1) - torch.lgamma(trials - k + 1)


def binomial_pmf(trials: int, probability: float) -> Tensor:
    """P[Binomial(trials, probability) = k] for k = 0..trials, float64 [trials + 1] (a new tensor)."""
    k, log_choose = _log_choose(trials)  # [trials + 1] each
    if probability in (0.0, 1.0):
        return (k == trials * probability).to(torch.float64)
    log_pmf = log_choose + k * math.log(probability) + (trials - k) * math.log1p(-probability)
    return log_pmf.exp()


def p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability of at least ``correct`` right guesses out of ``guesses`` under (ε, δ)-DP (an upper bound).

    Args:
        canaries: m, each included independently with probability 1/2.
        guesses: r, the guesses made (abstentions excluded).
        correct: v, the right ones.
        epsilon: ε of the null hypothesis.
        delta: δ of the null hypothesis.
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}")
    if correct == 0:
        return 1.0
    accuracy = 1 / (1 + math.exp(-epsilon))  # the accuracy of ε-DP randomised response
    pmf = binomial_pmf(guesses, accuracy)  # [r + 1]
    tail = float(pmf[correct:].sum())  # P[Binomial(r, accuracy) ≥ v]
    if delta == 0:
        return min(tail, 1.0)
    below = pmf[:correct].flip(0).cumsum(0)  # [v]: entry i-1 is P[v - i ≤ Binomial < v], i = 1..v
    alpha = float((below / torch.arange(1, correct + 1, dtype=torch.float64)).max())
    return min(tail + alpha * delta * 2 * canaries, 1.0)


@functools.lru_cache(maxsize=4096)
def epsilon_lower_bound(*, canaries: int, guesses: int, correct: int, delta: float, confidence: float) -> float:
    """The largest ε that ``correct`` of ``guesses`` refutes at ``confidence`` (0 when none is refuted; cached)."""
    level = 1 - confidence
    low, high = 0.0, 1.0

    def refuted(epsilon: float) -> bool:
        return p_value(canaries=canaries, guesses=guesses, correct=correct, epsilon=epsilon, delta=delta) < level

    if not refuted(low):
        return 0.0
    while refuted(high):
        low, high = high, high + 1.0
    while high - low > SEARCH_TOLERANCE:
        middle = (low + high) / 2
        low, high = (middle, high) if refuted(middle) else (low, middle)
    return low


@dataclass(frozen=True)
class AuditBound:
    """The guesses the bound was computed from and ε̂ itself."""

    epsilon: float
    k_plus: int
    k_minus: int
    correct: int
    choices: int
    """How many (k₊, k₋) pairs were tried: ε̂ holds at the confidence asked, with each pair tried at 1 − (1 − c)/choices."""


def guess_counts(canaries: int) -> list[int]:
    """The candidate k (for k₊ and for k₋): 0 and about 1, 2, 5, 10, 20 and 50% of m, fixed before any score is seen."""
    fractions = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    return sorted({0, *(max(1, round(canaries * fraction)) for fraction in fractions)})


def audit_bound(scores: Tensor, included: Tensor, *, delta: float, confidence: float) -> AuditBound:
    """ε̂ from canary scores (higher = more likely in), the best over a fixed grid of (k₊, k₋), Bonferroni-adjusted.

    Args:
        scores: each canary's score [m].
        included: whether each canary was in the training run [m] (bool).
        delta: the δ the run claims.
        confidence: e.g. 0.95; every (k₊, k₋) pair of the grid is tested at 1 − (1 − confidence) / pairs, so the
            best of them holds at ``confidence``.
    """
    outcomes = guess_outcomes(scores, included)
    adjusted = 1 - (1 - confidence) / len(outcomes)
    best = AuditBound(epsilon=0.0, k_plus=0, k_minus=0, correct=0, choices=len(outcomes))
    for plus, minus, correct in outcomes:
        epsilon = epsilon_lower_bound(
            canaries=scores.shape[0], guesses=plus + minus, correct=correct, delta=delta, confidence=adjusted
        )
        if epsilon > best.epsilon:
            best = AuditBound(epsilon=epsilon, k_plus=plus, k_minus=minus, correct=correct, choices=len(outcomes))
    return best


def guess_outcomes(scores: Tensor, included: Tensor, counts: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(k₊, k₋, right guesses) for every pair of ``counts`` with 0 < k₊ + k₋ ≤ m.

    "In" on the k₊ highest scores, "out" on the k₋ lowest (ties broken by canary order).

    Args:
        scores: each canary's score [m] (higher = more likely in).
        included: whether each canary was in the run [m] (bool).
        counts: the candidate k₊ and k₋ (default :func:`guess_counts`).
    """
    count = scores.shape[0]
    order = torch.argsort(scores.double(), descending=True, stable=True)  # [m], highest score first
    ranked_in = included[order].long()  # [m]
    in_prefix = torch.cat([torch.zeros(1, dtype=torch.long), ranked_in.cumsum(0)])  # [m + 1]: "in"s in the top k
    out_suffix = torch.cat([torch.zeros(1, dtype=torch.long), (1 - ranked_in).flip(0).cumsum(0)])  # bottom k
    counts = guess_counts(count) if counts is None else counts
    return [
        (plus, minus, int(in_prefix[plus]) + int(out_suffix[minus]))
        for plus in counts for minus in counts if 0 < plus + minus <= count
    ]  # fmt: skip


def correct_guesses(scores: Tensor, included: Tensor, *, k_plus: int, k_minus: int) -> int:
    """Right guesses among "in" on the ``k_plus`` highest scores and "out" on the ``k_minus`` lowest (k₊ + k₋ ≤ m)."""
    if k_plus + k_minus > scores.shape[0]:
        raise ValueError(f"{k_plus} + {k_minus} guesses exceed the {scores.shape[0]} canaries")
    ranked_in = included[torch.argsort(scores.double(), descending=True, stable=True)]  # [m], highest score first
    return int(ranked_in[:k_plus].sum()) + int((~ranked_in.flip(0)[:k_minus]).sum())
