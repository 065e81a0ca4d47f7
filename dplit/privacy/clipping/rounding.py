"""Floating-point error bounds that keep ‖c_i G_i‖ ≤ C true in the arithmetic the engines actually do.

A per-example norm computed through Grams, Σ_{t,s} ⟨u_t, u_s⟩⟨v_t, v_s⟩, can cancel: an example crafted so
that its positions' gradients nearly cancel gets a computed norm below its true one, and its clipped contribution
exceeds C. Norms are therefore computed in float64 and given a rigorous slack (Higham, *Accuracy and Stability of
Numerical Algorithms*, §3.1: an n-term dot product has error ≤ γ_n Σ|x_k y_k|, γ_n = n u / (1 − n u)):

    ‖G‖² ≤ max(Ŝ, 0) + κ b²,    b = Σ_uses Σ_t ‖u_t‖‖v_t‖ (the triangle-inequality bound on ‖G‖),

and the clipped sum itself, formed in the factors' dtype, is off by at most γ_{T+1} b per example, which is added
to the norm. In normal cases both terms are far below 1e-6 of the norm; they only matter when Ŝ cancels.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff u: half the machine epsilon of ``dtype``."""
    return torch.finfo(dtype).eps / 2


def gamma(terms: int, dtype: torch.dtype) -> float:
    """Higham's γ_n = n u / (1 − n u): the relative error bound of an n-term sum of products in ``dtype``."""
    nu = terms * unit_roundoff(dtype)
    if nu >= 0.5:
        raise ValueError(f"an error bound for {terms} terms in {dtype} does not exist (n·u ≥ 1/2)")
    return nu / (1 - nu)


def rigorous_norm(
    squared: torch.Tensor, bound: torch.Tensor, *, terms: int, positions: int, sum_dtype: torch.dtype
) -> torch.Tensor:
    """A norm ≥ both the true ‖G‖ and the norm of the clipped sum as computed, per example [B] (float64).

    Args:
        squared: Ŝ, the float64 squared norm as computed (may be negative or cancelled).
        bound: b, the triangle-inequality bound Σ_t ‖u_t‖‖v_t‖ over all uses, float64.
        terms: the longest sum or dot product in computing Ŝ (widths, T², parameter size).
        positions: how many positions the clipped sum adds per example (T over all uses).
        sum_dtype: the dtype the clipped sum is formed in.
    """
    slack = 8 * gamma(terms + 1, torch.float64) * bound.square()  # the Grams, products and sums of Ŝ
    exact = (squared.clamp(min=0) + slack).sqrt()
    return exact + 2 * gamma(positions + 1, sum_dtype) * bound  # the rounding of Σ_t c u_t v_tᵀ
