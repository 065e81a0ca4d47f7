"""Deliberately broken DP mechanisms for the audit to catch (used only by tests, through ``--trainer.strategy``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from dplit.audit.strategy import CanaryDPStrategy
from dplit.privacy import build_engine


class HalfNoise(CanaryDPStrategy):
    """Draws the noise with std 0.5·σC while the accountant counts σ."""

    @override
    def _global_noisy_sum(self, stop: bool) -> None:
        sigma = self._noise_multiplier
        assert sigma is not None
        self._noise_multiplier = sigma / 2
        try:
            super()._global_noisy_sum(stop)
        finally:
            self._noise_multiplier = sigma


class RealisedBatchDivisor(CanaryDPStrategy):
    """Divides the noisy sum by the realised batch size (examples plus canaries sampled) instead of q·N."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._realised = 0

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        self._realised = next(iter(args[0].values())).shape[0]
        return super().training_step(*args, **kwargs)

    @property
    @override
    def expected_batch_size(self) -> float:
        if self._canaries is None:  # before the first step
            return super().expected_batch_size
        return float(max(1, self._realised + self.canaries.sampled_last_step))


class UnclippedCanaries(CanaryDPStrategy):
    """Each canary's clipping is skipped: its gradient enters with norm 10·C."""

    @override
    def canary_norm(self) -> float:
        return 10 * self.max_grad_norm


class NoClipping(CanaryDPStrategy):
    """No example is clipped (real examples at C = 10⁶, canaries at their raw norm 100·C), while the noise is σ·C."""

    @override
    def canary_norm(self) -> float:
        return 100 * self.max_grad_norm

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._engine = build_engine(self._clipping, self.lightning_module, max_grad_norm=1e6)
