"""Refusals before any DP step: a plan the accountant cannot account for, in one line naming the flag and the range."""

from __future__ import annotations

import math

import numpy as np

import dplit.privacy.accounting.limits as limits
from dplit.numbers import is_finite_number
from dplit.privacy.accounting.limits import (
    DELTA_MAX,
    EPSILON_MAX,
    NOISE_MULTIPLIER_MAX,
    PRV_DELTA_ERROR,
    PRV_EPS_ERROR,
    PRV_MAX_HALF_WIDTH,
    PRV_MIN_DELTA,
    SIGMA_FLOOR,
    History,
    Mechanism,
    ceil_sig,
    describe,
    floor_sig,
    plan_text,
)
from dplit.privacy.accounting.opacus_epsilon import ALPHAS, grid_points, prv_grid, prv_grid_limit, prv_mesh
from dplit.privacy.refusal import OWNER, SettingError


def check_accountable(
    *,
    mechanism: Mechanism,
    sample_rate: float,
    steps: int | None,
    delta: float,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
) -> None:
    """Refuse, before any DP step, a run the accountant cannot account for.

    Cheap: arithmetic only, except for a fixed ``noise_multiplier`` under PRV, which costs one RDP curve (the PRV
    grid's size; milliseconds, up to ≈ 1 s at q = 0.5) and, only when refusing, a search for the smallest σ.

    Args:
        mechanism: ``"prv"`` or ``"rdp"`` (the strategy's ``accountant``).
        sample_rate: the Poisson rate q = batch_size / N.
        steps: the planned number of DP steps (``None``: unbounded; a fixed σ is then checked for one step).
        delta: δ (the strategy's ``target_delta`` or its default).
        noise_multiplier: a fixed σ, if given (0 is accepted: no noise, ε = ∞).
        target_epsilon: the ε that σ will be calibrated to, if given.

    Raises:
        ValueError: in one line naming the strategy's flag and the range that works.
    """
    check_basics(mechanism, sample_rate, delta)
    if mechanism == "prv" and delta < PRV_MIN_DELTA:
        raise SettingError(
            f"{OWNER}.target_delta={delta:.3g} is below {PRV_MIN_DELTA:g}, where opacus' PRV accountant is swamped "
            f"by float64 rounding: raise target_delta, or use {OWNER}.accountant='rdp'"
        )
    planned = 1 if steps is None else max(1, int(steps))
    if noise_multiplier is not None:
        _check_noise_multiplier(
            noise_multiplier, mechanism=mechanism, sample_rate=sample_rate, steps=planned, delta=delta
        )
    if target_epsilon is not None:
        if steps is None:
            raise SettingError(
                f"{OWNER}.target_epsilon needs a finite number of planned steps: set trainer.max_epochs or "
                f"trainer.max_steps, or give {OWNER}.noise_multiplier instead"
            )
        _check_target_epsilon(target_epsilon, mechanism=mechanism, sample_rate=sample_rate, steps=planned, delta=delta)


def check_basics(mechanism: str, sample_rate: float, delta: float) -> None:
    """Refuse an unknown accountant, a sample rate outside (0, 1] and a δ outside (0, DELTA_MAX]."""
    if mechanism not in ("prv", "rdp"):
        raise SettingError(f"{OWNER}.accountant must be 'prv' or 'rdp', got {mechanism!r}")
    if not is_finite_number(sample_rate, above=0, maximum=1):
        raise SettingError(f"the Poisson sample rate q = data.batch_size / N must be in (0, 1], got {sample_rate}")
    if not is_finite_number(delta, above=0, maximum=DELTA_MAX):
        raise SettingError(
            f"{OWNER}.target_delta={delta:.3g} must be in (0, {DELTA_MAX:g}]: a larger δ is no guarantee "
            "(publishing a random 10% of the examples meets δ = 0.1) and there opacus reports negative ε or fails "
            "('Cannot compute epsilon')"
        )


def refuse_prv_grid(history: History, delta: float) -> None:
    """Refuse a ledger whose PRV grid is over the limit (opacus would take minutes, or allocate petabytes)."""
    grid, limit = prv_grid(history, delta), prv_grid_limit(delta)
    if grid <= limit:
        return
    if grid <= limits.PRV_MAX_GRID:
        raise SettingError(_prv_delta_too_small(delta, grid, f"for {describe(history)}"))
    raise SettingError(
        f"{OWNER}.accountant='prv' cannot compute ε for {describe(history)} at δ={delta:.3g}: "
        f"{_grid_problem(grid, limit)}; use accountant='rdp', a larger {OWNER}.noise_multiplier, or fewer steps"
    )


