r"""Privacy accounting for Poisson-sampled DP-SGD: ε so far, σ calibration, checkpointable state.

opacus' accountants have a limited working range, and outside it they hang, allocate petabytes or raise errors
that mean nothing to a user. :func:`check_accountable` refuses such inputs before training, in one line naming
the flag and the range that works; :func:`calibrate_noise_multiplier` searches σ only where the accountant works;
and :meth:`PrivacyAccountant.epsilon` turns opacus' own errors into one-line ``ValueError``\ s. The limits below
were measured with opacus 1.6.0 on a 2-core machine:

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

import functools
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import (
    Domain,
    PoissonSubsampledGaussianPRV,
    TruncatedPrivacyRandomVariable,
    compose_heterogeneous,
    discretize,
)

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

_PRV_EPS_ERROR = 0.01  # opacus' PRVAccountant.get_epsilon defaults: eps_error = 0.01, delta_error = δ / 1000
_PRV_DELTA_ERROR = 1e-3  # as a fraction of δ; opacus divides δ by 1000 (see _prv_delta_error)
_PRV_MAX_HALF_WIDTH = 700.0  # the PRV grid spans [-L, L] and opacus takes exp(±t) on it
_SIGMA_FLOOR = 1e-3  # the smallest σ calibration tries
_SIGMA_LADDER = (10.0, 100.0, NOISE_MULTIPLIER_MAX)  # calibration's first tries; σ > 10 is rare (slow at q = 0.5)
_MAX_BISECTIONS = 60
_ALPHAS = np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)


def default_delta(dataset_size: int) -> float:
    """The field's default δ = N^-1.1 for a dataset of N examples."""
    if dataset_size < 1:
        raise ValueError(f"cannot choose δ for an empty dataset (size {dataset_size})")
    return float(dataset_size) ** -1.1


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
        mechanism: ``"prv"`` or ``"rdp"`` (``DPStrategy.accountant``).
        sample_rate: the Poisson rate q = batch_size / N.
        steps: the planned number of DP steps (``None``: unbounded; a fixed σ is then checked for one step).
        delta: δ (``DPStrategy.target_delta`` or its default).
        noise_multiplier: a fixed σ, if given (0 is accepted: no noise, ε = ∞).
        target_epsilon: the ε that σ will be calibrated to, if given.

    Raises:
        ValueError: in one line naming the ``DPStrategy`` flag and the range that works.
    """
    _check_basics(mechanism, sample_rate, delta)
    if mechanism == "prv" and delta < PRV_MIN_DELTA:
        raise ValueError(
            f"DPStrategy.target_delta={delta:.3g} is below {PRV_MIN_DELTA:g}, where opacus' PRV accountant is swamped "
            "by float64 rounding: raise target_delta, or use DPStrategy.accountant='rdp'"
        )
    planned = 1 if steps is None else max(1, int(steps))
    if noise_multiplier is not None:
        _check_noise_multiplier(
            noise_multiplier, mechanism=mechanism, sample_rate=sample_rate, steps=planned, delta=delta
        )
    if target_epsilon is not None:
        if steps is None:
            raise ValueError(
                "DPStrategy.target_epsilon needs a finite number of planned steps: set trainer.max_epochs or "
                "trainer.max_steps, or give DPStrategy.noise_multiplier instead"
            )
        _check_target_epsilon(target_epsilon, mechanism=mechanism, sample_rate=sample_rate, steps=planned, delta=delta)


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
    if not (math.isfinite(epsilon_tolerance) and epsilon_tolerance > 0):
        raise ValueError(f"epsilon_tolerance must be a finite number > 0, got {epsilon_tolerance}")
    steps = max(1, int(steps))
    check_accountable(
        mechanism=mechanism, sample_rate=sample_rate, steps=steps, delta=delta, target_epsilon=target_epsilon
    )
    plan = _plan(sample_rate, steps, delta)
    before = list(prior or [])

    def fits(sigma: float) -> bool:
        return mechanism == "rdp" or _prv_grid([*before, (sigma, sample_rate, steps)], delta) <= _prv_grid_limit(delta)

    def spent(sigma: float) -> float:  # unaccountable σ lie below those PRV handles: "they spend too much"
        return _accounted_epsilon(mechanism, [*before, (sigma, sample_rate, steps)], delta) if fits(sigma) else math.inf

    sigma, epsilon = _search(spent, target=target_epsilon, tol=epsilon_tolerance, plan=plan)
    if target_epsilon - epsilon > epsilon_tolerance and not fits(sigma / 1.01):
        lower = f"lower target_epsilon to ≤ {_floor_sig(epsilon)}, " if epsilon > _PRV_EPS_ERROR else ""
        raise ValueError(
            f"DPStrategy.target_epsilon={target_epsilon:g} is beyond DPStrategy.accountant='prv' {plan}: the "
            f"smallest σ its grid handles (≈ {sigma:.3g}) already spends only ε={epsilon:.3g}; {lower}use "
            f"accountant='rdp', give DPStrategy.noise_multiplier={_ceil_sig(sigma)} instead, or plan fewer steps"
        )
    return sigma


class PrivacyAccountant:
    """The privacy ledger of one training run: every (σ, q) step taken, and the ε it has spent.

    Args:
        delta: the δ at which ε is reported.
        mechanism: opacus accountant, ``"prv"`` (tight, default) or ``"rdp"``.
    """

    def __init__(self, *, delta: float, mechanism: Mechanism = "prv") -> None:
        if mechanism not in ("prv", "rdp"):
            raise ValueError(f"accountant must be 'prv' or 'rdp', got {mechanism!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self._delta = float(delta)
        self._mechanism = mechanism
        self._history: History = []

    @property
    def delta(self) -> float:
        """The δ at which ε is reported."""
        return self._delta

    @property
    def steps(self) -> int:
        """Number of DP steps taken so far."""
        return sum(count for _, _, count in self._history)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one DP step with noise σ and Poisson rate q."""
        last = self._history[-1] if self._history else None
        if last is not None and last[0] == noise_multiplier and last[1] == sample_rate:
            self._history[-1] = (last[0], last[1], last[2] + 1)
        else:
            self._history.append((float(noise_multiplier), float(sample_rate), 1))

    def epsilon(self, *, extra_steps: int = 0, noise_multiplier: float = 0.0, sample_rate: float = 0.0) -> float:
        """ε spent so far, or what it would be after ``extra_steps`` more steps at (σ, q).

        Raises:
            ValueError: in one line naming the flags, where the accountant cannot compute ε (a PRV grid over its
                limit, or an error from opacus).
        """
        history = list(self._history)
        if extra_steps:
            history.append((float(noise_multiplier), float(sample_rate), extra_steps))
        if not history:
            return 0.0
        if any(sigma <= 0 for sigma, _, _ in history):
            return float("inf")
        return _accounted_epsilon(self._mechanism, history, self._delta)

    def state_dict(self) -> dict[str, Any]:
        """The ledger, for checkpoints."""
        return {"delta": self._delta, "mechanism": self._mechanism, "history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ledger (δ and mechanism must match this run's)."""
        if state["mechanism"] != self._mechanism or abs(state["delta"] - self._delta) > 1e-15:
            raise ValueError(
                f"checkpoint ledger was kept with accountant={state['mechanism']}, δ={state['delta']}; "
                f"this run asks for accountant={self._mechanism}, δ={self._delta}: keep them equal on resume"
            )
        self._history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]


