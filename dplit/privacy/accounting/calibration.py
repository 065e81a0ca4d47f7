"""Calibration: the smallest σ whose ε over the plan (on top of the weights' history) is at most the target."""

from __future__ import annotations

import math
from collections.abc import Callable

import dplit.privacy.accounting.limits as limits
from dplit.numbers import is_finite_number
from dplit.privacy.accounting.accountant import accounted_epsilon
from dplit.privacy.accounting.checks import check_accountable
from dplit.privacy.accounting.limits import (
    NOISE_MULTIPLIER_MAX,
    PRV_EPS_ERROR,
    SIGMA_FLOOR,
    History,
    Mechanism,
    ceil_sig,
    floor_sig,
    plan_text,
)
from dplit.privacy.accounting.opacus_epsilon import prv_grid, prv_grid_limit
from dplit.privacy.refusal import OWNER, SettingError

_SIGMA_LADDER = (10.0, 100.0, NOISE_MULTIPLIER_MAX)  # calibration's first tries; σ > 10 is rare (slow at q = 0.5)
_MAX_BISECTIONS = 60


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    mechanism: Mechanism = "prv",
    epsilon_tolerance: float = 0.01,
    prior: History | None = None,
) -> float:
    """The smallest σ whose ε after ``steps`` Poisson steps at rate q is ≤ target (and ≥ target − tolerance).

    ``prior`` holds the (σ, q, steps) the weights already took (their privacy history): ε then counts them too,
    so the target bounds the weights' total.

    A root search of σ over [10^-3, :data:`NOISE_MULTIPLIER_MAX`] that only runs the accountant where it works
    (a PRV grid within its limit, checked from one cached RDP curve first), at most 63 times (in practice 5-8),
    so it cannot hang or exhaust memory.

    Raises:
        ValueError: in one line naming the flags, if the inputs fail :func:`check_accountable`, if no σ up to
            :data:`NOISE_MULTIPLIER_MAX` reaches the target, or if the target needs a σ smaller than PRV can handle.
    """
    if not is_finite_number(epsilon_tolerance, above=0):
        raise SettingError(f"epsilon_tolerance must be a finite number > 0, got {epsilon_tolerance}")
    steps = max(1, int(steps))
    check_accountable(
        mechanism=mechanism, sample_rate=sample_rate, steps=steps, delta=delta, target_epsilon=target_epsilon
    )
    plan = plan_text(sample_rate, steps, delta)
    before = list(prior or [])

    def fits(sigma: float) -> bool:
        return mechanism == "rdp" or prv_grid([*before, (sigma, sample_rate, steps)], delta) <= prv_grid_limit(delta)

    def spent(sigma: float) -> float:  # unaccountable σ lie below those PRV handles: "they spend too much"
        return accounted_epsilon(mechanism, [*before, (sigma, sample_rate, steps)], delta) if fits(sigma) else math.inf

    sigma, epsilon = search_noise_multiplier(spent, target=target_epsilon, tol=epsilon_tolerance, plan=plan)
    if target_epsilon - epsilon > epsilon_tolerance and not fits(sigma / 1.01):
        lower = f"lower target_epsilon to ≤ {floor_sig(epsilon)}, " if epsilon > PRV_EPS_ERROR else ""
        raise SettingError(
            f"{OWNER}.target_epsilon={target_epsilon:g} is beyond {OWNER}.accountant='prv' {plan}: the "
            f"smallest σ its grid handles (≈ {sigma:.3g}) already spends only ε={epsilon:.3g}; {lower}use "
            f"accountant='rdp', give {OWNER}.noise_multiplier={ceil_sig(sigma)} instead, or plan fewer steps"
        )
    return sigma


def search_noise_multiplier(
    spent: Callable[[float], float], *, target: float, tol: float, plan: str
) -> tuple[float, float]:
    """(σ, ε): try σ = 10, 100, 1000 in turn and search below the first that reaches the target."""
    lower: tuple[float, float | None] = (SIGMA_FLOOR, None)
    for sigma in _SIGMA_LADDER:
        epsilon = spent(sigma)
        if epsilon <= target:
            return _root(spent, target=target, tol=tol, low=lower, high=(sigma, epsilon))
        lower = (sigma, epsilon)
    if math.isinf(lower[1] or 0.0):
        raise SettingError(
            f"{OWNER}.accountant='prv' cannot account {plan} at any {OWNER}.noise_multiplier up to "
            f"{NOISE_MULTIPLIER_MAX:g} (its grid would be over {limits.PRV_MAX_GRID:.3g} points): plan fewer steps "
            "(trainer.max_epochs / trainer.max_steps), or use accountant='rdp'"
        )
    raise SettingError(
        f"{OWNER}.target_epsilon={target:g} cannot be reached {plan}: even "
        f"noise_multiplier={NOISE_MULTIPLIER_MAX:g} spends ε={lower[1]:.3g}; raise target_epsilon, or lower "
        "trainer.max_epochs / trainer.max_steps / data.batch_size"
    )


def _root(
    spent: Callable[[float], float],
    *,
    target: float,
    tol: float,
    low: tuple[float, float | None],
    high: tuple[float, float],
) -> tuple[float, float]:
    """The smallest (σ, ε) found in [low, high] with ε ≤ target, stopping once ε ≥ target − tol (≤ 60 tries).

    ``high`` is a known (σ, ε ≤ target) and ``low`` a σ spending more than the target (ε ``None``: not evaluated;
    it then is, once, only when the bracket has shrunk to within 1 % of it; ε = ∞: unaccountable, and the search
    stops within 1 % of it). Illinois regula falsi on ln ε against ln σ (nearly linear) once both ends are
    known, geometric bisection before.
    """
    (lo, lo_eps), (hi, hi_eps) = low, high
    aim, kept = target - tol / 2, 0  # kept: +1 / -1 when the low / high end was kept last time (Illinois)
    lo_weight = hi_weight = 1.0
    for _ in range(_MAX_BISECTIONS):
        if target - hi_eps <= tol or hi / lo < 1 + 1e-9 or (lo_eps == math.inf and hi / lo < 1.01):
            break
        sigma = _next_sigma(lo, lo_eps, hi, hi_eps, aim=aim, weights=(lo_weight, hi_weight))
        epsilon = spent(sigma)
        if epsilon <= target:
            hi, hi_eps, side = sigma, epsilon, -1
        else:
            lo, lo_eps, side = sigma, epsilon, +1
        lo_weight = lo_weight / 2 if kept == side == -1 else 1.0  # the same end moved twice: halve the other's pull
        hi_weight = hi_weight / 2 if kept == side == +1 else 1.0
        kept = side
    return hi, hi_eps


def _next_sigma(
    lo: float, lo_eps: float | None, hi: float, hi_eps: float, *, aim: float, weights: tuple[float, float]
) -> float:
    """The next σ to try in (lo, hi): a regula falsi step in (ln σ, ln ε), kept 1 % inside, or a geometric midpoint."""
    if lo_eps is None:
        return lo if hi / lo < 1.01 else math.sqrt(lo * hi)
    if not (math.isfinite(lo_eps) and lo_eps > 0 and hi_eps > 0 and aim > 0):
        return math.sqrt(lo * hi)
    f_lo = (math.log(lo_eps) - math.log(aim)) * weights[0]
    f_hi = (math.log(hi_eps) - math.log(aim)) * weights[1]
    u_lo, u_hi = math.log(lo), math.log(hi)
    u = u_lo + (u_hi - u_lo) * f_lo / (f_lo - f_hi)
    margin = (u_hi - u_lo) / 100
    return math.exp(min(max(u, u_lo + margin), u_hi - margin))