def _check_noise_multiplier(
    sigma: float, *, mechanism: Mechanism, sample_rate: float, steps: int, delta: float
) -> None:
    if not is_finite_number(sigma, minimum=0, maximum=NOISE_MULTIPLIER_MAX):
        raise SettingError(
            f"{OWNER}.noise_multiplier={sigma:g} must be 0 (no privacy) or in (0, {NOISE_MULTIPLIER_MAX:g}]: "
            "above it opacus' accountants take seconds per ε (at q = 0.5) and add nothing"
        )
    if sigma == 0 or mechanism != "prv":
        return
    grid, limit = prv_grid([(sigma, sample_rate, steps)], delta), prv_grid_limit(delta)
    if grid <= limit:
        return
    plan = plan_text(sample_rate, steps, delta)
    if grid <= limits.PRV_MAX_GRID:  # the δ-dependent part of the limit binds
        raise SettingError(_prv_delta_too_small(delta, grid, plan))
    smallest = prv_min_noise_multiplier(sample_rate, steps, delta)
    fix = f"use noise_multiplier ≥ {ceil_sig(smallest)}, or " if smallest is not None else "use "
    raise SettingError(
        f"{OWNER}.noise_multiplier={sigma:g} is too small for {OWNER}.accountant='prv' {plan}: "
        f"{_grid_problem(grid, limit)}; {fix}accountant='rdp', or plan fewer steps"
    )


def _check_target_epsilon(target: float, *, mechanism: Mechanism, sample_rate: float, steps: int, delta: float) -> None:
    if not is_finite_number(target, above=0, maximum=EPSILON_MAX):
        raise SettingError(
            f"{OWNER}.target_epsilon={target:g} must be in (0, {EPSILON_MAX:g}]: a larger ε bounds the "
            f"likelihood ratio by more than e^{EPSILON_MAX:g}, which is no guarantee, and calibration chases σ → 0"
        )
    floor = epsilon_floor(mechanism, delta)
    if target <= floor:
        other = f" or use {OWNER}.accountant='prv'" if mechanism == "rdp" else ""
        raise SettingError(
            f"{OWNER}.target_epsilon={target:g} is not above {floor:.3g}, the smallest ε "
            f"{OWNER}.accountant='{mechanism}' certifies at δ={delta:.3g} however large σ is: raise "
            f"target_epsilon or {OWNER}.target_delta{other}"
        )
    if mechanism == "prv":
        _check_prv_target(target, sample_rate=sample_rate, steps=steps, delta=delta)


def _check_prv_target(target: float, *, sample_rate: float, steps: int, delta: float) -> None:
    """Refuse a PRV target whose grid is over the limit by arithmetic: at the calibrated σ, L ≥ ε − 0.1 + 3."""
    mesh, limit = prv_mesh(steps, delta), prv_grid_limit(delta)
    grid = grid_points(target + 2.9, mesh)
    if grid <= limit:
        return
    plan = plan_text(sample_rate, steps, delta)
    if grid <= limits.PRV_MAX_GRID:
        raise SettingError(_prv_delta_too_small(delta, grid, plan))
    raise SettingError(_prv_out_of_reach(target, plan, grid=grid, largest=limit * mesh / 2 - 2.9))


def _prv_out_of_reach(target: float, plan: str, *, grid: float, largest: float) -> str:
    bound = f", i.e. target_epsilon ≤ {floor_sig(largest)} here" if largest > 0 else ""
    return (
        f"{OWNER}.target_epsilon={target:g} needs {OWNER}.accountant='prv' to build a grid of at least "
        f"{grid:.3g} points {plan} (limit {limits.PRV_MAX_GRID:.3g}{bound}): lower target_epsilon, plan fewer steps "
        "(trainer.max_epochs / trainer.max_steps), or use accountant='rdp'"
    )


def _grid_problem(grid: float, limit: float) -> str:
    if math.isinf(grid):
        return f"its grid would span ε past {PRV_MAX_HALF_WIDTH:g}, where opacus' exp() overflows"
    return f"its grid would need {grid:.3g} points (limit {limit:.3g})"


def _prv_delta_too_small(delta: float, grid: float, plan: str) -> str:
    smallest = grid * float(np.finfo(np.longdouble).eps) / (1 - PRV_DELTA_ERROR)
    return (
        f"{OWNER}.target_delta={delta:.3g} is too small for {OWNER}.accountant='prv' {plan}: rounding on its "
        f"{grid:.3g}-point grid swamps any δ below ≈ {smallest:.2g} (opacus: 'Floating point errors will "
        "dominate'); raise target_delta, or use accountant='rdp'"
    )


def epsilon_floor(mechanism: Mechanism, delta: float) -> float:
    """The ε the accountant reports as σ → ∞ (RDP: its α-grid's conversion term; PRV: its ε error)."""
    if mechanism == "prv":
        return PRV_EPS_ERROR
    conversion = -(math.log(delta) + np.log(ALPHAS)) / (ALPHAS - 1) + np.log((ALPHAS - 1) / ALPHAS)
    return float(conversion.min())


def prv_min_noise_multiplier(sample_rate: float, steps: int, delta: float) -> float | None:
    """The smallest σ (to 1 %, rounded up) whose PRV grid is within the limit; ``None`` if none up to σ_max."""
    limit = prv_grid_limit(delta)

    def fits(sigma: float) -> bool:
        return prv_grid([(sigma, sample_rate, steps)], delta) <= limit

    lo, hi = SIGMA_FLOOR, NOISE_MULTIPLIER_MAX
    if not fits(hi):
        return None
    if fits(lo):
        return lo
    while hi / lo > 1.01:
        middle = math.sqrt(lo * hi)
        lo, hi = (lo, middle) if fits(middle) else (middle, hi)
    return hi
