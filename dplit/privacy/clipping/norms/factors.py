"""Per-example gradients of one parameter use, kept factorised, and the algebra on them.

One *use* of a parameter W of shape [r, c] in a forward pass gives example i the gradient
G_i = Σ_t u_{i,t} v_{i,t}ᵀ (a :class:`FactoredGradient`), or, for small parameters such as biases and
LayerNorm scales, the materialised [B, *shape] gradient (an :class:`ExampleGradient`). A factor is either
dense vectors [B, T, n] or one-hot rows given as indices [B, T] (an embedding lookup), so that nothing of
size vocabulary × width is ever built per example.

For two uses of the same parameter ⟨G_1, G_2⟩_i = Σ_{t,s} ⟨u1_t, u2_s⟩⟨v1_t, v2_s⟩: the elementwise product
of the two factor Grams, summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dplit.privacy.clipping.rounding import gamma


@dataclass(frozen=True)
class DenseFactor:
    """Per-position vectors of one gradient factor: ``values`` [B, T, n]."""

    values: Tensor

    @property
    def width(self) -> int:
        """The vector size n."""
        return self.values.shape[-1]


@dataclass(frozen=True)
class IndexFactor:
    """Per-position one-hot vectors of size ``width``, given by their hot index: ``indices`` [B, T]."""

    indices: Tensor
    width: int


Factor = DenseFactor | IndexFactor


@dataclass(frozen=True)
class FactoredGradient:
    """Example i's gradient of one use, G_i = Σ_t left_{i,t} right_{i,t}ᵀ, in the parameter's [r, c] layout."""

    left: Factor
    right: Factor

    @property
    def positions(self) -> int:
        """The number of positions T summed over."""
        return _positions(self.left)


@dataclass(frozen=True)
class ExampleGradient:
    """Example i's gradient of one use, materialised: ``values`` [B, *parameter.shape]."""

    values: Tensor


GradientUse = FactoredGradient | ExampleGradient


def _positions(factor: Factor) -> int:
    """T of a factor."""
    return factor.values.shape[1] if isinstance(factor, DenseFactor) else factor.indices.shape[1]


def _as_dense(factor: Factor, dtype: torch.dtype) -> Tensor:
    """The factor's vectors [B, T, n], building one-hot rows for an index factor (only on rare paths)."""
    if isinstance(factor, DenseFactor):
        return factor.values
    return torch.nn.functional.one_hot(factor.indices, factor.width).to(dtype)  # [B, T] -> [B, T, n]


def _dtype_of(*factors: Factor) -> torch.dtype:
    """The floating dtype of the dense factors among ``factors`` (the default dtype if all are indices)."""
    return next((f.values.dtype for f in factors if isinstance(f, DenseFactor)), torch.get_default_dtype())


def factor_gram(first: Factor, second: Factor, dtype: torch.dtype) -> Tensor:
    """Per-example Gram [B, T1, T2] of two factors: entry (t, s) is ⟨first_t, second_s⟩."""
    if isinstance(first, DenseFactor) and isinstance(second, DenseFactor):
        return torch.bmm(first.values, second.values.transpose(1, 2))  # [B, T1, n] x [B, n, T2] -> [B, T1, T2]
    if isinstance(first, IndexFactor) and isinstance(second, IndexFactor):
        equal = first.indices[:, :, None] == second.indices[:, None, :]  # [B, T1, 1] vs [B, 1, T2] -> [B, T1, T2]
        return equal.to(dtype)
    if isinstance(first, IndexFactor):
        return factor_gram(second, first, dtype).transpose(1, 2)
    size, hot = second.indices.shape
    picks = second.indices[:, None, :].expand(size, first.values.shape[1], hot)  # [B, T1, T2]
    return first.values.gather(2, picks)  # first_t[x_s]: [B, T1, n] -> [B, T1, T2]


def materialise(use: GradientUse) -> Tensor:
    """The per-example gradients [B, *shape] of one use."""
    if isinstance(use, ExampleGradient):
        return use.values
    dtype = _dtype_of(use.left, use.right)
    left, right = _as_dense(use.left, dtype), _as_dense(use.right, dtype)
    return torch.einsum("btr,btc->brc", left, right)  # Σ_t u_t v_tᵀ: [B, T, r], [B, T, c] -> [B, r, c]


