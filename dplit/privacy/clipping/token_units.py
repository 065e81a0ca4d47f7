"""Privacy units of tokens (packed rows): one clipped gradient per document (or user), however the rows hold them.

A packed batch says which unit each token belongs to (``batch[TOKEN_UNIT_KEY]``, [B, T] integers, -1 for padding).
With documents isolated (each attends to itself only), unit u's gradient of one use of a parameter is the sum of the
per-position terms at u's positions only: G_u = Σ_{(i,t)∈u} u_{i,t} v_{i,t}ᵀ. So every captured call's input and
output gradient are re-laid from rows to units ([B, T, ...] → [U, L, ...], L the most positions of a unit, a unit's
positions side by side, zeros after them) BEFORE a norm rule sees them: every rule (linear, embedding, the tied
cross term, LayerNorm / RMSNorm replays, LoRA, materialised weights) then computes each unit's exact gradient with no
rule of its own, since each rule's gradient is a sum of per-position terms and a zero output gradient adds nothing.
Padding positions belong to no unit: their output gradient is zero when documents are isolated.

This is exact only if the model isolates documents: a leaking attention makes a token's output gradient depend on
other documents, which the self-check (autograd per unit on the same packed rows) then tells apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

TOKEN_UNIT_KEY = "token_unit"
"""The batch key of each token's privacy unit: a [B, T] integer tensor (-1: padding, in no unit)."""


@dataclass(frozen=True)
class TokenUnits:
    """Which unit each token of a batch belongs to, and its place among that unit's positions.

    Attributes:
        rows: [N] the row of each unit token (N the tokens in some unit).
        positions: [N] the position in its row of each unit token.
        unit: [N] each unit token's unit, numbered 0..count-1 in order of first appearance (row-major).
        slot: [N] each unit token's place among its unit's tokens (0, 1, ...).
        count: the number of units U.
        longest: the most tokens of a unit L (at least 1).
        shape: the batch's (B, T).
    """

    rows: Tensor
    positions: Tensor
    unit: Tensor
    slot: Tensor
    count: int
    longest: int
    shape: tuple[int, int]


def token_units_of(batch: Mapping[str, Tensor]) -> TokenUnits | None:
    """The token units of ``batch[TOKEN_UNIT_KEY]`` (``None`` without the key)."""
    labels = unit_labels(batch, TOKEN_UNIT_KEY, shape="[B, T]")
    if labels is None:
        return None
    rows, positions = (labels >= 0).nonzero(as_tuple=True)  # row-major order
    kept = labels[rows, positions]  # [N]
    unit, slot, counts = numbered_by_appearance(kept)
    longest = max(int(counts.max()), 1) if counts.numel() else 1
    shape = (int(labels.shape[0]), int(labels.shape[1]))
    return TokenUnits(rows, positions, unit, slot, int(counts.numel()), longest, shape)


def unit_labels(batch: Mapping[str, Tensor], key: str, *, shape: str) -> Tensor | None:
    """``batch[key]``, checked to be an integer tensor of ``shape`` (``"[B]"`` or ``"[B, T]"``); ``None`` without it."""
    labels = batch.get(key)
    if labels is not None and (labels.dim() != shape.count(",") + 1 or labels.is_floating_point()):
        raise ValueError(
            f"batch[{key!r}] must be a {shape} integer tensor, got {labels.dtype} of {tuple(labels.shape)}"
        )
    return labels


def numbered_by_appearance(labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each entry's unit (0..U-1 by first appearance in ``labels`` [N]), its place among its unit's, and the counts.

    Returns:
        ``unit`` [N], ``slot`` [N] (0, 1, ... in order within a unit) and each unit's entry count [U].
    """
    _, index, counts = torch.unique(labels, return_inverse=True, return_counts=True)  # sorted labels
    order = torch.arange(labels.numel(), device=labels.device)
    first = torch.full_like(counts, labels.numel()).scatter_reduce_(0, index, order, "amin")  # [U]
    by_appearance = torch.argsort(first)  # labels in order of their first entry
    renumbered = torch.empty_like(by_appearance)
    renumbered[by_appearance] = torch.arange(by_appearance.numel(), device=labels.device)
    unit, counts = renumbered[index], counts[by_appearance]
    grouped = torch.argsort(unit, stable=True)  # entries grouped by unit, in order within a unit
    starts = counts.cumsum(0) - counts  # [U]: where each unit's entries begin in ``grouped``
    slot = torch.empty_like(unit)
    slot[grouped] = order - starts[unit[grouped]]
    return unit, slot, counts


def relaid(values: Tensor, units: TokenUnits) -> Tensor:
    """``values`` [B, T, ...] laid out by unit: [U, L, ...], a unit's tokens side by side, zeros after them.

    Raises:
        ValueError: ``values`` is not per token of the batch (dims 0 and 1 are not the batch's rows and positions).
    """
    if tuple(values.shape[:2]) != units.shape:
        raise ValueError(
            f"a packed batch's layer input of shape {tuple(values.shape)} is not per token of its {units.shape[0]} "
            f"rows of {units.shape[1]} tokens: per-document clipping needs [rows, tokens, ...] inputs"
        )
    laid = values.new_zeros((units.count, units.longest, *values.shape[2:]))  # [U, L, ...]
    laid[units.unit, units.slot] = values[units.rows, units.positions]
    return laid


def unit_token_sums(values: Tensor, units: TokenUnits) -> Tensor:
    """Per-token ``values`` [B, T] summed per unit [U] (e.g. a unit's token losses)."""
    return values.new_zeros(units.count).index_add_(0, units.unit, values[units.rows, units.positions])
