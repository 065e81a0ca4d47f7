"""A world of ranks that each hold a shard of every parameter (FSDP2 ``fully_shard``): noise per shard, once.

Each rank clips its own Poisson shard of the logical batch. As soon as the clipping engine has one parameter's
clipped sum for a micro-batch (whole, from this rank's activations), it is reduce-scattered over the ranks into
the rows of that parameter this rank holds (dim 0, as FSDP2 shards) and freed once that is done. The reduce-scatter
runs while the engine forms the next sums (up to :data:`IN_FLIGHT_ELEMENTS` entries of whole sums in flight, or one
parameter's if it alone is larger), and its buffer holds only its own rows. Then each rank adds N(0, σ²C²) to its rows
from its own stream, so every coordinate is noised exactly once across the world with no noise broadcast, and
hands them to the optimizer as the ``DTensor`` gradient of its shard.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.refusal import DEFAULT_OWNER
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.world import NoiseGenerator, ProcessGroup

IN_FLIGHT_ELEMENTS = 1 << 24
"""Whole-sum entries a rank may leave in reduce-scatters still running while its engine forms the next sums (64 MiB
of float32); one parameter's sum larger than this runs alone."""


def check_sharded_settings(settings: DPSGDSettings) -> None:
    """Refuse, in one line, the settings a sharded DP step cannot honour yet."""
    if settings.clipping != "ghost":
        raise ValueError(
            f"{settings.flag_owner}.clipping={settings.clipping!r}: sharded weights are clipped by the ghost engine only "
            "(clipping: ghost)"
        )
    if settings.self_check:
        raise ValueError(
            f"{settings.flag_owner}.self_check=true: the ghost self-check compares with autograd on whole weights, which a "
            "sharded model has on no rank; set self_check: false (and check a new architecture with one "
            f"single-device step of {DEFAULT_OWNER})"
        )


class ShardedProcessGroup(ProcessGroup):
    """The default torch.distributed group, over which every trainable parameter is a dim-0-sharded ``DTensor``.

    Every rank must run the same forward passes (FSDP2 gathers each unit's weights in them) and hand over the same
    parameters in the same order, so a rank with fewer micro-batches runs placeholders that add zero.

    Args:
        device: where tensors for the backend live (the GPU for NCCL, the CPU for gloo).
    """

    def check_settings(self, settings: DPSGDSettings) -> None:
        """Refuse the settings a sharded step cannot honour (:func:`check_sharded_settings`)."""
        check_sharded_settings(settings)

    def micro_batch_count(self, count: int) -> int:
        """The most micro-batches any rank has (one all-reduce)."""
        most = torch.tensor(count, device=self._device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def gradient_buffer(self, parameters: list[nn.Parameter], *, extra: int) -> GradientBuffer:
        """A buffer of this rank's rows of each parameter, filled by reduce-scatters."""
        return ShardedGradientBuffer(parameters, extra=extra, rank=self.rank, size=self.size)

    def noisy_sum(self, buffer: GradientBuffer, *, std: float, generator: NoiseGenerator) -> None:
        """The rows are already summed over the ranks: each rank noises its own from its own stream."""
        self.all_reduce_sum(buffer.extra)
        if std:
            buffer.add_noise(std, generator(self.rank))


class ShardedGradientBuffer(GradientBuffer):
    """A :class:`GradientBuffer` of this rank's rows of each sharded parameter, summed over the ranks.

    While attached, every ``param.grad`` starts as ``None``: the engine forms one parameter's whole sum at a time,
    and :meth:`receive` reduce-scatters it into the rows here.

    Args:
        parameters: the trainable parameters, each a ``DTensor`` sharded on dim 0 over a 1-D mesh.
        extra: scalar slots after the gradients.
        rank: this rank.
        size: the number of ranks the parameters are sharded over.
    """

    def __init__(self, parameters: list[nn.Parameter], *, extra: int, rank: int, size: int) -> None:
        for param in parameters:
            _check_dim0_shard(param, rank, size)
        super().__init__(parameters, extra=extra)
        self._size = size
        self._in_flight: deque[tuple[dist.Work, Tensor, Tensor, Tensor]] = deque()  # (work, view, rows, whole sum)

    @staticmethod
    def held_shape(param: nn.Parameter) -> torch.Size:
        """The shape of this rank's shard of ``param`` (its local tensor)."""
        return param.to_local().shape if isinstance(param, DTensor) else param.shape

    def attach(self) -> None:
        """Zero the buffer; every ``grad`` is ``None``, so the engine forms each whole sum for :meth:`receive`.

        Raises:
            RuntimeError: if reduce-scatters of an earlier step are still pending (its ``detach`` failed): their rows
                must never land in this step's sum.
        """
        if self._in_flight:
            raise RuntimeError("a sharded DP step started while an earlier step's reduce-scatters were pending")
        self.flat.zero_()
        for param in self._parameters:
            param.grad = None

    def receive(self, param: nn.Parameter) -> None:
        """Reduce-scatter ``param``'s whole micro-batch sum over the ranks into this rank's rows, and free it."""
        whole, param.grad = param.grad, None
        view = self._views[self._index[id(param)]]
        chunk = -(-param.shape[0] // self._size)  # FSDP2's dim-0 chunk: torch.chunk's size
        padded = (chunk * self._size, *param.shape[1:])  # [W·chunk, ...]: W equal chunks, the last rows zero
        if whole is not None and whole.shape == padded and whole.dtype == view.dtype and whole.is_contiguous():
            stacked = whole
        else:
            stacked = view.new_zeros(padded)
            if whole is not None:
                stacked[: param.shape[0]] = whole
            del whole  # only the padded copy stays alive while it is reduce-scattered
        summed = view.new_empty((chunk, *param.shape[1:]))  # [chunk, ...]: this rank's chunk, summed over ranks
        work = dist.reduce_scatter_single(summed, stacked, async_op=True)
        self._in_flight.append((work, view, summed, stacked))  # the whole sum lives until the work is done
        while len(self._in_flight) > 1 and sum(whole.numel() for *_, whole in self._in_flight) > IN_FLIGHT_ELEMENTS:
            self._finish_oldest()

    def detach(self) -> None:
        """Finish every reduce-scatter still running, in the order they started; every ``grad`` is ``None``.

        If a wait fails, the works after it are dropped (their rows never land here) and the error propagates.
        """
        try:
            while self._in_flight:
                self._finish_oldest()
        finally:
            self._in_flight.clear()
        super().detach()

    def _finish_oldest(self) -> None:
        """Wait for the oldest reduce-scatter and add its rows into the buffer (a parameter's sums in their order)."""
        work, view, summed, _ = self._in_flight.popleft()
        work.wait()
        view.add_(summed[: view.shape[0]])  # a short last shard holds fewer rows than the chunk

    def publish(self, scale: float) -> None:
        """Divide this rank's rows by ``scale`` and hand them to each parameter as the gradient of its shard."""
        for param, view in zip(self._parameters, self._views, strict=True):
            own = view.div_(scale)
            param.grad = DTensor.from_local(
                own.to(param.dtype), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )


def _check_dim0_shard(param: nn.Parameter, rank: int, size: int) -> None:
    """Refuse a ``param`` that is not FSDP2's dim-0 shard (``torch.chunk`` sizes, the last ones may be short)."""
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
