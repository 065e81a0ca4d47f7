"""Packing sampled documents into rows of ``max_length`` tokens, each document isolated and its own privacy unit.

A logical batch of documents (token ids and loss masks, after Poisson sampling) is laid into rows by first-fit
decreasing: documents longest first, each into the first row with room, a new row when none has. A document longer
than a row takes rows of its own, cut into row-sized pieces (each piece attends to itself only, as the padded run's
rows of one user do), and all its pieces are one privacy unit. Every row says, per token:

* ``segment_ids``: which document of the batch the token belongs to (-1: padding), so the model attends within a
  document only (block-diagonal causal attention, :mod:`dplit.backbone.isolation`);
* ``position_ids``: positions restarting at 0 at each document (and at each piece of a long one);
* :data:`~dplit.privacy.clipping.token_units.TOKEN_UNIT_KEY`: the token's privacy unit (its document, or its user
  under user-level DP; -1: padding), which the ghost engine clips as one example;
* :data:`~dplit.privacy.clipping.units.UNIT_KEY` [R]: rows that must stay in one micro-batch (a long document's rows,
  or a user's rows) share a value.

Under user-level DP each user's documents are packed into rows of their own, so a user's rows hold no other user.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dplit.backbone.isolation import POSITION_KEY, SEGMENT_KEY
from dplit.privacy.clipping.token_units import TOKEN_UNIT_KEY
from dplit.privacy.clipping.units import UNIT_KEY


@dataclass(frozen=True)
class Piece:
    """One stretch of a document in a row: tokens ``start:stop`` of document ``document``."""

    document: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        """The number of tokens of the piece."""
        return self.stop - self.start


def first_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[Piece]]:
    """Rows of pieces of documents of ``lengths`` tokens, each row at most ``max_length`` tokens.

    Documents are placed longest first (ties in order), each into the first row with room; a document longer than
    ``max_length`` is cut into pieces of ``max_length`` (its last piece shorter), each in a row of its own.
    """
    if max_length < 1:
        raise ValueError(f"data.max_length={max_length}: rows must hold at least one token")
    rows: list[list[Piece]] = []
    room: list[int] = []
    for document in sorted(range(len(lengths)), key=lambda index: -lengths[index]):
        length = lengths[document]
        if length > max_length:
            rows.extend(
                [Piece(document, start, min(start + max_length, length))] for start in range(0, length, max_length)
            )
            room.extend(0 for _ in range(0, length, max_length))  # a long document's rows hold nothing else
            continue
        target = next((index for index, free in enumerate(room) if free >= length), None)
        if target is None:
            rows.append([])
            room.append(max_length)
            target = len(rows) - 1
        rows[target].append(Piece(document, 0, length))
        room[target] -= length
    return rows


@dataclass(frozen=True)
class PackedRows:
    """A packed batch and how full its rows are.

    Attributes:
        batch: the tensors of the rows (see the module docstring).
        tokens: real tokens in the rows.
        capacity: rows × row length.
    """

    batch: dict[str, Tensor]
    tokens: int
    capacity: int

    @property
    def fill(self) -> float:
        """The fraction of row positions holding a real token (1.0 for an empty batch)."""
        return self.tokens / self.capacity if self.capacity else 1.0


def pack_documents(
    documents: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    pad_token_id: int,
    users: Sequence[int] | None = None,
) -> PackedRows:
    """Pack tokenised documents (``input_ids``, ``loss_mask``) into rows of ``max_length`` tokens.

    Args:
        documents: the logical batch's documents.
        max_length: the row length T.
        pad_token_id: token id of padded positions.
        users: each document's user (user-level DP: a user's documents are packed into rows of their own and the
            user is the privacy unit); ``None``: each document is its own unit.

    Returns:
        The rows: ``input_ids``, ``attention_mask``, ``loss_mask``, ``segment_ids``, ``position_ids``,
        the token units [R, T] and the row groups [R].
    """
    layout: list[tuple[int, list[Piece]]] = []  # (row group, pieces)
    for user, members in enumerate(_groups(len(documents), users)):
        lengths = [len(documents[index]["input_ids"]) for index in members]
        for row in first_fit_decreasing(lengths, max_length):
            continued = row[0].start > 0  # a long document's later piece: in its first piece's group
            group = user if users is not None else layout[-1][0] if continued else len(layout)
            layout.append((group, [Piece(members[p.document], p.start, p.stop) for p in row]))
    width = max_length if layout else 1
    shape = (len(layout), width)
    batch = {
        "input_ids": torch.full(shape, pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros(shape, dtype=torch.long),
        "loss_mask": torch.zeros(shape, dtype=torch.long),
        SEGMENT_KEY: torch.full(shape, -1, dtype=torch.long),
        POSITION_KEY: torch.zeros(shape, dtype=torch.long),
        TOKEN_UNIT_KEY: torch.full(shape, -1, dtype=torch.long),
        UNIT_KEY: torch.tensor([group for group, _ in layout], dtype=torch.long),
    }
    tokens = 0
    for row, (_, pieces) in enumerate(layout):
        at = 0
        for piece in pieces:
            span = slice(at, at + piece.length)
            document = documents[piece.document]
            batch["input_ids"][row, span] = torch.tensor(document["input_ids"][piece.start : piece.stop])
            batch["loss_mask"][row, span] = torch.tensor(document["loss_mask"][piece.start : piece.stop])
            batch["attention_mask"][row, span] = 1
            batch[SEGMENT_KEY][row, span] = piece.document
            batch[POSITION_KEY][row, span] = torch.arange(piece.length)
            batch[TOKEN_UNIT_KEY][row, span] = piece.document if users is None else users[piece.document]
            at += piece.length
        tokens += at
    return PackedRows(batch=batch, tokens=tokens, capacity=len(layout) * max_length)


def _groups(count: int, users: Sequence[int] | None) -> list[list[int]]:
    """The documents packed together: all of them, or each user's (users in order of first appearance)."""
    if users is None:
        return [list(range(count))] if count else []
    if len(users) != count:
        raise ValueError(f"{len(users)} users for {count} documents")
    by_user: dict[int, list[int]] = {}
    for index, user in enumerate(users):
        by_user.setdefault(user, []).append(index)
    return list(by_user.values())