# --- checks -----------------------------------------------------------------------------------------------------


def _check_basics(mechanism: str, sample_rate: float, delta: float) -> None:
    if mechanism not in ("prv", "rdp"):
        raise ValueError(f"DPStrategy.accountant must be 'prv' or 'rdp', got {mechanism!r}")
    if not (math.isfinite(sample_rate) and 0 < sample_rate <= 1):
        raise ValueError(f"the Poisson sample rate q = data.batch_size / N must be in (0, 1], got {sample_rate}")
    if not (math.isfinite(delta) and 0 < delta <= DELTA_MAX):
        raise ValueError(
            f"DPStrategy.target_delta={delta:.3g} must be in (0, {DELTA_MAX:g}]: a larger δ is no guarantee "
            "(publishing a random 10% of the examples meets δ = 0.1) and there opacus reports negative ε or fails "
            "('Cannot compute epsilon')"
        )


def _refuse_prv_grid(history: History, delta: float) -> None:
    """Refuse a ledger whose PRV grid is over the limit (opacus would take minutes, or allocate petabytes)."""
    grid, limit = _prv_grid(history, delta), _prv_grid_limit(delta)
    if grid <= limit:
        return
    if grid <= PRV_MAX_GRID:
        raise ValueError(_prv_delta_too_small(delta, grid, f"for {_describe(history)}"))
    raise ValueError(
        f"DPStrategy.accountant='prv' cannot compute ε for {_describe(history)} at δ={delta:.3g}: "
        f"{_grid_problem(grid, limit)}; use accountant='rdp', a larger DPStrategy.noise_multiplier, or fewer steps"
    )


