"""Poisson sampling of logical batches: every example joins each batch independently with probability q."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from dplit.privacy.seeds import derive_seed, seeded_generator


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps`` logical batches; each example of this replica's shard is in a batch with probability q.

    Under data parallelism the dataset is split into ``num_replicas`` disjoint shards (index ``rank``,
    ``rank + num_replicas``, ...); every replica samples its own shard at the same rate q with its own
    generator stream (derived from ``seed`` and ``rank``), so every example of the whole dataset joins
    the union of the replicas' batches independently with probability q: a Poisson sample at rate q.
    Batches may be empty.

    Args:
        dataset_size: number of examples N in the whole dataset.
        sample_rate: the Poisson rate q (expected global batch size / N).
        steps: batches per epoch.
        num_replicas: number of data-parallel processes.
        rank: this process' index among them.
        seed: any integer (e.g. ``torch.initial_seed()``); the generator is seeded from (``seed``, ``rank``).
    """

    def __init__(
        self,
        *,
        dataset_size: int,
        sample_rate: float,
        steps: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
    ) -> None:
        if dataset_size < 1:
            raise ValueError("the training dataset is empty: nothing to sample")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        self._shard = torch.arange(rank, dataset_size, num_replicas)
        self._sample_rate = sample_rate
        self._steps = steps
        self._generator = seeded_generator(derive_seed(seed, rank), device=torch.device("cpu"))

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self._steps):
            chosen = torch.rand(len(self._shard), generator=self._generator) < self._sample_rate
            yield self._shard[chosen].tolist()


def poisson_loader(
    dataloader: DataLoader, *, sample_rate: float, num_replicas: int, rank: int, seed: int
) -> DataLoader:
    """``dataloader`` with its sampler replaced by Poisson sampling at rate ``sample_rate`` (same collate, workers)."""
    size = len(dataloader.dataset)  # type: ignore[arg-type]
    batch_size = dataloader.batch_size or 1
    sampler = PoissonBatchSampler(
        dataset_size=size,
        sample_rate=sample_rate,
        steps=max(1, round(size / batch_size)),
        num_replicas=num_replicas,
        rank=rank,
        seed=seed,
    )
    return with_batch_sampler(dataloader, sampler)


def with_batch_sampler(dataloader: DataLoader, sampler: Sampler[list[int]]) -> DataLoader:
    """``dataloader`` drawing its batches from ``sampler`` (the same dataset, collate and workers)."""
    return DataLoader(
        dataloader.dataset,
        batch_sampler=sampler,
        collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers,
        pin_memory=dataloader.pin_memory,
        persistent_workers=dataloader.persistent_workers,
    )


def size_and_rate(loader: DataLoader, size: int, *, users: bool) -> tuple[int, float]:
    """N and the Poisson rate q = batch_size / N (N rows, or users), refusing an empty set or a bad batch size."""
    batch = loader.batch_size
    if size == 0:
        raise ValueError("the training dataset is empty")
    if batch is None or not 0 < batch <= size:
        what = f"the expected users per batch, at most the {size} users" if users else f"at most the {size} rows"
        raise ValueError(f"data.batch_size must be in [1, {size}] ({what}), got {batch}")
    return size, batch / size
