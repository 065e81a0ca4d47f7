"""PreferenceDataModule: preference pairs (``prompt``, ``chosen``, ``rejected``) for private DPO, a pair per unit.

Each item of the dataset is one pair, so DP-SGD's Poisson sampling draws pairs (q = expected pairs per batch /
number of pairs) and the accounting counts pairs. The collate function lays each pair out as two rows, the chosen
answer then the rejected one, each the prompt's tokens followed by the answer's (the loss mask marks the answer),
and gives both rows the pair's id in ``batch["privacy_unit"]``: the clipping engines clip the pair as one unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from dplit.data.batches import PadCollator, UnitItems, pad_token_rows
from dplit.data.conversation import render_conversations
from dplit.data.datamodule import BUILTIN, CorpusDataModule
from dplit.data.files import Record, read_records, record_user, records_to_rows, refusal
from dplit.data.preference_set import PreferenceRow, make_preference_split
from dplit.data.sources import load_hub_dataset
from dplit.privacy.clipping.units import UNIT_KEY
from dplit.privacy.training_units import PAIR_UNIT
from dplit.tasks.preference import CHOSEN_KEY

COLUMNS = ("prompt", "chosen", "rejected")


class PreferencePair(TypedDict):
    """One tokenised pair: each answer's row (prompt then answer) and the mask of its answer tokens."""

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    user: NotRequired[int]


class PreferenceDataset(UnitItems[PreferencePair]):
    """Tokenised preference pairs; each item (a pair, two rows) is one privacy unit, or each user's pairs are.

    Args:
        items: the tokenised pairs.
        users: each pair's user, 0..U-1 (``None``: each pair is its own privacy unit).
        max_rows_per_user: k, the most pairs of one user in one DP step (``data.max_rows_per_user``).

    Attributes:
        privacy_unit: ``"pair"``: without users DP-SGD samples items and its ledger, history and card count pairs.
    """

    privacy_unit = PAIR_UNIT


class PreferenceCollator(PadCollator):
    """Two rows per pair (chosen, then rejected), padded to the longest, both rows carrying the pair's unit id.

    The unit id is the pair's place in the batch, or under user-level DP its user (all of a user's pairs one unit).

    An empty list (a Poisson batch may be empty) gives tensors of batch size 0.
    """

    @override
    def __call__(self, pairs: Sequence[PreferencePair]) -> dict[str, Tensor]:  # type: ignore[override]
        """``input_ids``, ``attention_mask``, ``loss_mask`` [2P, T]; ``chosen`` and ``privacy_unit`` [2P]."""
        ids = [row for pair in pairs for row in (pair["chosen_ids"], pair["rejected_ids"])]
        masks = [row for pair in pairs for row in (pair["chosen_mask"], pair["rejected_mask"])]
        input_ids, attention_mask = pad_token_rows(ids, self.pad_token_id, self.padding_side)
        loss_mask, _ = pad_token_rows(masks, 0, self.padding_side)
        chosen = torch.tensor([1, 0] * len(pairs), dtype=torch.long)
        owners = [pair["user"] for pair in pairs] if pairs and "user" in pairs[0] else list(range(len(pairs)))
        units = torch.tensor(owners, dtype=torch.long).repeat_interleave(2)  # a pair's two rows: one unit (or user)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
                CHOSEN_KEY: chosen, UNIT_KEY: units}  # fmt: skip


@dataclass(frozen=True)
class PreferenceRows:
    """Raw pairs of one split, where they came from, and each one's file line (local files)."""

    rows: list[PreferenceRow]
    source: str
    lines: list[int] | None = None
    users: list[str] | None = None