def _check_noise_multiplier(
    sigma: float, *, mechanism: Mechanism, sample_rate: float, steps: int, delta: float
) -> None:
    if not (math.isfinite(sigma) and 0 <= sigma <= NOISE_MULTIPLIER_MAX):
        raise ValueError(
            f"DPStrategy.noise_multiplier={sigma:g} must be 0 (no privacy) or in (0, {NOISE_MULTIPLIER_MAX:g}]: "
            "above it opacus' accountants take seconds per ε (at q = 0.5) and add nothing"
        )
    if sigma == 0 or mechanism != "prv":
        return
    grid, limit = _prv_grid([(sigma, sample_rate, steps)], delta), _prv_grid_limit(delta)
    if grid <= limit:
        return
    plan = _plan(sample_rate, steps, delta)
    if grid <= PRV_MAX_GRID:  # the δ-dependent part of the limit binds
        raise ValueError(_prv_delta_too_small(delta, grid, plan))
    smallest = _prv_min_noise_multiplier(sample_rate, steps, delta)
    fix = f"use noise_multiplier ≥ {_ceil_sig(smallest)}, or " if smallest is not None else "use "
    raise ValueError(
        f"DPStrategy.noise_multiplier={sigma:g} is too small for DPStrategy.accountant='prv' {plan}: "
        f"{_grid_problem(grid, limit)}; {fix}accountant='rdp', or plan fewer steps"
    )


def _check_target_epsilon(target: float, *, mechanism: Mechanism, sample_rate: float, steps: int, delta: float) -> None:
    if not (math.isfinite(target) and 0 < target <= EPSILON_MAX):
        raise ValueError(
            f"DPStrategy.target_epsilon={target:g} must be in (0, {EPSILON_MAX:g}]: a larger ε bounds the "
            f"likelihood ratio by more than e^{EPSILON_MAX:g}, which is no guarantee, and calibration chases σ → 0"
        )
    floor = _epsilon_floor(mechanism, delta)
    if target <= floor:
        other = " or use DPStrategy.accountant='prv'" if mechanism == "rdp" else ""
        raise ValueError(
            f"DPStrategy.target_epsilon={target:g} is not above {floor:.3g}, the smallest ε "
            f"DPStrategy.accountant='{mechanism}' certifies at δ={delta:.3g} however large σ is: raise "
            f"target_epsilon or DPStrategy.target_delta{other}"
        )
    if mechanism == "prv":
        _check_prv_target(target, sample_rate=sample_rate, steps=steps, delta=delta)


