"""Poisson sampling of users (user-level DP): each user joins a logical batch with probability q, with ≤ k rows.

Each step every user of this replica's shard is sampled independently at rate q (q = expected users per batch /
number of users); a sampled user brings at most k of its rows, chosen uniformly at random among them each time it
is sampled, so a user's rows are seen over the epochs while its contribution to any step is bounded. Users, not
rows, are sharded over data-parallel replicas (user j on rank j mod W): no user is ever split across ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Sampler

from dplit.privacy.sampling import with_batch_sampler
from dplit.privacy.seeds import derive_seed, seeded_generator


@dataclass(frozen=True)
class UserLevel:
    """A training set whose privacy unit is the user: who owns each row, and how many rows a step takes of each.

    Attributes:
        user_rows: the row indices of each user (users numbered 0..U-1).
        max_rows_per_user: k, the most rows of one user in one step (``data.max_rows_per_user``).
    """

    user_rows: list[list[int]]
    max_rows_per_user: int

    @property
    def users(self) -> int:
        """The number of users U (the N of the accounting)."""
        return len(self.user_rows)

    @property
    def largest_user_rows(self) -> int:
        """The most rows any one user owns (computed from the private data without noise: not covered by ε)."""
        return max((len(rows) for rows in self.user_rows), default=0)

    def facts(self, *, private_diagnostics: bool) -> dict[str, Any]:
        """What the ledger and the card record about the unit: the unit, N, k (and the largest user's row count).

        No user id and no other per-user count is ever recorded.

        Args:
            private_diagnostics: record the largest user's row count. It is computed from the private data without
                noise and changes when that user joins or leaves, so it sits outside ε; ``False``
                (``private_diagnostics: false``) leaves it out.
        """
        facts: dict[str, Any] = {
            "privacy_unit": "user",
            "users": self.users,
            "max_rows_per_user": self.max_rows_per_user,
        }
        return {**facts, "largest_user_rows": self.largest_user_rows} if private_diagnostics else facts


@runtime_checkable
class UnitDataset(Protocol):
    """What a training set declares about its privacy unit: the one interface DP-SGD reads of a dataset.

    A dataset that does not declare it (any plain ``Dataset``) is sampled and clipped by example.

    Attributes:
        privacy_unit: what one item is: ``"example"`` (a row) or ``"pair"`` (a preference pair, two rows clipped as
            one unit).
        users: each item's user, 0..U-1, under user-level DP (DP-SGD then samples and clips users); ``None``: each
            item is its own unit.
        max_rows_per_user: k, the most items of one user in one step (``data.max_rows_per_user``).
    """

    privacy_unit: str
    users: Sequence[int] | None
    max_rows_per_user: int


def user_level_of(dataset: object) -> UserLevel | None:
    """The user-level structure a training dataset declares (a :class:`UnitDataset` with users), if any."""
    if not isinstance(dataset, UnitDataset) or dataset.users is None:
        return None
    return UserLevel(user_rows=rows_of_users(dataset.users), max_rows_per_user=int(dataset.max_rows_per_user))


def user_poisson_loader(
    dataloader: DataLoader, *, level: UserLevel, sample_rate: float, num_replicas: int, rank: int, seed: int
) -> DataLoader:
    """``dataloader`` with its sampler replaced by Poisson sampling of users (same collate, workers)."""
    sampler = UserPoissonBatchSampler(
        user_rows=level.user_rows,
        sample_rate=sample_rate,
        max_rows_per_user=level.max_rows_per_user,
        steps=max(1, round(level.users / (dataloader.batch_size or 1))),
        num_replicas=num_replicas,
        rank=rank,
        seed=seed,
    )
    return with_batch_sampler(dataloader, sampler)


def rows_of_users(users: Sequence[int]) -> list[list[int]]:
    """The row indices of each user, users numbered 0..U-1 by ``users`` (each row's user)."""
    grouped: list[list[int]] = [[] for _ in range(max(users, default=-1) + 1)]
    for row, user in enumerate(users):
        grouped[user].append(row)
    return grouped


class UserPoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps`` logical batches of rows: each user of this replica's shard with probability q, ≤ k rows each.

    Args:
        user_rows: the row indices of each user of the whole dataset (every user at least one row).
        sample_rate: the Poisson rate q over users (expected users per batch / number of users).
        max_rows_per_user: k, the most rows a sampled user brings to a batch.
        steps: batches per epoch.
        num_replicas: number of data-parallel processes.
        rank: this process' index among them.
        seed: any integer; the generator is seeded from (``seed``, ``rank``).
    """

    def __init__(
        self,
        *,
        user_rows: Sequence[Sequence[int]],
        sample_rate: float,
        max_rows_per_user: int,
        steps: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
    ) -> None:
        if not user_rows or any(len(rows) == 0 for rows in user_rows):
            raise ValueError("user-level sampling needs at least one user, and every user at least one row")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if max_rows_per_user < 1:
            raise ValueError(f"data.max_rows_per_user must be ≥ 1, got {max_rows_per_user}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        self._users = [torch.tensor(list(rows)) for rows in user_rows[rank::num_replicas]]  # this rank's users
        self._sample_rate = sample_rate
        self._max_rows = max_rows_per_user
        self._steps = steps
        self._generator = seeded_generator(derive_seed(seed, "users", rank), device=torch.device("cpu"))

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self._steps):
            chosen = torch.rand(len(self._users), generator=self._generator) < self._sample_rate
            batch: list[int] = []
            for user in chosen.nonzero().flatten().tolist():
                batch.extend(self._rows_of(self._users[user]))
            yield batch

    def _rows_of(self, rows: torch.Tensor) -> list[int]:
        """At most k of a sampled user's rows, uniformly at random without replacement."""
        if len(rows) <= self._max_rows:
            return rows.tolist()
        return rows[torch.randperm(len(rows), generator=self._generator)[: self._max_rows]].tolist()
