"""CanaryDPStrategy: DPStrategy plus white-box gradient canaries, used only by ``dplit audit``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor
from typing_extensions import override

from dplit.audit.canaries import GradientCanaries
from dplit.privacy.clipping.engine import trainable_parameters
from dplit.privacy.dpsgd import DPSGD
from dplit.strategy import DPStrategy


class CanaryDPStrategy(DPStrategy):
    """DP-SGD with m gradient canaries that take part in every step as m more examples would.

    Each included canary is Poisson-sampled at the run's rate q every step and its gradient (a Dirac of norm C, or of
    this step's C_t under quantile clipping, where it also joins the noisy count as an example at the bound would)
    is added to the clipped sum before the noise, on rank 0 (where the noise is drawn); the released noisy sum is read
    at every canary's coordinate. All of it goes through DP-SGD's public hooks and methods: nothing else changes.

    Args:
        canaries: m, the number of gradient canaries.
        canary_seed: seeds where the canaries sit and which are included (the auditor's choice; their per-step
            sampling comes from the strategy's own noise source).
        **kwargs: :class:`~dplit.strategy.DPStrategy`'s arguments.
    """


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
        """The norm of each canary's gradient this step: the bound the mechanism claims, as for any clipped example.

        C, or this step's C_t under quantile clipping.
        """
        return self.dpsgd.clip_bound

    @override
    def setup(self, trainer: Trainer) -> None:
        """Set up as DPStrategy does, place the canaries among the trainable coordinates, and attach them to DP-SGD."""
        super().setup(trainer)
        size = sum(parameter.numel() for parameter in trainable_parameters(self.lightning_module).values())
        generator = torch.Generator().manual_seed(self._canary_seed)
        self._canaries = GradientCanaries.place(
            self._canary_count, size=size, norm=self.canary_norm(), generator=generator
        )
        self.dpsgd.register_before_noise_hook(self._add_canaries)
        self.dpsgd.register_after_noise_hook(self._score_canaries)

    def _add_canaries(self, dpsgd: DPSGD, clipped_sum: Tensor) -> None:
        """Add the canaries Poisson-sampled this step to the clipped sum, on rank 0 (where the noise is drawn)."""
        if dpsgd.world.rank != 0:
            return
        assert dpsgd.sample_rate is not None
        generator = dpsgd.noise_source.generator("canaries", steps=dpsgd.budget.steps, device=torch.device("cpu"))
        norm = self.canary_norm()
        sampled = self.canaries.add_sampled(clipped_sum, sample_rate=dpsgd.sample_rate, generator=generator, norm=norm)
        dpsgd.count_units(torch.full((sampled,), norm, dtype=torch.float64))  # quantile mode: each joins the count

    def _score_canaries(self, dpsgd: DPSGD, noisy_sum: Tensor) -> None:
        """Score every canary on the released noisy sum (before the division by qN), in units of the step's C."""
        assert dpsgd.sample_rate is not None
        self.canaries.observe(
            noisy_sum, clip_bound=dpsgd.clip_bound, noise_multiplier=dpsgd.gradient_noise_multiplier,
            sample_rate=dpsgd.sample_rate,
        )  # fmt: skip