def prefers_materialising(use: FactoredGradient) -> bool:
    """Whether forming the [B, r, c] gradient takes no more multiply-adds than the two [B, T, T] Grams.

    That is T·r·c ≤ T²·(r + c), i.e. r·c ≤ T·(r + c): the materialised gradient is then never bigger than
    the factors it is formed from (it holds whenever it is no bigger than the two Grams, 2T² ≥ r·c). Never
    for index factors (no per-example vocabulary-sized matrix).
    """
    dense = isinstance(use.left, DenseFactor) and isinstance(use.right, DenseFactor)
    rows, cols = use.left.width, use.right.width
    return dense and rows * cols <= use.positions * (rows + cols)


def inner_product(first: GradientUse, second: GradientUse) -> Tensor:
    """Per-example ⟨G_1, G_2⟩ [B] of two uses of the same parameter."""
    if isinstance(first, FactoredGradient) and isinstance(second, FactoredGradient):
        dtype = _dtype_of(first.left, first.right)
        left = factor_gram(first.left, second.left, dtype)  # [B, T1, T2]
        right = factor_gram(first.right, second.right, dtype)  # [B, T1, T2]
        return (left * right).sum((1, 2))
    return (materialise(first) * materialise(second)).flatten(1).sum(1)  # [B, *shape] -> [B]


def squared_norm(use: GradientUse) -> Tensor:
    """Per-example ‖G‖² [B] of one use, by Grams ("ghost") or materialising, whichever is cheaper."""
    if isinstance(use, ExampleGradient):
        return use.values.flatten(1).pow(2).sum(1)  # [B, *shape] -> [B]
    if prefers_materialising(use):
        return materialised_norm(use)[0].square()
    return inner_product(use, use)


def materialised_norm(use: FactoredGradient) -> tuple[Tensor, Tensor]:
    """(‖G_i‖ [B] in float64, the per-example gradients G [B, r, c] in the factors' dtype): one ``bmm``.

    The norm of each G_i, as formed, is computed in float64 (no float64 copy of G or of the factors). G is returned
    in the parameter's [r, c] layout (a transposed view when it was formed as Gᵀ, see :func:`_materialised_dense`),
    so that a caller can keep it, e.g. to form the clipped sum from it.
    """
    product = _materialised_dense(use)
    norms = torch.linalg.vector_norm(product.flatten(1), dim=1, dtype=torch.float64)  # [B, r, c] (or Gᵀ) -> [B]
    return norms, product if use.left.width <= use.right.width else product.transpose(1, 2)


def _materialised_dense(use: FactoredGradient) -> Tensor:
    """G_i = Σ_t u_t v_tᵀ [B, r, c] of two dense factors, or G_iᵀ [B, c, r] when c < r: one ``bmm`` either way.

    The narrower factor is the transposed operand (rows of the product), the faster layout for a batched
    matrix product; a norm does not depend on which of G and Gᵀ it is taken of.
    """
    left, right = use.left.values, use.right.values  # [B, T, r], [B, T, c]
    if use.left.width <= use.right.width:
        return torch.bmm(left.transpose(1, 2), right)  # [B, r, T] x [B, T, c] -> [B, r, c]
    return torch.bmm(right.transpose(1, 2), left)  # [B, c, T] x [B, T, r] -> [B, c, r]


def concatenate(uses: list[FactoredGradient]) -> FactoredGradient:
    """One use whose positions are all of ``uses``' (same factor kinds): Σ_k G_k as a single factorisation."""

    def join(factors: list[Factor]) -> Factor:
        if isinstance(factors[0], DenseFactor):
            return DenseFactor(torch.cat([f.values for f in factors], dim=1))  # [B, ΣT_k, n]
        return IndexFactor(torch.cat([f.indices for f in factors], dim=1), factors[0].width)  # [B, ΣT_k]

    return FactoredGradient(join([u.left for u in uses]), join([u.right for u in uses]))


