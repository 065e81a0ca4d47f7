"""The one check behind every "a finite number in a range" a setting needs: a real number, not a bool, not nan or ±inf.

A leaf module (it imports nothing from dplit), so that settings, accounting, tasks and commands can all use it.
:func:`is_finite_number` answers for callers that word their own refusal; :func:`require_finite_number` refuses
in the house's one line, naming the flag: ``model.lr=nan: must be a finite number > 0``.
"""

from __future__ import annotations

import math
from numbers import Real


def is_finite_number(
    value: object,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
) -> bool:
    """Whether ``value`` is a finite real number (``bool`` is not one) within the bounds given.

    Args:
        value: anything; ``int``, ``float`` and the other :class:`numbers.Real` (numpy scalars) can pass.
        minimum: ``value ≥ minimum`` is required (when given).
        above: ``value > above`` is required.
        maximum: ``value ≤ maximum`` is required.
        below: ``value < below`` is required.
    """
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return (
        (minimum is None or value >= minimum)
        and (above is None or value > above)
        and (maximum is None or value <= maximum)
        and (below is None or value < below)
    )


def range_text(
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
) -> str:
    """The bounds as a refusal words them: ``> 0``, ``≥ 0``, ``≤ 1``, ``in (0, 1]``, ``in [0, 1)`` (empty: none)."""
    if minimum is not None and above is not None:
        raise ValueError("give at most one lower bound (minimum or above)")
    if maximum is not None and below is not None:
        raise ValueError("give at most one upper bound (maximum or below)")
    low = f"[{minimum:g}" if minimum is not None else f"({above:g}" if above is not None else None
    high = f"{maximum:g}]" if maximum is not None else f"{below:g})" if below is not None else None
    if low is not None and high is not None:
        return f"in {low}, {high}"
    if low is not None:
        return f"≥ {minimum:g}" if minimum is not None else f"> {above:g}"
    if high is not None:
        return f"≤ {maximum:g}" if maximum is not None else f"< {below:g}"
    return ""


def require_finite_number(
    value: object,
    *,
    name: str,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
) -> float:
    """``value`` as a ``float``, or a one-line ``ValueError`` naming the flag: ``{name}={value!r}: must be ...``.

    Args:
        value: the setting's value.
        name: the flag as the user writes it (``model.lr``, ``--temperature``).
        minimum: the smallest value allowed.
        above: the bound ``value`` must exceed.
        maximum: the largest value allowed.
        below: the bound ``value`` must stay under.

    Raises:
        ValueError: ``model.lr=nan: must be a finite number > 0`` for a value that is not a finite real number
            (a ``bool`` is not one) within the bounds.
    """
    bounds = range_text(minimum=minimum, above=above, maximum=maximum, below=below)
    if not is_finite_number(value, minimum=minimum, above=above, maximum=maximum, below=below):
        raise ValueError(f"{name}={value!r}: must be a finite number{f' {bounds}' if bounds else ''}")
    return float(value)  # type: ignore[arg-type]