class PreferenceDataModule(CorpusDataModule):
    """Preference pairs for private DPO (``dplit dpo``): the built-in set, local files or a hub dataset, a pair an item.

    A local file is a ``.jsonl`` / ``.json`` / ``.csv`` file with ``prompt``, ``chosen`` and ``rejected`` columns
    (the names TRL and hub preference sets use); a hub dataset (``data.dataset``, :func:`read_hub_pairs`) has the
    same columns; ``batch_size`` counts pairs (each pair is two rows), and
    ``max_length`` bounds each row (prompt and answer, end-of-text token included). A prompt that leaves no room
    for an answer is always refused.

    Args:
        builtin_train_size: training pairs of the built-in set (:mod:`dplit.data.preference_set`).
        builtin_val_size: validation pairs of the built-in set.
        privacy_unit: ``"pair"`` (each preference pair is protected) or ``"user"`` (each user with all of its pairs).
        **kwargs: the options of :class:`~dplit.data.datamodule.CorpusDataModule` (``dataset``, ``train_file``,
            ``val_file``, ``overlength``) and of every DataModule (:class:`~dplit.data.datamodule.DPDataModule`).
    """

    UNITS = (PAIR_UNIT, "user")
    COLLATOR = PreferenceCollator
    DATASET = PreferenceDataset
    ITEMS = "preference pairs"

    def __init__(
        self,
        builtin_train_size: int = 2000,
        builtin_val_size: int = 200,
        privacy_unit: Literal["pair", "user"] = "pair",
        **kwargs: Any,
    ) -> None:
        super().__init__(privacy_unit=privacy_unit, **kwargs)

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation pairs (``dplit dpo test``)."""
        return self.val_dataloader()

    @override
    def encode(self, rows: PreferenceRows) -> list[PreferencePair]:  # type: ignore[override]
        """A pair an item (:func:`encode_pairs`)."""
        return encode_pairs(rows, self.tokenizer, self.max_length, self.hparams.overlength)

    @override
    def read(self, split: str) -> PreferenceRows:
        hp, file = self.hparams, self.local_file(split)
        if file is not None:
            return read_preference_file(
                file, self.limit(split), user_column=self.user_column_of(split), tokenizer=self.tokenizer
            )
        if hp.dataset != BUILTIN:
            return read_hub_pairs(
                hp.dataset, split, self.limit(split), user_column=self.user_column_of(split), tokenizer=self.tokenizer
            )
        rows = make_preference_split(
            split, self.builtin_size(split, hp.builtin_train_size, hp.builtin_val_size), hp.seed
        )
        return PreferenceRows(rows, f"builtin preference set [{split}, seed={hp.seed}]")


def read_preference_file(
    path: Path,
    limit: int | None = None,
    *,
    user_column: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreferenceRows:
    """The ``prompt``, ``chosen`` and ``rejected`` columns of a local JSONL / JSON / CSV file (``files.py``'s readers).

    Rows whose columns are lists of messages are rendered with ``tokenizer``'s chat template (:mod:`~dplit.data.conversation`).

    Raises:
        ValueError: one line naming the file (and the row) for what ``read_records`` refuses, a missing column or a
            value that is not a string.
    """
    if path.suffix.lower() == ".txt":
        raise refusal(path, "a .txt file has no prompt, chosen and rejected columns; use a .jsonl, .json or .csv file")
    return _records_to_pairs(path, read_records(path, COLUMNS, limit), user_column, tokenizer)


def read_hub_pairs(
    name: str,
    split: str,
    limit: int | None = None,
    *,
    user_column: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreferenceRows:
    """The ``prompt``, ``chosen`` and ``rejected`` columns of a hub dataset's split (``data.dataset``).

    The dataset is loaded with ``datasets.load_dataset(name)`` (:func:`~dplit.data.sources.load_hub_dataset`), so
    ``name`` is a hub name or anything ``load_dataset`` reads (a local dataset folder). Its rows then go through the
    same checks as a local file's rows, a row named ``row 3`` of ``name [split]``. Preference sets on the hub often
    ship ``train`` and ``test`` only: the ``validation`` split is read from ``test`` when there is no ``validation``.

    Raises:
        ValueError: one line naming ``data.dataset`` when the dataset cannot be loaded or lacks the split, else the
            refusals of a local file (a missing column, a value that is neither text nor a list of messages, a
            missing user id), naming the dataset, the split and the row.
    """
    splits = load_hub_dataset(name, "data.dataset")
    chosen = split if split in splits or split != "validation" else "test"
    if chosen not in splits:
        raise ValueError(f"data.dataset={name!r} has no {split!r} split (it has {sorted(splits)})")
    table = splits[chosen]
    if limit is not None:
        table = table.select(range(min(limit, len(table))))
    source = f"{name} [{chosen}]"
    if user_column is not None and user_column not in table.column_names:
        raise refusal(
            source, f"missing column(s) [{user_column!r}]; the dataset has {table.column_names} (data.user_column)"
        )
    records = [Record(number, dict(row), unit="row") for number, row in enumerate(table, start=1)]
    if not records:
        raise ValueError(f"{source} has no rows (data.dataset)")
    return _records_to_pairs(source, records, user_column, tokenizer)


def _records_to_pairs(
    source: Path | str, records: list[Record], user_column: str | None, tokenizer: PreTrainedTokenizerBase | None
) -> PreferenceRows:
    """The pairs of a file's or a hub split's records: conversations rendered, the three columns checked as text."""
    records = render_conversations(source, records, tokenizer) if tokenizer is not None else records
    first = records_to_rows(source, records, COLUMNS)  # checks all three columns; gathers prompt and chosen
    rejected = records_to_rows(source, records, ("rejected",)).texts or []
    rows = [PreferenceRow(*values) for values in zip(first.prompts or [], first.responses or [], rejected, strict=True)]
    users = [record_user(source, record, user_column) for record in records] if user_column is not None else None
    return PreferenceRows(rows, str(source), first.lines, users)


def encode_pairs(
    rows: PreferenceRows, tokenizer: PreTrainedTokenizerBase, max_length: int, overlength: str
) -> list[PreferencePair]:
    """Tokenise every pair (prompt + answer + end-of-text per row), refusing a pair DPO cannot learn from."""
    pairs = []
    for index, row in enumerate(rows.rows):
        where = _row(rows, index)
        for name in ("chosen", "rejected"):
            if not str(getattr(row, name)).strip():
                raise refusal(rows.source, f"empty {name} answer", where)
        if row.chosen.strip() == row.rejected.strip():
            raise refusal(rows.source, "the chosen and rejected answers are the same: the pair prefers nothing", where)
        prompt_ids = tokenizer.encode(row.prompt) if row.prompt else []
        if len(prompt_ids) + 1 >= max_length:
            raise refusal(
                rows.source,
                f"the prompt is {len(prompt_ids)} tokens, leaving no room for the answers within "
                f"data.max_length={max_length}",
                where,
            )
        encoded = [_answer_row(prompt_ids, answer, tokenizer, max_length, overlength, rows.source, where)
                   for answer in (row.chosen, row.rejected)]  # fmt: skip
        if encoded[0] == encoded[1]:
            raise refusal(
                rows.source, f"the chosen and rejected answers are the same within data.max_length={max_length}", where
            )
        (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = encoded
        pairs.append(PreferencePair(chosen_ids=chosen_ids, chosen_mask=chosen_mask,
                                    rejected_ids=rejected_ids, rejected_mask=rejected_mask))  # fmt: skip
    return pairs


def _answer_row(
    prompt_ids: list[int], answer: str, tokenizer: PreTrainedTokenizerBase, max_length: int, overlength: str,
    source: str, where: str,
) -> tuple[list[int], list[int]]:  # fmt: skip
    """One row: the prompt's tokens then the answer's and end-of-text, and the mask of the answer's tokens."""
    answer_ids = tokenizer.encode(answer, add_special_tokens=not prompt_ids) + [tokenizer.eos_token_id]
    ids, mask = prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)
    if len(ids) > max_length:
        if overlength == "refuse":
            raise refusal(source, f"{len(ids)} tokens, longer than data.max_length={max_length} "
                                  "(set data.overlength=truncate to cut the answer)", where)  # fmt: skip
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def _row(rows: PreferenceRows, index: int) -> str:
    """``row 3``, with its file line where that differs."""
    line = rows.lines[index] if rows.lines is not None else index + 1
    return f"row {index + 1}" + (f" (line {line})" if line != index + 1 else "")
