"""The processes a DP-SGD step spans: one, or a torch.distributed group whose ranks each clip their own shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.settings import DPSGDSettings

T = TypeVar("T")

NoiseGenerator = Callable[[int], torch.Generator]
"""``generator(rank)``: a fresh generator for the noise ``rank`` draws in this step."""


class World(Protocol):
    """The collectives DP-SGD needs, where this process stands, and who draws which noise."""

    rank: int
    """This process's global rank (rank 0 draws the noise and writes the ledger)."""
    size: int
    """The number of processes that each clip a shard of every logical batch."""

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value``, on every rank (any picklable object)."""
        ...

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Replace ``tensor`` in place by its sum over the ranks (the same bits on every rank)."""
        ...

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        ...

    def all_agree(self, decision: bool) -> bool:
        """Whether every rank's ``decision`` is true."""
        ...

    def check_settings(self, settings: DPSGDSettings) -> None:
        """Refuse (``ValueError``, one line naming the flag) settings this world cannot honour."""
        ...

    def micro_batch_count(self, count: int) -> int:
        """How many micro-batches this rank runs, given its own ``count`` (more when all ranks must run alike)."""
        ...

    def gradient_buffer(self, parameters: list[nn.Parameter], *, extra: int) -> GradientBuffer:
        """The buffer the clipped sums of ``parameters`` are summed into on this rank."""
        ...

    def noisy_sum(self, buffer: GradientBuffer, *, std: float, generator: NoiseGenerator) -> None:
        """Replace the ranks' clipped sums by their sum plus N(0, std²) drawn exactly once per coordinate."""
        ...


class WholeReplicas:
    """Every rank holds whole weights: any setting runs, each rank runs its own forward passes, whole gradients."""

    def check_settings(self, settings: DPSGDSettings) -> None:
        """Every setting runs on whole replicas."""

    def micro_batch_count(self, count: int) -> int:
        """``count`` itself: each rank runs its own forward passes."""
        return count

    def gradient_buffer(self, parameters: list[nn.Parameter], *, extra: int) -> GradientBuffer:
        """A buffer of every parameter's whole gradient."""
        return GradientBuffer(parameters, extra=extra)


class SingleProcess(WholeReplicas):
    """One process: every collective is the identity."""

    rank = 0
    size = 1

    def broadcast(self, value: T) -> T:
        """``value`` itself."""
        return value

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Nothing to add."""

    def gather(self, value: T) -> list[T]:
        """``[value]``."""
        return [value]

    def all_agree(self, decision: bool) -> bool:
        """``decision`` itself."""
        return decision

    def noisy_sum(self, buffer: GradientBuffer, *, std: float, generator: NoiseGenerator) -> None:
        """Add the noise to every coordinate."""
        if std:
            buffer.add_noise(std, generator(0))


class ProcessGroup(WholeReplicas):
    """The default torch.distributed process group (initialised by the caller: Lightning, torchrun, ...).

    Args:
        device: where tensors for the backend live (the GPU for NCCL, the CPU for gloo).
    """

    def __init__(self, *, device: torch.device) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroup needs an initialised torch.distributed default group")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._device = device

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value``, pickled and sent to every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, device=self._device)
        return box[0]

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, pickled, in rank order."""
        values: list[T] = [value] * self.size
        dist.all_gather_object(values, value)
        return values

    def all_agree(self, decision: bool) -> bool:
        """Whether every rank decided true (one all-reduce of the count of ranks that did)."""
        count = torch.tensor(int(decision), device=self._device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        return int(count.item()) == self.size

    def noisy_sum(self, buffer: GradientBuffer, *, std: float, generator: NoiseGenerator) -> None:
        """Rank 0 adds the noise to its clipped sum, then one all-reduce: the same noisy bits on every rank."""
        if self.rank == 0 and std:
            buffer.add_noise(std, generator(0))
        self.all_reduce_sum(buffer.flat)