def _check_prv_target(target: float, *, sample_rate: float, steps: int, delta: float) -> None:
    """Refuse a PRV target whose grid is over the limit by arithmetic: at the calibrated σ, L ≥ ε − 0.1 + 3."""
    mesh, limit = _prv_mesh(steps, delta), _prv_grid_limit(delta)
    grid = _grid_points(target + 2.9, mesh)
    if grid <= limit:
        return
    plan = _plan(sample_rate, steps, delta)
    if grid <= PRV_MAX_GRID:
        raise ValueError(_prv_delta_too_small(delta, grid, plan))
    raise ValueError(_prv_out_of_reach(target, plan, grid=grid, largest=limit * mesh / 2 - 2.9))


def _prv_out_of_reach(target: float, plan: str, *, grid: float, largest: float) -> str:
    bound = f", i.e. target_epsilon ≤ {_floor_sig(largest)} here" if largest > 0 else ""
    return (
        f"DPStrategy.target_epsilon={target:g} needs DPStrategy.accountant='prv' to build a grid of at least "
        f"{grid:.3g} points {plan} (limit {PRV_MAX_GRID:.3g}{bound}): lower target_epsilon, plan fewer steps "
        "(trainer.max_epochs / trainer.max_steps), or use accountant='rdp'"
    )


def _grid_problem(grid: float, limit: float) -> str:
    if math.isinf(grid):
        return f"its grid would span ε past {_PRV_MAX_HALF_WIDTH:g}, where opacus' exp() overflows"
    return f"its grid would need {grid:.3g} points (limit {limit:.3g})"


def _prv_delta_too_small(delta: float, grid: float, plan: str) -> str:
    smallest = grid * float(np.finfo(np.longdouble).eps) / (1 - _PRV_DELTA_ERROR)
    return (
        f"DPStrategy.target_delta={delta:.3g} is too small for DPStrategy.accountant='prv' {plan}: rounding on its "
        f"{grid:.3g}-point grid swamps any δ below ≈ {smallest:.2g} (opacus: 'Floating point errors will "
        "dominate'); raise target_delta, or use accountant='rdp'"
    )


def _epsilon_floor(mechanism: Mechanism, delta: float) -> float:
    """The ε the accountant reports as σ → ∞ (RDP: its α-grid's conversion term; PRV: its ε error)."""
    if mechanism == "prv":
        return _PRV_EPS_ERROR
    conversion = -(math.log(delta) + np.log(_ALPHAS)) / (_ALPHAS - 1) + np.log((_ALPHAS - 1) / _ALPHAS)
    return float(conversion.min())


# --- calibration ------------------------------------------------------------------------------------------------


def _search(spent: Callable[[float], float], *, target: float, tol: float, plan: str) -> tuple[float, float]:
    """(σ, ε): try σ = 10, 100, 1000 in turn and search below the first that reaches the target."""
    lower: tuple[float, float | None] = (_SIGMA_FLOOR, None)
    for sigma in _SIGMA_LADDER:
        epsilon = spent(sigma)
        if epsilon <= target:
            return _root(spent, target=target, tol=tol, low=lower, high=(sigma, epsilon))
        lower = (sigma, epsilon)
    if math.isinf(lower[1] or 0.0):
        raise ValueError(
            f"DPStrategy.accountant='prv' cannot account {plan} at any DPStrategy.noise_multiplier up to "
            f"{NOISE_MULTIPLIER_MAX:g} (its grid would be over {PRV_MAX_GRID:.3g} points): plan fewer steps "
            "(trainer.max_epochs / trainer.max_steps), or use accountant='rdp'"
        )
    raise ValueError(
        f"DPStrategy.target_epsilon={target:g} cannot be reached {plan}: even "
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


# --- opacus -----------------------------------------------------------------------------------------------------


def _accounted_epsilon(mechanism: Mechanism, history: History, delta: float) -> float:
    """Opacus' ε for ``history`` at δ (refusing a PRV grid over its limit), its errors as one-line ValueErrors."""
    if mechanism == "prv":
        _refuse_prv_grid(history, delta)
    try:
        with _quiet():
            return _rdp_epsilon(history, delta) if mechanism == "rdp" else _prv_epsilon(history, delta)
    except (ValueError, RuntimeError, MemoryError, OverflowError) as error:
        raise ValueError(_translate(error, mechanism, history, delta)) from error


def _rdp_epsilon(history: History, delta: float) -> float:
    """Opacus' ``RDPAccountant.get_epsilon(δ)``, in the same arithmetic, from cached RDP curves."""
    rdp = sum(np.asarray(_rdp_curve(q, sigma)) * count for sigma, q, count in history)
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(_ALPHAS), rdp=rdp, delta=delta)
    return float(epsilon)


