"""A world of ranks that each hold a shard of every parameter (FSDP2 ``fully_shard``): noise per shard, once.

Each rank clips its own Poisson shard of the logical batch into a whole-size clipped sum, as under data
parallelism. The sums are added over the ranks; then each rank adds N(0, σ²C²) to the rows of each parameter it
holds (dim 0, as FSDP2 shards), from its own stream, so every coordinate is noised exactly once across the world
with no noise broadcast, and hands its rows to the optimizer as the ``DTensor`` gradient of its shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings
from dplit.privacy.world import NoiseGenerator, ProcessGroup


def check_sharded_settings(settings: DPSGDSettings) -> None:
    """Refuse, in one line, the settings a sharded DP step cannot honour yet."""
    if settings.clipping != "ghost":
        raise ValueError(
            f"{FLAG_OWNER}.clipping={settings.clipping!r}: sharded weights are clipped by the ghost engine only "
            "(clipping: ghost)"
        )
    if settings.self_check:
        raise ValueError(
            f"{FLAG_OWNER}.self_check=true: the ghost self-check compares with autograd on whole weights, which a "
            "sharded model has on no rank; set self_check: false (and check a new architecture with one "
            "single-device step of dplit.strategy.DPStrategy)"
        )


class ShardedProcessGroup(ProcessGroup):
    """The default torch.distributed group, over which every trainable parameter is a dim-0-sharded ``DTensor``.

    Every rank must run the same forward passes (FSDP2 gathers each unit's weights in them), so a rank with fewer
    micro-batches runs placeholders that add zero.

    Args:
        device: where tensors for the backend live (the GPU for NCCL, the CPU for gloo).
    """

    def micro_batch_count(self, count: int) -> int:
        """The most micro-batches any rank has (one all-reduce)."""
        most = torch.tensor(count, device=self._device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def gradient_buffer(self, parameters: list[nn.Parameter], *, extra: int) -> GradientBuffer:
        """A whole-size buffer that noises and releases only this rank's shard of each parameter."""
        return ShardedGradientBuffer(parameters, extra=extra, rank=self.rank, size=self.size)

    def noisy_sum(self, buffer: GradientBuffer, *, std: float, generator: NoiseGenerator) -> None:
        """Sum the clipped sums over the ranks, then each rank noises its own shard from its own stream."""
        self.all_reduce_sum(buffer.flat)
        if std:
            buffer.add_noise(std, generator(self.rank))


class ShardedGradientBuffer(GradientBuffer):
    """A :class:`GradientBuffer` whose noise and release cover only this rank's rows of each sharded parameter.

    Args:
        parameters: the trainable parameters, each a ``DTensor`` sharded on dim 0 over a 1-D mesh.
        extra: scalar slots after the gradients.
        rank: this rank.
        size: the number of ranks the parameters are sharded over.
    """

    def __init__(self, parameters: list[nn.Parameter], *, extra: int, rank: int, size: int) -> None:
        super().__init__(parameters, extra=extra)
        self._rows = [_own_rows(param, rank, size) for param in parameters]

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        """Add N(0, std²) to this rank's rows of every parameter (the other ranks noise theirs)."""
        for view, rows in zip(self._views, self._rows, strict=True):
            own = view[rows]
            own.add_(torch.empty_like(own).normal_(0.0, std, generator=generator))

    def publish(self, scale: float) -> None:
        """Divide this rank's rows by ``scale`` and hand them to each parameter as the gradient of its shard.

        The other rows (sums of every rank's clipped gradients, noised by their own ranks only) are zeroed.
        """
        for param, view, rows in zip(self._parameters, self._views, self._rows, strict=True):
            own = view[rows].div_(scale)
            view[: rows.start].zero_()
            view[rows.stop :].zero_()
            param.grad = DTensor.from_local(
                own.to(param.dtype), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )


def _own_rows(param: nn.Parameter, rank: int, size: int) -> slice:
    """The rows of ``param`` this rank holds: FSDP2's dim-0 shard (``torch.chunk`` sizes, the last ones may be short)."""
    if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            "a sharded DP step needs every trainable parameter sharded on dim 0 by FSDP2 fully_shard over one mesh "
            f"dimension; a parameter of shape {tuple(param.shape)} is {type(param).__name__} with placements "
            f"{getattr(param, 'placements', None)}"
        )
    rows = param.shape[0]
    chunk = -(-rows // size)  # ceil: torch.chunk's size
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    if stop - start != param.to_local().shape[0]:
        raise ValueError(
            f"a sharded parameter of shape {tuple(param.shape)} holds {param.to_local().shape[0]} rows on rank {rank}, "
            f"not the {stop - start} of FSDP2's dim-0 chunks"
        )
    return slice(start, stop)
