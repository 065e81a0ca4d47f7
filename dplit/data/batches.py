"""Tokenised examples as a map-style dataset, and the collate function that pads them into batches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NotRequired, TypedDict, TypeVar

import torch
from torch import Tensor
from torch.utils.data import Dataset

from dplit.privacy.clipping.units import UNIT_KEY
from dplit.privacy.user_sampling import UnitDataset

ItemT = TypeVar("ItemT", bound=Mapping[str, object])


class Example(TypedDict):
    """One tokenised example: prompt token ids, class index and, under user-level DP, its user (0..U-1)."""

    input_ids: list[int]
    label: int
    user: NotRequired[int]


class UnitItems(Dataset[ItemT], UnitDataset):
    """Tokenised items that declare their privacy unit (:class:`~dplit.privacy.user_sampling.UnitDataset`).

    An item is one example (``privacy_unit = "example"``); with users, each item also carries its user, 0..U-1
    (DP-SGD then samples and clips by user).

    Args:
        items: the tokenised items.
        users: each item's user, 0..U-1 (``None``: each item is its own privacy unit).
        max_rows_per_user: the most items of one user in one DP step (``data.max_rows_per_user``).
    """

    privacy_unit = "example"

    def __init__(self, items: Sequence[ItemT], *, users: list[int] | None = None, max_rows_per_user: int = 1) -> None:
        if users is not None and len(users) != len(items):
            raise ValueError(f"{len(users)} users but {len(items)} items")
        self.items = items
        self.users = users
        self.max_rows_per_user = max_rows_per_user

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> ItemT:
        item = self.items[index]
        return item if self.users is None else {**item, "user": self.users[index]}  # type: ignore[return-value]


class TokenizedDataset(UnitItems[Example]):
    """Already tokenised prompts with their class indices (and users: DP-SGD then samples and clips by user).

    Args:
        input_ids: token ids of each prompt.
        labels: class index of each example.
        users: each example's user, 0..U-1 (``None``: each example is its own privacy unit).
        max_rows_per_user: the most rows of one user in one DP step (``data.max_rows_per_user``).
    """

    def __init__(
        self,
        input_ids: list[list[int]],
        labels: list[int],
        *,
        users: list[int] | None = None,
        max_rows_per_user: int = 1,
    ) -> None:
        if len(input_ids) != len(labels):
            raise ValueError(f"{len(input_ids)} prompts but {len(labels)} labels")
        self.input_ids, self.labels = input_ids, labels
        examples = [Example(input_ids=ids, label=label) for ids, label in zip(input_ids, labels, strict=True)]
        super().__init__(examples, users=users, max_rows_per_user=max_rows_per_user)


class PadCollator:
    """Pads a list of examples to the longest one (dynamic padding) on the chosen side.

    An empty list (a Poisson-sampled batch may be empty) gives tensors with batch dimension 0:
    ``input_ids`` and ``attention_mask`` of shape [0, 1], ``labels`` of shape [0].

    Args:
        pad_token_id: token id written at padded positions (their attention mask is 0).
        padding_side: ``"right"`` pads after the prompt, ``"left"`` before it.
    """

    def __init__(self, pad_token_id: int, padding_side: Literal["right", "left"] = "right") -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f"data.padding_side must be 'right' or 'left', got {padding_side!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, examples: Sequence[Example]) -> dict[str, Tensor]:
        """Batch ``examples``.

        Args:
            examples: tokenised examples.

        Returns:
            ``input_ids`` LongTensor[B, T], ``attention_mask`` LongTensor[B, T] (1 = real token) and
            ``labels`` LongTensor[B], T the longest prompt (at least 1).
        """
        input_ids, attention_mask = pad_token_rows(
            [e["input_ids"] for e in examples], self.pad_token_id, self.padding_side
        )
        labels = torch.tensor([example["label"] for example in examples], dtype=torch.long)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return {**batch, **user_field(examples)}


def user_field(examples: Sequence[Mapping[str, object]]) -> dict[str, Tensor]:
    """``{UNIT_KEY: [B] users}`` when the examples carry users (user-level DP), else nothing."""
    if not examples or "user" not in examples[0]:
        return {}
    return {UNIT_KEY: torch.tensor([example["user"] for example in examples], dtype=torch.long)}


def pad_token_rows(rows: Sequence[Sequence[int]], fill: int, side: str) -> tuple[Tensor, Tensor]:
    """Rows of integers padded with ``fill`` to the longest (at least 1) on ``side``, and where the real values are.

    Returns:
        The padded LongTensor[B, T] and the mask LongTensor[B, T] (1 = a real value).
    """
    width = max(max((len(row) for row in rows), default=1), 1)
    padded = torch.full((len(rows), width), fill, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for index, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        padded[index, span] = torch.tensor(row, dtype=torch.long)
        mask[index, span] = 1
    return padded, mask
