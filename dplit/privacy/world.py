"""The processes a DP-SGD step spans: one, or a torch.distributed group whose ranks each clip their own shard."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


class World(Protocol):
    """The three collectives DP-SGD needs, and where this process stands."""

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

    def all_agree(self, decision: bool) -> bool:
        """Whether every rank's ``decision`` is true."""
        ...


class SingleProcess:
    """One process: every collective is the identity."""

    rank = 0
    size = 1

    def broadcast(self, value: T) -> T:
        """``value`` itself."""
        return value

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Nothing to add."""

    def all_agree(self, decision: bool) -> bool:
        """``decision`` itself."""
        return decision


class ProcessGroup:
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

    def all_agree(self, decision: bool) -> bool:
        """Whether every rank decided true (one all-reduce of the count of ranks that did)."""
        count = torch.tensor(int(decision), device=self._device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        return int(count.item()) == self.size