def weighted_sum(use: GradientUse, weights: Tensor) -> Tensor:
    """Σ_i w_i G_i in the parameter's shape ([r, c] for a factored use), without building any per-example gradient."""
    if isinstance(use, ExampleGradient):
        return torch.einsum("b,b...->...", weights, use.values)  # [B], [B, *shape] -> shape
    if isinstance(use.left, DenseFactor) and isinstance(use.right, DenseFactor):
        return torch.mm(*_weighted_dense_operands(use.left, use.right, weights))  # [r, c]: no zero-filled total first
    total = weights.new_zeros(use.left.width, use.right.width)  # [r, c]
    return add_weighted_sum_(total, use, weights)


def add_weighted_sum_(out: Tensor, use: GradientUse, weights: Tensor) -> Tensor:
    """``out += Σ_i w_i G_i`` in place (``out``: contiguous, the parameter's shape), with no parameter-sized temporary.

    Dense factors go through one ``addmm_`` (the smaller factor scaled by the weights), an index factor through
    one ``index_add_`` of the weighted rows.
    """
    if isinstance(use, ExampleGradient):  # small parameters (biases, norm scales): one matrix-vector product
        values = use.values.reshape(use.values.shape[0], -1)  # [B, *shape] -> [B, D]
        if out.dtype == values.dtype == weights.dtype:
            out.view(-1).addmv_(values.T, weights)  # out += Σ_i w_i values_i
            return out
        return out.add_(weighted_sum(use, weights).reshape(out.shape))
    left, right = use.left, use.right
    target = out.view(left.width, right.width)  # [r, c]
    scale = weights[:, None, None]
    if isinstance(left, DenseFactor) and isinstance(right, DenseFactor):
        target.addmm_(*_weighted_dense_operands(left, right, weights))
    elif isinstance(left, IndexFactor):  # rows x_{i,t} of the weighted right factor
        rows = _as_dense(right, weights.dtype) * scale  # [B, T, c]
        target.index_add_(0, left.indices.reshape(-1), rows.reshape(-1, right.width))
    else:  # columns x_{i,t} of the weighted left factor
        target.T.index_add_(0, right.indices.reshape(-1), (left.values * scale).reshape(-1, left.width))
    return out


