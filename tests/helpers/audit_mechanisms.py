"""Deliberately broken DP mechanisms for the audit to catch (used only by tests, through ``--trainer.strategy``).

Each attaches to the shipped DP-SGD object through its public hooks (or replaces a public factory), as any
extension would: none overrides a private method or touches a private attribute.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from typing_extensions import override

from dplit.audit.strategy import CanaryDPStrategy
from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.engine import ClippingEngine
from dplit.privacy.dpsgd import DPSGD


class HalfNoise(CanaryDPStrategy):
    """Releases the noise at std 0.5·σC while the accountant counts σ.

    Doubles the clipped sum (canaries included) before the noise and halves the noisy sum after it.
    """

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.dpsgd.register_before_noise_hook(lambda _, clipped_sum: clipped_sum.mul_(2.0))
        self.dpsgd.register_after_noise_hook(lambda _, noisy_sum: noisy_sum.div_(2.0), prepend=True)


class RealisedBatchDivisor(CanaryDPStrategy):
    """Divides the noisy sum by the realised batch size (examples plus canaries sampled) instead of q·N."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._realised = 0

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        self._realised = next(iter(args[0].values())).shape[0]
        return super().training_step(*args, **kwargs)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.dpsgd.register_after_noise_hook(self._rescale, prepend=True)  # before the canaries are scored

    def _rescale(self, dpsgd: DPSGD, noisy_sum: Tensor) -> None:
        realised = max(1, self._realised + self.canaries.sampled_last_step)
        noisy_sum.mul_(dpsgd.expected_batch_size / realised)  # DP-SGD then divides by q·N


class UnclippedCanaries(CanaryDPStrategy):
    """Each canary's clipping is skipped: its gradient enters with norm 10·C."""

    @override
    def canary_norm(self) -> float:
        return 10 * self.dpsgd.clip_bound


class NoClipping(CanaryDPStrategy):
    """No example is clipped (real examples at C = 10⁶, canaries at their raw norm 100·C), while the noise is σ·C."""

    @override
    def canary_norm(self) -> float:
        return 100 * self.dpsgd.clip_bound

    @override
    def make_clipping_engine(self, module: nn.Module) -> ClippingEngine:
        return build_engine(self.settings.clipping, module, max_grad_norm=1e6)
