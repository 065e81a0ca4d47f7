"""The clipping bound C of each step: fixed, private quantile tracking, or automatic (normalised) clipping.

* ``fixed``: C is ``max_grad_norm`` (Abadi et al. 2016).
* ``quantile`` (Andrew et al., NeurIPS 2021): C_t follows the target quantile γ of the per-example norms. Each
  step releases the CENTRED count Σ_i (1[‖g_i‖ ≤ C_t] − ½) + N(0, σ_b²): adding or removing one example moves it by
  ½ (an uncentred count would move by 1, and the formula below would then under-noise the gradient). The share
  of unclipped examples is estimated with the public expected batch B: b̃_t = (centred count + B/2) / B, and C
  moves geometrically: C_{t+1} = C_t · exp(−η (b̃_t − γ)). The gradient's noise multiplier is raised to
  σ_eff = (σ⁻² − (2σ_b)⁻²)^(−½), so the pair (gradient of sensitivity C, count of sensitivity ½) is exactly one
  Gaussian mechanism of multiplier σ, the one the accountant counts (their Theorem 1): ε is that of σ.
* ``automatic`` (Bu et al., NeurIPS 2023, AUTO-S): every example's gradient is scaled by C / (‖g_i‖ + γ), so its
  norm is below C whatever its size: no bound to tune (``max_grad_norm`` only scales the update, like the lr).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from dplit.privacy.settings import FLAG_OWNER


class QuantileClipBound:
    """C_t tracked privately towards the γ-quantile of the per-example gradient norms.

    Args:
        initial: C_0 (``max_grad_norm``).
        target_quantile: γ in (0, 1): the share of examples meant to be left unclipped.
        learning_rate: η > 0, the geometric step of the update.
        count_noise_multiplier: σ_b > 0, the standard deviation of the count's noise (in examples).
        flag_owner: the strategy whose flags a refusal names.
    """

    def __init__(
        self, *, initial: float, target_quantile: float, learning_rate: float, count_noise_multiplier: float,
        flag_owner: str = FLAG_OWNER,
    ) -> None:  # fmt: skip
        self.flag_owner = flag_owner
        self.bound = float(initial)
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.count_noise_multiplier = count_noise_multiplier
        self.last_estimate: float | None = None
        """The last step's noisy share of unclipped examples (public: it is part of the released mechanism)."""

    def centred_count(self, norms: Tensor) -> float:
        """Σ (1[‖g‖ ≤ C_t] − ½) over ``norms`` (this rank's units): sensitivity ½ (private, before its noise)."""
        return float((norms <= self.bound).sum()) - 0.5 * norms.numel()

    def update(self, noisy_centred_count: float, expected_batch: float) -> None:
        """C ← C · exp(−η (b̃ − γ)) with b̃ = (noisy centred count + B/2) / B, B the public expected batch."""
        self.last_estimate = noisy_centred_count / expected_batch + 0.5
        self.bound *= math.exp(-self.learning_rate * (self.last_estimate - self.target_quantile))

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """σ_eff = (σ⁻² − (2σ_b)⁻²)^(−½): the gradient's share of the accounted σ (0 stays 0: no noise)."""
        if noise_multiplier == 0:
            return 0.0
        remaining = noise_multiplier**-2 - (2 * self.count_noise_multiplier) ** -2
        if remaining <= 0:
            raise ValueError(
                f"{self.flag_owner}.count_noise_multiplier={self.count_noise_multiplier:g} is too small for σ="
                f"{noise_multiplier:.4g}: the count alone would spend the budget (need 2σ_b > σ); raise it"
            )
        return remaining**-0.5

    def state_dict(self) -> dict[str, Any]:
        """C_t and the last estimate, as checkpoints keep them."""
        return {"clip_bound": self.bound, "clip_quantile_estimate": self.last_estimate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's C_t (bit for bit)."""
        if state.get("clip_bound") is not None:
            self.bound = float(state["clip_bound"])
            self.last_estimate = state.get("clip_quantile_estimate")
