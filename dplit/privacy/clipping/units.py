"""Privacy units of several rows (users): one clipped gradient per unit, the sum of its rows' gradients.

A batch may say which unit each row belongs to (``batch[UNIT_KEY]``, [B] integers). A unit's gradient of one use,
G_u = Σ_{i∈u} Σ_t u_{i,t} v_{i,t}ᵀ, is the gradient of ONE example whose positions are all its rows' positions:
so each use is regrouped from rows to units (the rows' positions laid side by side, their materialised gradients
added) and the engines' per-example algebra, Gram terms between a unit's rows and the tied cross term included,
computes each unit's exact norm and clipped sum unchanged. Without ``UNIT_KEY`` every row is its own unit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dplit.privacy.clipping.norms.factors import DenseFactor, ExampleGradient, Factor, FactoredGradient, GradientUse
from dplit.privacy.clipping.token_units import TOKEN_UNIT_KEY, numbered_by_appearance, unit_labels

UNIT_KEY = "privacy_unit"
"""The batch key of the rows' privacy units: a [B] integer tensor, rows of one unit sharing a value."""


@dataclass(frozen=True)
class Units:
    """Which unit each row of a batch belongs to, and its place among that unit's rows.

    Attributes:
        unit: [B] each row's unit, numbered 0..count-1 in order of first appearance.
        slot: [B] each row's place among its unit's rows (0, 1, ...).
        count: the number of units U.
        most_rows: the most rows any unit has.
    """

    unit: Tensor
    slot: Tensor
    count: int
    most_rows: int


def units_of(batch: Mapping[str, Tensor]) -> Units | None:
    """The units of ``batch[UNIT_KEY]`` (``None`` without the key: every row is its own unit)."""
    labels = unit_labels(batch, UNIT_KEY, shape="[B]")
    if labels is None:
        return None
    unit, slot, counts = numbered_by_appearance(labels)
    return Units(unit=unit, slot=slot, count=int(counts.numel()), most_rows=int(counts.max()) if counts.numel() else 0)


def grouped_use(use: GradientUse, units: Units) -> GradientUse:
    """``use`` with one entry per unit instead of per row: positions side by side, materialised gradients added."""
    if isinstance(use, ExampleGradient):
        summed = use.values.new_zeros((units.count, *use.values.shape[1:]))  # [U, *shape]
        return ExampleGradient(summed.index_add_(0, units.unit, use.values))
    if not isinstance(use.left, DenseFactor) and not isinstance(use.right, DenseFactor):
        raise ValueError("a unit's rows are laid side by side only when one factor of a use is dense")
    return FactoredGradient(_grouped_factor(use.left, units), _grouped_factor(use.right, units))


def _grouped_factor(factor: Factor, units: Units) -> Factor:
    """[B, T, ...] → [U, k·T, ...] (k = the most rows of a unit); a short unit's missing rows are zeros.

    An index factor's missing rows hold index 0: the dense factor beside it is zero there, so they add nothing.
    """
    values = factor.values if isinstance(factor, DenseFactor) else factor.indices
    positions = values.shape[1]
    spread = values.new_zeros((units.count, units.most_rows, *values.shape[1:]))  # [U, k, T, ...]
    spread[units.unit, units.slot] = values
    laid = spread.reshape(units.count, units.most_rows * positions, *values.shape[2:])  # [U, k·T, ...]
    return DenseFactor(laid) if isinstance(factor, DenseFactor) else type(factor)(laid, factor.width)


def without_units(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The batch the model sees: every field but :data:`UNIT_KEY` and :data:`TOKEN_UNIT_KEY`."""
    return {key: value for key, value in batch.items() if key not in (UNIT_KEY, TOKEN_UNIT_KEY)}


def unit_sums(values: Tensor, units: Units) -> Tensor:
    """Per-row ``values`` [B] summed per unit [U] (e.g. the losses of a unit's rows)."""
    return values.new_zeros(units.count).index_add_(0, units.unit, values)


# --- cutting a logical batch into micro-batches, units whole ----------------------------------------------------------


def batch_size(batch: Mapping[str, Tensor]) -> int:
    """The number of rows in ``batch``."""
    return next(iter(batch.values())).shape[0]


def split_batch(batch: Mapping[str, Tensor], size: int) -> Iterator[dict[str, Tensor]]:
    """Micro-batches of at most ``size`` rows (none for an empty batch); a unit's rows are never split.

    With ``batch[UNIT_KEY]`` whole units are packed in order into micro-batches of at most ``size`` rows (a unit has
    at most ``size`` rows: checked when the run starts).
    """
    units = units_of(batch)
    if units is None:
        for start in range(0, batch_size(batch), size):
            yield {key: value[start : start + size] for key, value in batch.items()}
        return
    order = torch.argsort(units.unit, stable=True)  # rows grouped by unit
    counts = torch.bincount(units.unit, minlength=units.count).tolist()
    chunk: list[Tensor] = []
    taken = 0
    for rows in order.split(counts):
        if taken and taken + len(rows) > size:
            yield {key: value[torch.cat(chunk)] for key, value in batch.items()}
            chunk, taken = [], 0
        chunk.append(rows)
        taken += len(rows)
    if chunk:
        yield {key: value[torch.cat(chunk)] for key, value in batch.items()}


def placeholder_example(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One all-zero row shaped like ``batch``'s (at least one position): a forward pass that clips nothing real."""
    return {key: value.new_zeros((1, *(max(1, size) for size in value.shape[1:]))) for key, value in batch.items()}


def require_units(batch: Mapping[str, Tensor], *, by_user: bool) -> None:
    """Refuse a batch of a user-level run whose rows do not say their user (each row would be clipped alone)."""
    if by_user and batch_size(batch) > 0 and units_of(batch) is None:
        raise ValueError(
            f"user-level DP: the training batch has no {UNIT_KEY!r} field, so its rows would be clipped one by one (up "
            "to k·C per user) while ε counts users: the dataset's collate function must keep each row's user"
        )
