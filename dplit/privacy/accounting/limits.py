"""The accountants' working range, measured, and how a refusal describes a plan.

opacus' accountants have a limited working range, and outside it they hang, allocate petabytes or raise errors
that mean nothing to a user. The limits below were measured with opacus 1.6.0 on a 2-core machine:

* PRV builds a grid of ``2L / mesh`` points on [-L, L], with ``L ≈`` the RDP ε at ``δ/4000`` plus 3 and
  ``mesh = 0.01 / sqrt(steps · ln(12000/δ) / 2)``; one ε costs ≈ 1 µs and 100-200 bytes per point (1e6 points:
  ≈ 1 s; 1e7: ≈ 9 s and 1-2 GB; σ = 1e-6 asks for petabytes). :data:`PRV_MAX_GRID` points are allowed, and fewer
  at small δ, where opacus refuses grids of more than ``δ / eps(longdouble)`` points; and L ≤ 700, past which
  opacus' exp(L) overflows (ε = ∞, a saturated ε ≈ 700, or "Discrete mean differs significantly"). Its δ must be
  ≥ :data:`PRV_MIN_DELTA`: below, the float64 PMF's rounding rivals opacus' δ error (δ/1000) and ε stops being
  monotone in σ (measured at δ = 1e-13: 0.014 at σ = 215, 0.99 at σ = 1000).
* RDP computes any σ > 0 in milliseconds, except at q = 0.5 exactly, where it takes ≈ 1 s at σ = 1000 and
  ≈ 10 s at σ = 1e4 (both accountants compute RDP): σ is capped at :data:`NOISE_MULTIPLIER_MAX`.
* ε above :data:`EPSILON_MAX` bounds a likelihood ratio by more than e^100, which is no guarantee, and is where
  calibration chases σ → 0; below the accountant's floor (RDP: its largest order's ``ln(1/δ)`` term; PRV: its ε
  error, 0.01) no σ reaches the target.
* δ above :data:`DELTA_MAX` is no guarantee (publishing a random 10% of the examples meets δ = 0.1), and there
  opacus reports negative ε (δ ≳ 0.3) or fails (PRV, δ ≳ 0.95: "Cannot compute epsilon").
"""

from __future__ import annotations

import math
from typing import Literal

from dplit.numbers import is_finite_number

Mechanism = Literal["prv", "rdp"]
History = list[tuple[float, float, int]]  # (σ, q, steps) segments, as opacus keeps them

EPSILON_MAX = 100.0
"""The largest ``target_epsilon`` accepted."""
DELTA_MAX = 0.1
"""The largest δ accepted."""
NOISE_MULTIPLIER_MAX = 1000.0
"""The largest σ accepted (and searched by calibration)."""
PRV_MAX_GRID = 4_000_000
"""The most points a PRV grid may have (≈ 4 s and < 1 GB per ε on the machine measured)."""
PRV_MIN_DELTA = 1e-12
"""The smallest δ accepted with PRV: below it float64 rounding in its PMF shows (ε jumps, e.g. 0.014 → 0.99)."""

PRV_EPS_ERROR = 0.01  # opacus' PRVAccountant.get_epsilon defaults: eps_error = 0.01, delta_error = δ / 1000
PRV_DELTA_ERROR = 1e-3  # as a fraction of δ; opacus divides δ by 1000 (see prv_delta_error)
PRV_MAX_HALF_WIDTH = 700.0  # the PRV grid spans [-L, L] and opacus takes exp(±t) on it
SIGMA_FLOOR = 1e-3  # the smallest σ calibration tries
_SIGMA_LADDER = (10.0, 100.0, NOISE_MULTIPLIER_MAX)  # calibration's first tries; σ > 10 is rare (slow at q = 0.5)
_MAX_BISECTIONS = 60


def plan_text(sample_rate: float, steps: int, delta: float) -> str:
    """How a refusal names a plan: its steps, q and δ."""
    return f"over {steps} steps at q={sample_rate:.3g} with δ={delta:.3g}"


def describe(history: History) -> str:
    """How a refusal names a history: its steps, and σ and q (or their ranges)."""
    steps = sum(count for _, _, count in history)
    if len(history) == 1:
        sigma, q, _ = history[0]
        return f"{steps} steps at σ={sigma:.3g}, q={q:.3g}"
    sigmas, rates = [s for s, _, _ in history], [q for _, q, _ in history]
    return f"{steps} steps at σ in [{min(sigmas):.3g}, {max(sigmas):.3g}], q in [{min(rates):.3g}, {max(rates):.3g}]"


def ceil_sig(value: float, digits: int = 3) -> str:
    """``value`` rounded up to ``digits`` significant digits (a bound the user may type in and meet)."""
    if not is_finite_number(value, above=0):
        return f"{value:.{digits}g}"
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.ceil(value / scale) * scale:.{digits}g}"


def floor_sig(value: float, digits: int = 3) -> str:
    """``value`` rounded down to ``digits`` significant digits."""
    if not is_finite_number(value, above=0):
        return f"{value:.{digits}g}"
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.floor(value / scale) * scale:.{digits}g}"
