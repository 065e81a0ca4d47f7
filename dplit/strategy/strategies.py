"""DP strategies: Lightning's DDP (:class:`DPStrategy`) and FSDP2 (:class:`ShardedDPStrategy`) with DP-SGD inside."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from typing_extensions import override

from dplit.privacy.integrity import check_digests
from dplit.privacy.run_facts import NO_NOISE_WARNING
from dplit.privacy.sharded_world import ShardedProcessGroup, check_sharded_settings
from dplit.privacy.world import ProcessGroup, SingleProcess
from dplit.strategy.hooks import DPSGDHooks
from dplit.strategy.interrupted_run import INTERRUPT_CHECKPOINT

__all__ = ["INTERRUPT_CHECKPOINT", "NO_NOISE_WARNING", "DPStrategy", "ShardedDPStrategy"]


class DPStrategy(DPSGDHooks, DDPStrategy):
    """DP-SGD on one or many devices: one Lightning optimizer step is one :class:`~dplit.privacy.dpsgd.DPSGD` step.

    A Poisson logical batch (expected size = the loader's ``batch_size``, over all devices) is clipped in
    micro-batches, the clipped sums are all-reduced once with N(0, σ²C²) added once (rank 0), divided by the
    expected batch size, and the optimizer steps. Under data parallelism there is no DDP wrapper: rank 0's weights
    are broadcast at setup and each rank samples its own shard at the global rate q. The ledger is saved in every
    checkpoint and in ``privacy_ledger.json``. Its arguments are :class:`~dplit.strategy.hooks.DPSGDHooks`'
    (the fields of :class:`~dplit.privacy.settings.DPSGDSettings`) and Lightning's ``DDPStrategy``'s
    (``process_group_backend``, ``start_method``, ...).
    """

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper (its hooks would all-reduce unclipped gradients): broadcast rank 0's weights, build DP-SGD.

        Lightning calls this when fitting, after moving the model to its device and before creating the optimizers.
        """
        if self.world_size > 1:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.build_dpsgd(ProcessGroup(device=self.root_device) if self.world_size > 1 else SingleProcess())


class ShardedDPStrategy(DPSGDHooks, ModelParallelStrategy):
    """DP-SGD on weights, gradients and AdamW state sharded by FSDP2 over every device (no tensor parallelism).

    Each transformer block is one FSDP2 unit and the task the root (:func:`dplit.backbone.sharding.shard_task`).
    Each rank clips its own Poisson shard of the logical batch with the ghost engine (tied embedding included), the
    clipped sums are added over the ranks, and each rank adds the noise of its own shard of every parameter, from its
    own stream: every coordinate is noised once. Checkpoints are one file, gathered on rank 0 (the same file a
    :class:`DPStrategy` run writes, so ``dplit export`` and resuming treat them alike).

    Args:
        self_check: must stay false: the ghost self-check compares with autograd on whole weights.
        process_group_backend: the torch.distributed backend (default: NCCL on GPUs, gloo on CPUs).
        timeout: how long a collective may wait.
        **kwargs: :class:`~dplit.strategy.hooks.DPSGDHooks`' DP arguments (``clipping`` must be ``"ghost"``).
    """

    flag_owner = "ShardedDPStrategy"

    def __init__(
        self,
        *,
        self_check: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            self_check=self_check, data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
            process_group_backend=process_group_backend, timeout=timeout, **kwargs,
        )  # fmt: skip
        check_sharded_settings(self.settings)

    @override
    def setup_environment(self) -> None:
        """Shard over every device of every node: the data-parallel dimension is the whole world."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """Build DP-SGD on the sharded model (the task shards itself in ``configure_model``), then the optimizers.

        Lightning calls this when fitting, once the model is sharded and on its device.
        """
        self.build_dpsgd(ShardedProcessGroup(device=self.root_device))
        super().setup_optimizers(trainer)

    @override
    def check_loaded_digests(self, checkpoint: dict[str, Any], *, source: str) -> None:
        """Check the digests against the weights now in the sharded model, gathered on rank 0.

        Lightning's FSDP2 loader moves the file's weights into the shards and leaves them out of ``checkpoint``.
        """
        weights = self.lightning_module_state_dict()  # every rank takes part; only rank 0 receives them
        refusal = None
        if self.global_rank == 0:
            try:
                check_digests({**checkpoint, "state_dict": weights}, source=source)
            except ValueError as error:
                refusal = str(error)
        refusal = self.broadcast(refusal)
        if refusal is not None:
            raise ValueError(refusal)