def _prv_epsilon(history: History, delta: float) -> float:
    """Opacus' ``PRVAccountant.get_epsilon(δ)`` step for step, its domain from cached RDP curves.

    opacus recomputes two RDP curves per call: seconds at q = 0.5 and large σ.
    """
    half_width = _prv_half_width(history, delta)
    domain = Domain.create_aligned(-half_width, half_width, _prv_mesh(_total(history), delta))
    dprvs = [
        discretize(
            TruncatedPrivacyRandomVariable(PoissonSubsampledGaussianPRV(q, sigma), domain.t_min, domain.t_max), domain
        )
        for sigma, q, _ in history
    ]
    composed = compose_heterogeneous(dprvs=dprvs, num_self_compositions=[count for _, _, count in history])
    _, _, upper = composed.compute_epsilon(delta, _prv_delta_error(delta), _PRV_EPS_ERROR)
    return float(upper)


def _translate(error: BaseException, mechanism: Mechanism, history: History, delta: float) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if "Cannot compute epsilon" in text:
        advice = f"use DPStrategy.target_delta ≤ {DELTA_MAX:g} (the default N^-1.1 is safe)"
    elif "Floating point errors" in text:
        advice = "raise DPStrategy.target_delta, or use DPStrategy.accountant='rdp'"
    elif mechanism == "prv":
        advice = "use DPStrategy.accountant='rdp', or change DPStrategy.noise_multiplier or the sample rate"
    else:
        advice = "change DPStrategy.noise_multiplier or the sample rate q = data.batch_size / N"
    return (
        f"DPStrategy.accountant='{mechanism}' cannot compute ε for {_describe(history)} at "
        f"δ={delta:.3g} (opacus: {text}): {advice}"
    )


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence opacus' per-call noise.

    RDP's "Optimal order is the smallest/largest alpha" (ε is still a valid bound: ε huge, or ε near the floor) and
    numpy's warnings inside opacus (e.g. log(1 - q) at q = 1).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"opacus\.")
        yield


@functools.lru_cache(maxsize=256)
def _rdp_curve(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    """One step's RDP at opacus' default orders (cached: PRV's grid and RDP's ε both start from it)."""
    with _quiet():
        return tuple(
            rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(_ALPHAS))
        )


# --- PRV grid ---------------------------------------------------------------------------------------------------


def _prv_grid(history: History, delta: float) -> float:
    """The number of points opacus' PRVAccountant.get_epsilon(δ) discretises ``history`` on.

    ∞ where the grid's half-width L passes 700: e^L overflows past 709.8, and opacus returns ε = ∞, a saturated
    ε ≈ 700 or "Discrete mean differs significantly from continuous mean" (measured: exact up to L ≈ 770).
    """
    half_width = _prv_half_width(history, delta)
    if not half_width <= _PRV_MAX_HALF_WIDTH:  # NaN too
        return math.inf
    return _grid_points(half_width, _prv_mesh(_total(history), delta))