def _weighted_dense_operands(left: DenseFactor, right: DenseFactor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """The two matrices whose product is Σ_i w_i L_iᵀ R_i: [r, BT] and [BT, c], the narrower factor weighted."""
    scale = weights[:, None, None]
    if left.width <= right.width:
        return (left.values * scale).flatten(0, 1).T, right.values.flatten(0, 1)  # [r, BT], [BT, c]
    return left.values.flatten(0, 1).T, (right.values * scale).flatten(0, 1)


def batch_size(use: GradientUse) -> int:
    """The number of examples B of a use."""
    if isinstance(use, ExampleGradient):
        return use.values.shape[0]
    factor = use.left
    return factor.values.shape[0] if isinstance(factor, DenseFactor) else factor.indices.shape[0]


def example_slice(use: GradientUse, start: int, stop: int) -> GradientUse:
    """The use restricted to examples ``start:stop``, with dense values in float64 (for exact norm arithmetic)."""
    whole = start == 0 and stop >= batch_size(use)  # the usual single chunk: no slicing

    def rows(values: Tensor) -> Tensor:
        return values if whole else values[start:stop]

    def part(factor: Factor) -> Factor:
        if isinstance(factor, DenseFactor):
            return DenseFactor(rows(factor.values).double())  # [b, T, n]
        return IndexFactor(rows(factor.indices), factor.width)  # [b, T]

    if isinstance(use, ExampleGradient):
        return ExampleGradient(rows(use.values).double())
    return FactoredGradient(part(use.left), part(use.right))


def live_positions(use: GradientUse) -> Tensor:
    """Per example, one past the last position whose term u_t v_tᵀ can be nonzero [B] (0: none; 1 if materialised).

    A position whose left or right vector is exactly zero (a packed unit's slots after its tokens, a padded
    position's zero output gradient) adds nothing to G_i, to its Grams or to a cross term with another use, so the
    positions after the last live one can be left out of every product exactly.
    """
    if isinstance(use, ExampleGradient):
        return torch.ones(use.values.shape[0], dtype=torch.long, device=use.values.device)
    live = None
    for factor in (use.left, use.right):
        if isinstance(factor, DenseFactor):
            nonzero = (factor.values != 0).any(-1)  # [B, T]
            live = nonzero if live is None else live & nonzero
    if live is None:  # two index factors: every position's term is a one-hot product
        return torch.full((batch_size(use),), use.positions, dtype=torch.long, device=use.left.indices.device)
    steps = torch.arange(1, live.shape[1] + 1, device=live.device)  # [T]
    return (live * steps).amax(1)  # [B]: the last live position + 1


def example_subset(use: GradientUse, index: Tensor, positions: int) -> GradientUse:
    """The use restricted to examples ``index`` [b] and to its first ``positions`` positions, dense values in float64.

    Exact when no example of ``index`` has a live position at or after ``positions`` (:func:`live_positions`).
    """

    def part(factor: Factor) -> Factor:
        if isinstance(factor, DenseFactor):
            return DenseFactor(factor.values[index, :positions].double())  # [b, P, n]
        return IndexFactor(factor.indices[index, :positions], factor.width)  # [b, P]

    if isinstance(use, ExampleGradient):
        return ExampleGradient(use.values[index].double())
    return FactoredGradient(part(use.left), part(use.right))


def without_examples(use: GradientUse, keep: Tensor) -> GradientUse:
    """The use with every example where ``keep`` [B] is False set to zero (NaN and inf included)."""

    def zeroed(values: Tensor) -> Tensor:
        mask = keep.reshape((-1,) + (1,) * (values.dim() - 1))  # [B, 1, ...]
        return torch.where(mask, values, 0.0)

    if isinstance(use, ExampleGradient):
        return ExampleGradient(zeroed(use.values))
    left, right = (DenseFactor(zeroed(f.values)) if isinstance(f, DenseFactor) else f for f in (use.left, use.right))
    return FactoredGradient(left, right)


def triangle_bound(use: GradientUse) -> Tensor:
    """Per-example Σ_t ‖u_t‖‖v_t‖ [B] in float64: ≥ ‖G‖ in exact arithmetic, with no cancellation."""
    if isinstance(use, ExampleGradient):
        return torch.linalg.vector_norm(use.values.flatten(1), dim=1, dtype=torch.float64)  # [B, *shape] -> [B]

    def lengths(factor: Factor) -> Tensor:
        """‖u_t‖ [B, T] in float64, never below the truth: formed in the factor's dtype (no float64 copy of it)."""
        if isinstance(factor, DenseFactor):
            values = factor.values.to(torch.promote_types(factor.values.dtype, torch.float32))  # bf16: in float32
            computed = torch.linalg.vector_norm(values, dim=-1).double()  # [B, T, n] -> [B, T]
            underflow = math.sqrt(factor.width * torch.finfo(values.dtype).tiny)  # squares below `tiny` are lost
            return computed / (1 - gamma(factor.width + 1, values.dtype)) + underflow  # n squares summed, one root
        return torch.ones(factor.indices.shape, dtype=torch.float64, device=factor.indices.device)  # one-hot rows

    summed = (lengths(use.left) * lengths(use.right)).sum(1)  # [B, T] -> [B]
    return summed / (1 - gamma(use.positions + 1, torch.float64))  # T products summed


def arithmetic_terms(use: GradientUse) -> int:
    """The longest dot product or sum in this use's norm arithmetic (factor widths, T², parameter size)."""
    if isinstance(use, ExampleGradient):
        return use.values[0].numel()
    return max(use.left.width, use.right.width, use.positions**2, use.left.width * use.right.width)


def summed_positions(use: GradientUse) -> int:
    """How many per-position terms the clipped sum of this use adds per example (1 for a materialised use)."""
    return 1 if isinstance(use, ExampleGradient) else use.positions


def sum_dtype(use: GradientUse) -> torch.dtype:
    """The dtype the use's clipped sum is formed in."""
    if isinstance(use, ExampleGradient):
        return use.values.dtype
    return _dtype_of(use.left, use.right)
