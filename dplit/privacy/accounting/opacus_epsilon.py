"""Opacus' RDP and PRV ε, and the size of PRV's grid, in opacus' own arithmetic from cached RDP curves.

Computing the grid's size first (arithmetic and one cached RDP curve) is what lets dplit refuse a plan before opacus
would hang or allocate petabytes (see :mod:`dplit.privacy.accounting.limits`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

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

import dplit.privacy.accounting.limits as limits
from dplit.privacy.accounting.limits import PRV_EPS_ERROR, PRV_MAX_HALF_WIDTH, History

ALPHAS = np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
"""Opacus' default Rényi orders."""


def rdp_epsilon(history: History, delta: float) -> float:
    """Opacus' ``RDPAccountant.get_epsilon(δ)``, in the same arithmetic, from cached RDP curves."""
    rdp = sum(np.asarray(rdp_curve(q, sigma)) * count for sigma, q, count in history)
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(ALPHAS), rdp=rdp, delta=delta)
    return float(epsilon)


def prv_epsilon(history: History, delta: float) -> float:
    """Opacus' ``PRVAccountant.get_epsilon(δ)`` step for step, its domain from cached RDP curves.

    opacus recomputes two RDP curves per call: seconds at q = 0.5 and large σ.
    """
    half_width = prv_half_width(history, delta)
    domain = Domain.create_aligned(-half_width, half_width, prv_mesh(total_steps(history), delta))
    dprvs = [
        discretize(
            TruncatedPrivacyRandomVariable(PoissonSubsampledGaussianPRV(q, sigma), domain.t_min, domain.t_max), domain
        )
        for sigma, q, _ in history
    ]
    composed = compose_heterogeneous(dprvs=dprvs, num_self_compositions=[count for _, _, count in history])
    _, _, upper = composed.compute_epsilon(delta, prv_delta_error(delta), PRV_EPS_ERROR)
    return float(upper)


@contextmanager
def quiet() -> Iterator[None]:
    """Silence opacus' per-call noise.

    RDP's "Optimal order is the smallest/largest alpha" (ε is still a valid bound: ε huge, or ε near the floor) and
    numpy's warnings inside opacus (e.g. log(1 - q) at q = 1).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"opacus\.")
        yield


@functools.lru_cache(maxsize=256)
def rdp_curve(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    """One step's RDP at opacus' default orders (cached: PRV's grid and RDP's ε both start from it)."""
    with quiet():
        return tuple(
            rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(ALPHAS))
        )


def prv_grid(history: History, delta: float) -> float:
    """The number of points opacus' PRVAccountant.get_epsilon(δ) discretises ``history`` on.

    ∞ where the grid's half-width L passes 700: e^L overflows past 709.8, and opacus returns ε = ∞, a saturated
    ε ≈ 700 or "Discrete mean differs significantly from continuous mean" (measured: exact up to L ≈ 770).
    """
    half_width = prv_half_width(history, delta)
    if not half_width <= PRV_MAX_HALF_WIDTH:  # NaN too
        return math.inf
    return grid_points(half_width, prv_mesh(total_steps(history), delta))


def prv_half_width(history: History, delta: float) -> float:
    """Opacus' ``compute_safe_domain_size`` (L), in the same arithmetic, from cached RDP curves."""
    delta_error, total = prv_delta_error(delta), total_steps(history)
    curves = [(np.asarray(rdp_curve(q, sigma)), count) for sigma, q, count in history]
    with quiet():
        composed = sum(curve * count for curve, count in curves)
        half_width, _ = rdp_analysis.get_privacy_spent(orders=list(ALPHAS), rdp=composed, delta=delta_error / 4)
        for curve, _ in curves:
            single, _ = rdp_analysis.get_privacy_spent(orders=list(ALPHAS), rdp=curve, delta=delta_error / (8 * total))
            half_width = max(half_width, single)
    return max(float(half_width), PRV_EPS_ERROR) + 3


def prv_delta_error(delta: float) -> float:
    """The δ error opacus allows: δ / 1000."""
    return delta / 1000


def prv_mesh(steps: int, delta: float) -> float:
    """Opacus' mesh: ``eps_error / sqrt(steps · ln(12 / δ_error) / 2)`` (numpy, as opacus computes it)."""
    return float(PRV_EPS_ERROR / np.sqrt(steps * np.log(12 / prv_delta_error(delta)) / 2))


def total_steps(history: History) -> int:
    """The steps in ``history``."""
    return sum(count for _, _, count in history)


def grid_points(half_width: float, mesh: float) -> float:
    """The size of opacus' ``Domain.create_aligned(-L, L, mesh)``, without building it."""
    if half_width / mesh > 1e15:
        return 2 * half_width / mesh
    t_min, t_max = math.floor(-half_width / mesh) * mesh, math.ceil(half_width / mesh) * mesh
    size = int(np.round((t_max - t_min) / mesh)) + 1
    return float(size + size % 2)


def prv_grid_limit(delta: float) -> float:
    """:data:`~dplit.privacy.accounting.limits.PRV_MAX_GRID`, or fewer points where opacus would refuse the grid.

    (It refuses a grid as swamped by rounding at δ.)
    """
    return min(limits.PRV_MAX_GRID, (delta - prv_delta_error(delta)) / float(np.finfo(np.longdouble).eps))
