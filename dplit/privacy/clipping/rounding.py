"""Floating-point error bounds that keep ‖c_i G_i‖ ≤ C true in the arithmetic the engines actually do.

A per-example norm computed through Grams, Σ_{t,s} ⟨u_t, u_s⟩⟨v_t, v_s⟩, can cancel: an example crafted so
that its positions' gradients nearly cancel gets a computed norm below its true one, and its clipped contribution
exceeds C. Norms are therefore computed in float64 and given a rigorous slack (Higham, *Accuracy and Stability of
Numerical Algorithms*, §3.1: an n-term dot product has error ≤ γ_n Σ|x_k y_k|, γ_n = n u / (1 − n u)):

    ‖G‖² ≤ max(Ŝ, 0) + κ b²,    b = Σ_uses Σ_t ‖u_t‖‖v_t‖ (the triangle-inequality bound on ‖G‖),

and the clipped sum itself, formed in the factors' dtype, is off by at most γ_{T+1} b per example, which is added
to the norm. In normal cases both terms are far below 1e-6 of the norm; they only matter when Ŝ cancels.

Per-example gradients that are formed (materialised) and kept for the sum are normed from what was formed, with
the bound of :func:`materialised_rigorous_norm`. Both bounds assume IEEE arithmetic in the dtype at hand:
``torch.set_float32_matmul_precision("high")`` (which Lightning suggests on GPUs with tensor cores) lets cuBLAS
and oneDNN round a float32 matmul's factors to TF32 (u = 2⁻¹¹), and ``"medium"`` lets oneDNN round them to bf16
(u = 2⁻⁸): an error far above the slack, in every example's contribution. :func:`clipping_arithmetic` therefore
runs the norms and the clipped sums with IEEE float32 matmuls; the model's own forward and backward keep the
user's setting.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

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


MATMUL_BACKENDS = ("cuda", "mkldnn")
"""The torch backends whose float32 matmuls ``torch.backends.<name>.matmul.fp32_precision`` may make inexact."""


@contextmanager
def clipping_arithmetic(device_type: str) -> Iterator[None]:
    """No autograd, no autocast, and IEEE float32 matmuls: the arithmetic the rounding bounds of this module assume.

    The float32 matmul precision is set to ``"ieee"`` on every backend of :data:`MATMUL_BACKENDS` inside and
    restored on exit, exactly as it was.
    """
    with torch.no_grad(), torch.autocast(device_type, enabled=False), _ieee_float32_matmuls():
        yield


class _IeeeFloat32Matmuls:
    """Every float32 matmul rounds as IEEE float32 while any thread is inside (no TF32 or bf16 factors).

    The precision is a process-wide setting and the engines enter from autograd's device threads too (norms of
    recomputed calls): the first to enter saves and sets it, the last to leave restores it, under one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list[str] = []

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._set_ieee()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore()

    def _set_ieee(self) -> None:
        settings = [getattr(torch.backends, name).matmul for name in MATMUL_BACKENDS]
        self._saved = [setting.fp32_precision for setting in settings]
        try:
            for setting in settings:
                setting.fp32_precision = "ieee"
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        settings = [getattr(torch.backends, name).matmul for name in MATMUL_BACKENDS]
        for setting, precision in zip(settings, self._saved, strict=True):
            setting.fp32_precision = precision


_ieee_float32_matmuls = _IeeeFloat32Matmuls()


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


def kept_gradient_norm(computed: torch.Tensor, *, entries: int, dtype: torch.dtype) -> torch.Tensor:
    """A norm ≥ ‖c Ĝ‖ / c as the clipped sum forms it, from n̂, the float64 norm of per-example gradients Ĝ [B].

    For per-example gradients Ĝ that are kept and summed as Σ_i c_i Ĝ_i in ``dtype``: ‖Ĝ‖ ≤ n̂ (1 + 2γ_{entries+2})
    (the float64 sum of ``entries`` squares, one root), and forming c Ĝ and adding it to the sum adds at most 2γ₂ of
    it, as for any materialised use in :func:`rigorous_norm`.
    """
    return computed * (1 + 2 * gamma(entries + 2, torch.float64)) * (1 + 2 * gamma(2, dtype))


def materialised_rigorous_norm(
    computed: torch.Tensor, bound: torch.Tensor, *, entries: int, positions: int, dtype: torch.dtype
) -> torch.Tensor:
    """A norm ≥ both the true ‖G‖ and the norm of the clipped sum formed from Ĝ, per example [B] (float64).

    For per-example gradients Ĝ = Σ_t u_t v_tᵀ formed in ``dtype`` (one matmul whose entries are ``positions``-term
    dot products) and kept, so that the clipped sum is Σ_i c_i Ĝ_i of exactly what was normed:
    :func:`kept_gradient_norm` covers the sum, and ‖G − Ĝ‖ ≤ γ_T b (entry by entry, then the triangle inequality
    over t) the true norm. The sum's ≤ C does not depend on b.

    Args:
        computed: n̂, the float64 norm of Ĝ as computed [B].
        bound: b, the triangle-inequality bound Σ_t ‖u_t‖‖v_t‖, float64 [B].
        entries: the entries of one example's Ĝ (r·c: the float64 sum of squares).
        positions: T, the terms of each entry's dot product.
        dtype: the dtype Ĝ was formed in (and the clipped sum is formed in).
    """
    return kept_gradient_norm(computed, entries=entries, dtype=dtype) + gamma(positions, dtype) * bound
