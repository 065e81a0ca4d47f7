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
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.engine import ClippingEngine
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings

AUTOMATIC_STABILITY = 0.01
"""Automatic clipping's default γ (Bu et al. 2023)."""
TARGET_QUANTILE, CLIP_LEARNING_RATE, COUNT_NOISE_SHARE = 0.5, 0.2, 1 / 20
"""Quantile clipping's defaults (Andrew et al. 2021): γ, η, and σ_b as a share of the expected batch."""


class FixedBound:
    """C = ``max_grad_norm`` at every step: the base of every bound (no count, σ as accounted, nothing to restore)."""

    mode = "fixed"

    def __init__(self, max_grad_norm: float) -> None:
        self.bound = float(max_grad_norm)
        """The bound C_t the mechanism claims for the next step (the noise's scale is σ·C_t)."""
        self.last_estimate: float | None = None
        """Quantile mode: the last step's noisy share of unclipped units (public); ``None`` in the other modes."""

    def count(self, norms: Tensor) -> None:
        """Count units this rank clipped in this step (quantile mode only)."""

    def local_count(self, noise: Callable[[float], float]) -> float:
        """This rank's count for this step (``noise(σ_b)`` adds the count's noise on the rank that draws it): 0."""
        return 0.0

    def update(self, noisy_count: float, expected_batch: float) -> None:
        """Move C from the step's noisy count summed over ranks (quantile mode only)."""

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """The gradient's noise multiplier for the accounted σ: σ itself."""
        return noise_multiplier

    def facts(self) -> dict[str, Any]:
        """The mode and its knobs, as the ledger, the card and the history state them."""
        return {"clip_mode": self.mode}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues from (nothing here)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint (nothing to restore here)."""

    def resume(self, restored: dict[str, Any], *, noise_multiplier: float) -> None:
        """Continue a resumed run's state if it used this mode (C_t continued); refuse a σ this mode cannot use, now.

        Args:
            restored: the resumed ledger's facts (``{}`` for a fresh run).
            noise_multiplier: the run's σ.
        """
        if restored.get("clip_mode") == self.mode:
            self.load_state_dict(restored)
        self.gradient_noise_multiplier(noise_multiplier)


class AutomaticBound(FixedBound):
    """Automatic clipping: the engine scales every unit by C / (‖g‖ + γ); C only scales the update.

    Args:
        max_grad_norm: C.
        stability: γ > 0 (default :data:`AUTOMATIC_STABILITY`).
    """

    mode = "automatic"

    def __init__(self, max_grad_norm: float, stability: float | None = None) -> None:
        super().__init__(max_grad_norm)
        self.stability = stability if stability is not None else AUTOMATIC_STABILITY

    def facts(self) -> dict[str, Any]:
        """The mode and γ."""
        return {**super().facts(), "automatic_stability": self.stability}


def clip_bound_for(settings: DPSGDSettings, *, expected_batch: float) -> FixedBound:
    """The bound ``settings.clip_mode`` names, with its defaults (σ_b from the expected batch ``expected_batch``)."""
    if settings.clip_mode == "automatic":
        return AutomaticBound(settings.max_grad_norm, settings.automatic_stability)
    if settings.clip_mode == "quantile":
        return QuantileClipBound(
            initial=settings.max_grad_norm,
            target_quantile=settings.target_quantile or TARGET_QUANTILE,
            learning_rate=settings.clip_learning_rate or CLIP_LEARNING_RATE,
            count_noise_multiplier=settings.count_noise_multiplier or COUNT_NOISE_SHARE * expected_batch,
            flag_owner=settings.flag_owner,
        )
    return FixedBound(settings.max_grad_norm)


def clipping_engine(module: nn.Module, settings: DPSGDSettings) -> ClippingEngine:
    """The clipping engine ``settings.clipping`` names, built for ``module`` (automatic mode: scaling by γ)."""
    options = {"tied_norm": settings.tied_norm} if settings.clipping == "ghost" else {}
    stability = None
    if settings.clip_mode == "automatic":
        stability = settings.automatic_stability if settings.automatic_stability is not None else AUTOMATIC_STABILITY
    return build_engine(settings.clipping, module, max_grad_norm=settings.max_grad_norm, stability=stability, **options)


class QuantileClipBound(FixedBound):
    """C_t tracked privately towards the γ-quantile of the per-example gradient norms.

    Args:
        initial: C_0 (``max_grad_norm``).
        target_quantile: γ in (0, 1): the share of examples meant to be left unclipped.
        learning_rate: η > 0, the geometric step of the update.
        count_noise_multiplier: σ_b > 0, the standard deviation of the count's noise (in examples).
        flag_owner: the strategy whose flags a refusal names.
    """

    mode = "quantile"

    def __init__(
        self, *, initial: float, target_quantile: float, learning_rate: float, count_noise_multiplier: float,
        flag_owner: str = FLAG_OWNER,
    ) -> None:  # fmt: skip
        super().__init__(initial)
        self.flag_owner = flag_owner
        self.start = self.bound
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.count_noise_multiplier = count_noise_multiplier
        self._unclipped = 0.0  # this step's centred count on this rank (private until noised)

    def centred_count(self, norms: Tensor) -> float:
        """Σ (1[‖g‖ ≤ C_t] − ½) over ``norms`` (this rank's units): sensitivity ½ (private, before its noise)."""
        return float((norms <= self.bound).sum()) - 0.5 * norms.numel()

    def count(self, norms: Tensor) -> None:
        """Add ``norms``' centred count to this rank's count of the step."""
        self._unclipped += self.centred_count(norms)

    def local_count(self, noise: Callable[[float], float]) -> float:
        """This rank's centred count plus ``noise(σ_b)`` (N(0, σ_b²) on the rank that draws it, 0 elsewhere)."""
        count, self._unclipped = self._unclipped + noise(self.count_noise_multiplier), 0.0
        return count

    def facts(self) -> dict[str, Any]:
        """The mode, γ, η, σ_b and C_t (its value at the start of the segment and now)."""
        return {
            **super().facts(), "target_quantile": self.target_quantile, "clip_learning_rate": self.learning_rate,
            "count_noise_multiplier": self.count_noise_multiplier, "clip_bound_start": self.start,
            "clip_bound_end": self.bound,
        }  # fmt: skip

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
            self.bound = self.start = float(state["clip_bound"])
            self.last_estimate = state.get("clip_quantile_estimate")
