"""CanaryDPStrategy: DPStrategy plus white-box gradient canaries, used only by ``dplit audit``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from typing_extensions import override

from dplit.audit.canaries import GradientCanaries
from dplit.privacy.engine import trainable_parameters
from dplit.strategy import DPStrategy


class CanaryDPStrategy(DPStrategy):
    """DP-SGD with m gradient canaries that take part in every step as m more examples would.

    Each included canary is Poisson-sampled at the run's rate q every step and its gradient (a Dirac of norm C) is
    added to the clipped sum before the noise, on rank 0 (where the noise is drawn); after the step, the released
    noisy sum (the published gradient times q·N) is read at every canary's coordinate. Nothing else changes.

    Args:
        canaries: m, the number of gradient canaries.
        canary_seed: seeds where the canaries sit and which are included (the auditor's choice; their per-step
            sampling comes from the strategy's own noise source).
        **kwargs: :class:`~dplit.strategy.DPStrategy`'s arguments.
    """

    strategy_name = "dp_canary"

    def __init__(self, *, canaries: int = 1000, canary_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._canary_count = canaries
        self._canary_seed = canary_seed
        self._canaries: GradientCanaries | None = None

    @property
    def canaries(self) -> GradientCanaries:
        """The run's canaries: where they sit, which are included, and their scores so far."""
        if self._canaries is None:
            raise RuntimeError("CanaryDPStrategy places its canaries when training starts")
        return self._canaries

    def canary_norm(self) -> float:
        """The norm of each canary's gradient: the clipping bound C, as for any clipped example."""
        return self.max_grad_norm

    @override
    def setup(self, trainer: Trainer) -> None:
        """Set up as DPStrategy does, then place the canaries among the trainable coordinates (refusing too many)."""
        super().setup(trainer)
        size = sum(parameter.numel() for parameter in trainable_parameters(self.lightning_module).values())
        generator = torch.Generator().manual_seed(self._canary_seed)
        self._canaries = GradientCanaries.place(
            self._canary_count, size=size, norm=self.canary_norm(), generator=generator
        )

    @override
    def _global_noisy_sum(self, stop: bool) -> None:
        """Add the sampled canaries to the clipped sum (rank 0), then noise and all-reduce it as DPStrategy does."""
        assert self._buffer is not None and self._sample_rate is not None
        if self.is_global_zero:
            generator = self._noise_source.generator("canaries", steps=self._ledger.steps, device=torch.device("cpu"))
            self.canaries.add_sampled(self._buffer.flat, sample_rate=self._sample_rate, generator=generator)
        super()._global_noisy_sum(stop)

    @override
    def _privatize(self) -> None:
        """Take the DP step, then score the canaries on the released noisy sum."""
        super()._privatize()
        assert self._buffer is not None and self._sample_rate is not None and self._dataset_size is not None
        self.canaries.observe(self._buffer.flat, scale=self._sample_rate * self._dataset_size)
