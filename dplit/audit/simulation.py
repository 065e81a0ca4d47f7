"""The claimed mechanism, simulated in-process: what a correct run's audit shows, and which guesses to make.

A white-box auditor of a correct DP-SGD run sees, at each canary's coordinate and every step, 1 (in units of C)
when the canary is included and Poisson-sampled, plus N(0, σ²) noise. Simulating that game for the run's m, σ, q
and steps costs m × steps draws and no training. Before any real score is seen, the audit simulates it a few times
to choose the (k₊, k₋) of its f-DP bound (the pair whose mean μ̂ is largest: a choice fixed in advance, so the
bound needs no Bonferroni correction) and to state the μ̂ and ε̂ a correct run is expected to show.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dplit.audit.bound import guess_outcomes
from dplit.audit.canaries import white_box_step_score
from dplit.audit.fdp import gdp_epsilon, mu_lower_bound

PLAN_SEED = 20_250_713
"""The simulations' seed: public and fixed, so the plan is a function of m, σ, q, T, δ and confidence only."""
SIMULATED_CANARIES = 40_000
"""Canaries simulated behind a plan, over 3 to 8 runs: a stable mean at m = 1000 (8 runs) and m = 10,000 (4)."""
PLAN_FRACTIONS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
"""The k₊ and k₋ a plan chooses from, as shares of m: a fine grid costs no confidence, as the choice is made on
simulated runs only."""


def plan_counts(canaries: int) -> list[int]:
    """The candidate k₊ and k₋ of a plan for m canaries (distinct, from :data:`PLAN_FRACTIONS`)."""
    return sorted({round(canaries * fraction) for fraction in PLAN_FRACTIONS})


def simulate_white_box(
    *, canaries: int, noise_multiplier: float, sample_rate: float, steps: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """One correct run as the white-box auditor sees it: each canary's score [m] and membership [m] (bool).

    Args:
        canaries: m, each included with probability 1/2.
        noise_multiplier: σ (0: no noise).
        sample_rate: q.
        steps: T.
        generator: the simulation's randomness.
    """
    included = torch.rand(canaries, generator=generator, dtype=torch.float64) < 0.5  # [m]
    scores = torch.zeros(canaries, dtype=torch.float64)
    for _ in range(steps):
        sampled = included & (torch.rand(canaries, generator=generator, dtype=torch.float64) < sample_rate)  # [m]
        noise = torch.randn(canaries, generator=generator, dtype=torch.float64) * noise_multiplier  # [m]
        scores += white_box_step_score(
            sampled.double() + noise, noise_multiplier=noise_multiplier, sample_rate=sample_rate
        )
    return scores, included


@dataclass(frozen=True)
class GuessPlan:
    """The guesses the f-DP bound will make, and what a correct run is expected to show with them."""

    k_plus: int
    k_minus: int
    expected_mu: float
    """Mean μ̂ over the simulated correct runs."""
    expected_epsilon: float
    """ε at δ of :attr:`expected_mu`."""
    ceiling_mu: float
    """μ̂ when all k₊ + k₋ guesses are right: the most this audit can show."""
    ceiling_epsilon: float
    simulations: int


@functools.lru_cache(maxsize=32)
def plan_guesses(
    *, canaries: int, noise_multiplier: float, sample_rate: float, steps: int, delta: float, confidence: float,
    seed: int = PLAN_SEED, simulations: int | None = None,
) -> GuessPlan:  # fmt: skip
    """Choose (k₊, k₋) among :func:`plan_counts` on simulated correct runs: the pair of the largest mean μ̂.

    The mean, not the median: near the most a run can show (no noise), the median picks k₊ at the very number of
    canaries a typical run includes (or samples), and a run that includes a few fewer then loses a third of its ε̂;
    the mean weighs those runs in and keeps a margin. A pure function of its arguments: the plan (immutable) is
    cached, so a second audit of the same claim reuses it.

    Args:
        canaries: m.
        noise_multiplier: σ the run claims.
        sample_rate: q of the run.
        steps: T of the run.
        delta: the run's δ (μ̂ is read as ε̂ there).
        confidence: of the bound.
        seed: of the simulations (a public constant by default: nothing of the run's own randomness).
        simulations: how many correct runs to simulate (default: :data:`SIMULATED_CANARIES` / m, from 3 to 8).
    """
    simulations = simulations or min(8, max(3, SIMULATED_CANARIES // canaries))
    generator = torch.Generator().manual_seed(seed)
    level = 1 - confidence
    runs = []
    for _ in range(simulations):
        scores, included = simulate_white_box(
            canaries=canaries, noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps,
            generator=generator,
        )  # fmt: skip
        runs.append(np.array(guess_outcomes(scores, included, plan_counts(canaries))).T)  # [3, pairs]: k₊, k₋, v
    plus, minus, correct = np.stack(runs, axis=1)  # [runs, pairs] each: all runs' bounds in one search
    means = mu_lower_bound(canaries=canaries, guesses=plus + minus, correct=correct, level=level).mean(axis=0)
    best = int(np.argmax(means))  # [pairs] above: the mean μ̂ of each pair
    k_plus, k_minus = int(plus[0, best]), int(minus[0, best])
    expected = float(means[best])
    ceiling = float(mu_lower_bound(canaries=canaries, guesses=np.array(k_plus + k_minus),
                                   correct=np.array(k_plus + k_minus), level=level))  # fmt: skip
    return GuessPlan(
        k_plus=k_plus, k_minus=k_minus, expected_mu=expected, expected_epsilon=gdp_epsilon(expected, delta),
        ceiling_mu=ceiling, ceiling_epsilon=gdp_epsilon(ceiling, delta), simulations=simulations,
    )  # fmt: skip
