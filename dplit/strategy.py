"""DPStrategy: Lightning's DDP strategy with :class:`~dplit.privacy.dpsgd.DPSGD` in place of backward and the step."""

from __future__ import annotations

from typing import Any, Literal

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from dplit.interrupted_run import INTERRUPT_CHECKPOINT
from dplit.privacy.accounting import Mechanism
from dplit.privacy.dpsgd import NO_NOISE_WARNING
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.world import ProcessGroup, SingleProcess
from dplit.strategy_hooks import DPSGDHooks

__all__ = ["INTERRUPT_CHECKPOINT", "NO_NOISE_WARNING", "DPStrategy"]


class DPStrategy(DPSGDHooks, DDPStrategy):
    """DP-SGD on one or many devices: one Lightning optimizer step is one :class:`~dplit.privacy.dpsgd.DPSGD` step.

    A Poisson logical batch (expected size = the loader's ``batch_size``, over all devices) is clipped in
    micro-batches, the clipped sums are all-reduced once with N(0, σ²C²) added once (rank 0), divided by the
    expected batch size, and the optimizer steps. Under data parallelism there is no DDP wrapper: rank 0's weights
    are broadcast at setup and each rank samples its own shard at the global rate q. The ledger is saved in every
    checkpoint and in ``privacy_ledger.json``. Every argument but ``**kwargs`` is a field of
    :class:`~dplit.privacy.settings.DPSGDSettings` (documented there) and is validated when the strategy is made.

    Args:
        **kwargs: passed to Lightning's ``DDPStrategy`` (``process_group_backend``, ``start_method``, ...).
    """

    strategy_name = "dp"

    def __init__(
        self,
        *,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        accountant: Mechanism = "prv",
        clipping: Literal["ghost", "per_example"] = "ghost",
        tied_norm: Literal["exact", "bound"] = "exact",
        max_physical_batch_size: int = 32,
        self_check: bool = True,
        seed: int | None = None,
        allow_large_delta: bool = False,
        private_diagnostics: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.init_dpsgd(DPSGDSettings(
            max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            target_delta=target_delta, accountant=accountant, clipping=clipping, tied_norm=tied_norm,
            max_physical_batch_size=max_physical_batch_size, self_check=self_check, seed=seed,
            allow_large_delta=allow_large_delta, private_diagnostics=private_diagnostics,
        ))  # fmt: skip

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper (its hooks would all-reduce unclipped gradients): broadcast rank 0's weights, build DP-SGD.

        Lightning calls this when fitting, after moving the model to its device and before creating the optimizers.
        """
        if self.world_size > 1:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.build_dpsgd(ProcessGroup(device=self.root_device) if self.world_size > 1 else SingleProcess())