def _prv_half_width(history: History, delta: float) -> float:
    """Opacus' ``compute_safe_domain_size`` (L), in the same arithmetic, from cached RDP curves."""
    delta_error, total = _prv_delta_error(delta), _total(history)
    curves = [(np.asarray(_rdp_curve(q, sigma)), count) for sigma, q, count in history]
    with _quiet():
        composed = sum(curve * count for curve, count in curves)
        half_width, _ = rdp_analysis.get_privacy_spent(orders=list(_ALPHAS), rdp=composed, delta=delta_error / 4)
        for curve, _ in curves:
            single, _ = rdp_analysis.get_privacy_spent(orders=list(_ALPHAS), rdp=curve, delta=delta_error / (8 * total))
            half_width = max(half_width, single)
    return max(float(half_width), _PRV_EPS_ERROR) + 3


def _prv_delta_error(delta: float) -> float:
    return delta / 1000


def _prv_mesh(steps: int, delta: float) -> float:
    """Opacus' mesh: ``eps_error / sqrt(steps · ln(12 / δ_error) / 2)`` (numpy, as opacus computes it)."""
    return float(_PRV_EPS_ERROR / np.sqrt(steps * np.log(12 / _prv_delta_error(delta)) / 2))


def _total(history: History) -> int:
    return sum(count for _, _, count in history)


def _grid_points(half_width: float, mesh: float) -> float:
    """The size of opacus' ``Domain.create_aligned(-L, L, mesh)``, without building it."""
    if half_width / mesh > 1e15:
        return 2 * half_width / mesh
    t_min, t_max = math.floor(-half_width / mesh) * mesh, math.ceil(half_width / mesh) * mesh
    size = int(np.round((t_max - t_min) / mesh)) + 1
    return float(size + size % 2)


def _prv_grid_limit(delta: float) -> float:
    """:data:`PRV_MAX_GRID`, or fewer points where opacus would refuse the grid as swamped by rounding at δ."""
    return min(PRV_MAX_GRID, (delta - _prv_delta_error(delta)) / float(np.finfo(np.longdouble).eps))


def _prv_min_noise_multiplier(sample_rate: float, steps: int, delta: float) -> float | None:
    """The smallest σ (to 1 %, rounded up) whose PRV grid is within the limit; ``None`` if none up to σ_max."""
    limit = _prv_grid_limit(delta)

    def fits(sigma: float) -> bool:
        return _prv_grid([(sigma, sample_rate, steps)], delta) <= limit

    lo, hi = _SIGMA_FLOOR, NOISE_MULTIPLIER_MAX
    if not fits(hi):
        return None
    if fits(lo):
        return lo
    while hi / lo > 1.01:
        middle = math.sqrt(lo * hi)
        lo, hi = (lo, middle) if fits(middle) else (middle, hi)
    return hi


# --- formatting -------------------------------------------------------------------------------------------------


def _plan(sample_rate: float, steps: int, delta: float) -> str:
    return f"over {steps} steps at q={sample_rate:.3g} with δ={delta:.3g}"


def _describe(history: History) -> str:
    steps = sum(count for _, _, count in history)
    if len(history) == 1:
        sigma, q, _ = history[0]
        return f"{steps} steps at σ={sigma:.3g}, q={q:.3g}"
    sigmas, rates = [s for s, _, _ in history], [q for _, q, _ in history]
    return f"{steps} steps at σ in [{min(sigmas):.3g}, {max(sigmas):.3g}], q in [{min(rates):.3g}, {max(rates):.3g}]"


def _ceil_sig(value: float, digits: int = 3) -> str:
    """``value`` rounded up to ``digits`` significant digits (a bound the user may type in and meet)."""
    if not (math.isfinite(value) and value > 0):
        return f"{value:.{digits}g}"
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.ceil(value / scale) * scale:.{digits}g}"


def _floor_sig(value: float, digits: int = 3) -> str:
    """``value`` rounded down to ``digits`` significant digits."""
    if not (math.isfinite(value) and value > 0):
        return f"{value:.{digits}g}"
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.floor(value / scale) * scale:.{digits}g}"