class PackingCollator:
    """The training collate function of ``data.packing=true``: a sampled logical batch, packed into rows.

    It also keeps how full the rows it packed were (a diagnostic of the private data, computed without noise: said
    in the run's output only, never written to the ledger or the card).

    Args:
        max_length: the row length (``data.max_length``).
        pad_token_id: token id of padded positions.
    """

    def __init__(self, *, max_length: int, pad_token_id: int) -> None:
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.rows = 0
        self.tokens = 0

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        """Pack ``examples`` (each with ``input_ids`` and ``loss_mask``, and ``user`` under user-level DP)."""
        users = [example["user"] for example in examples] if examples and "user" in examples[0] else None
        packed = pack_documents(examples, max_length=self.max_length, pad_token_id=self.pad_token_id, users=users)
        self.rows += packed.capacity // self.max_length
        self.tokens += packed.tokens
        return packed.batch

    def ledger_facts(self) -> dict[str, str]:
        """What the ledger and the card say of packing (public: the row length and the isolation, no data)."""
        return {
            "packing": f"documents packed into rows of {self.max_length} tokens, each isolated (block-diagonal causal "
            "attention, positions restarting) and clipped as its own unit (or with its user's other documents)"
        }

    def summary(self) -> str:
        """How full the packed rows were, in one line (or that this process packed none)."""
        if not self.rows:
            return "packing: no rows were packed in this process (with data.num_workers > 0 the workers pack them)"
        fill = self.tokens / (self.rows * self.max_length)
        return (
            f"packing: {self.rows} rows of {self.max_length} tokens were {fill:.1%} full (a diagnostic of the private "
            "data, without noise)"
        )
