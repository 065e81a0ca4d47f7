"""TrainingUnits: what DP-SGD samples, clips and counts: examples, preference pairs or users, N of them, at rate q.

A dataset's items are its units (an example; a preference pair, two rows clipped as one), unless the dataset declares
users (:func:`~dplit.privacy.user_sampling.user_level_of`): then a user, all of its rows, is the unit, Poisson sampling
draws users and each sampled user brings at most k rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import DataLoader

from dplit.privacy.fingerprint import IndexedRows
from dplit.privacy.sampling import poisson_loader, size_and_rate
from dplit.privacy.user_sampling import UnitDataset, UserLevel, user_level_of, user_poisson_loader

PAIR_UNIT = "pair"
"""The privacy unit of a dataset of preference pairs (each item two rows clipped as one unit)."""


def row_unit_of(dataset: object) -> str:
    """The unit a dataset without users samples and clips by: ``"pair"`` when it declares pairs, else ``"example"``."""
    return PAIR_UNIT if isinstance(dataset, UnitDataset) and dataset.privacy_unit == PAIR_UNIT else "example"


@runtime_checkable
class PackingCollate(Protocol):
    """A collate function that packs documents into rows (:class:`~dplit.data.packing.PackingCollator`)."""

    def ledger_facts(self) -> dict[str, str]:
        """What the ledger and the card say of the packing: public settings only, nothing about the data."""
        ...


@dataclass(frozen=True)
class TrainingUnits:
    """The privacy unit of a training set, its count N and the Poisson rate q.

    Attributes:
        name: ``"example"``, ``"pair"`` or ``"user"``.
        item: what one item of the dataset is, ``"example"`` or ``"pair"`` (a user's items, under ``"user"``).
        size: N, the number of units.
        sample_rate: q = expected units per logical batch / N.
        rows: the training rows, by index.
        users: who owns each row (``None`` unless the unit is the user).
        packing: the packing's public facts when the loader packs documents into rows (``{}``: one unit a row, or a
            user's rows).
    """

    name: str
    item: str
    size: int
    sample_rate: float
    rows: IndexedRows
    users: UserLevel | None = None
    packing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, loader: DataLoader) -> TrainingUnits:
        """The units of ``loader``'s dataset, with q = ``loader.batch_size`` / N (refusing an empty set or bad batch)."""
        users = user_level_of(loader.dataset)
        count = users.users if users is not None else len(loader.dataset)  # type: ignore[arg-type]
        size, rate = size_and_rate(loader, count, users=users is not None)
        item = row_unit_of(loader.dataset)
        name = "user" if users is not None else item
        collate = loader.collate_fn
        packing = collate.ledger_facts() if isinstance(collate, PackingCollate) else {}
        return cls(
            name=name,
            item=item,
            size=size,
            sample_rate=rate,
            rows=loader.dataset,
            users=users,
            packing=packing,  # type: ignore[arg-type]
        )

    @property
    def expected_batch_size(self) -> float:
        """q·N: the expected units of one logical batch."""
        return self.sample_rate * self.size

    def poisson_loader(self, loader: DataLoader, *, num_replicas: int, rank: int, seed: int) -> DataLoader:
        """``loader`` drawing Poisson batches of these units (this rank's shard; a sampled user brings ≤ k rows)."""
        where = {"num_replicas": num_replicas, "rank": rank, "seed": seed}
        if self.users is not None:
            return user_poisson_loader(loader, level=self.users, sample_rate=self.sample_rate, **where)
        return poisson_loader(loader, sample_rate=self.sample_rate, **where)

    def facts(self, *, private_diagnostics: bool) -> dict[str, Any]:
        """The unit's facts: ``privacy_unit``, and the user-level counts (``private_diagnostics``: largest user's rows).

        A user's items are preference pairs when the dataset's items are pairs: ``"user_rows": "pairs"`` says so.
        """
        if self.users is None:
            return {"privacy_unit": self.name}
        facts = self.users.facts(private_diagnostics=private_diagnostics)
        return {**facts, "user_rows": "pairs"} if self.item == PAIR_UNIT else facts
