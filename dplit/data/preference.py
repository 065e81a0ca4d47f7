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
from typing import Literal, NotRequired, TypedDict

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from dplit.data.batches import PadCollator, pad_token_rows
from dplit.data.checks import check_count
from dplit.data.conversation import render_conversations
from dplit.data.corpus import build_corpus_tokenizer
from dplit.data.files import check_data_file, read_records, record_user, records_to_rows, refusal
from dplit.data.preference_set import PreferenceRow, make_preference_split
from dplit.data.text import TextDataset
from dplit.data.tokenizer import load_tokenizer
from dplit.data.users import (
    check_user_settings,
    private_diagnostics_off,
    synthetic_users,
    user_indices,
    warn_dominant_user,
)
from dplit.privacy.clipping.units import UNIT_KEY
from dplit.privacy.run_facts import PAIR_UNIT
from dplit.tasks.preference import CHOSEN_KEY

Split = Literal["train", "validation"]
BUILTIN = "builtin"
COLUMNS = ("prompt", "chosen", "rejected")
SYNTHETIC_USER_PAIRS = 8
"""The built-in set's users own 1 to this many consecutive pairs (seeded by ``data.seed``)."""


class PreferencePair(TypedDict):
    """One tokenised pair: each answer's row (prompt then answer) and the mask of its answer tokens."""

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    user: NotRequired[int]


class PreferenceDataset(TextDataset):
    """Tokenised preference pairs; each item (a pair, two rows) is one privacy unit, or each user's pairs are.

    Args:
        pairs: the tokenised pairs.
        users: each pair's user, 0..U-1 (``None``: each pair is its own privacy unit).
        max_rows_per_user: k, the most pairs of one user in one DP step (``data.max_rows_per_user``).

    Attributes:
        privacy_unit: ``"pair"``: without users DP-SGD samples items and its ledger, history and card count pairs.
    """

    privacy_unit = PAIR_UNIT

    def __init__(
        self, pairs: list[PreferencePair], *, users: list[int] | None = None, max_rows_per_user: int = 1
    ) -> None:
        super().__init__(pairs, users=users, max_rows_per_user=max_rows_per_user)  # type: ignore[arg-type]


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


class PreferenceDataModule(LightningDataModule):
    """Preference pairs for private DPO (``dplit dpo``).

    Args:
        dataset: ``"builtin"`` (the offline preference set of :mod:`dplit.data.preference_set`, with the built-in
            corpus' tokenizer); ignored with local files.
        train_file: a local ``.jsonl`` / ``.json`` / ``.csv`` file with ``prompt``, ``chosen`` and ``rejected``
            columns (the names TRL and hub preference sets use).
        val_file: the local validation file (required with ``train_file``).
        tokenizer: hub name or folder of the model whose tokenizer is used (ignored for ``builtin``).
        gguf_file: a GGUF checkpoint inside the ``tokenizer`` folder.
        batch_size: expected pairs per logical training batch (each pair is two rows).
        eval_batch_size: validation pairs per batch.
        max_length: longest row (prompt and answer, end-of-text token included) in tokens.
        overlength: an answer that passes ``max_length`` is cut at its end (``"truncate"``) or refused with its
            file and row (``"refuse"``); a prompt that leaves no room for an answer is always refused.
        padding_side: pad batches on the right or the left.
        num_workers: DataLoader worker processes.
        max_train_examples: use only the first N training pairs.
        max_eval_examples: use only the first N validation pairs.
        builtin_train_size: training pairs of the built-in set.
        builtin_val_size: validation pairs of the built-in set.
        seed: seed of the built-in set.
        privacy_unit: ``"pair"`` (each preference pair is protected) or ``"user"`` (each user with all of its pairs:
            DP-SGD samples users at q = ``batch_size`` / users and clips each user's pairs as one unit).
        user_column: the column naming each training pair's user (local files); the built-in set draws its own
            users (1 to 8 consecutive pairs, from ``seed``).
        max_rows_per_user: k, the most pairs of one sampled user in one step (drawn uniformly among its pairs).
    """

    def __init__(
        self,
        dataset: str = BUILTIN,
        train_file: str | None = None,
        val_file: str | None = None,
        tokenizer: str = "gpt2",
        gguf_file: str | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        max_length: int = 256,
        overlength: Literal["truncate", "refuse"] = "truncate",
        padding_side: Literal["right", "left"] = "right",
        num_workers: int = 0,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        builtin_train_size: int = 2000,
        builtin_val_size: int = 200,
        seed: int = 0,
        privacy_unit: Literal["pair", "user"] = "pair",
        user_column: str | None = None,
        max_rows_per_user: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if privacy_unit not in ("pair", "user"):
            raise ValueError(f"data.privacy_unit must be pair or user for dplit dpo, got {privacy_unit!r}")
        check_user_settings("user", None, max_rows_per_user)  # k ≥ 1
        if user_column is not None and privacy_unit != "user":
            raise ValueError(
                f"data.user_column={user_column!r} is set but data.privacy_unit='pair': set data.privacy_unit=user "
                "for user-level DP over pairs (or drop data.user_column)"
            )
        if privacy_unit == "user" and user_column is None and train_file is not None:
            raise ValueError("data.privacy_unit=user needs data.user_column: the column naming each pair's user")
        if dataset != BUILTIN and train_file is None:
            raise ValueError(f"data.dataset={dataset!r}: dplit dpo reads 'builtin' or local files (data.train_file)")
        if (train_file is None) != (val_file is None):
            raise ValueError("set both data.train_file and data.val_file, or neither")
        if overlength not in ("truncate", "refuse"):
            raise ValueError(f"data.overlength must be 'truncate' or 'refuse', got {overlength!r}")
        for flag, file in {"data.train_file": train_file, "data.val_file": val_file}.items():
            if file is not None:
                check_data_file(flag, file)
        for name, value in {
            "batch_size": batch_size,
            "eval_batch_size": eval_batch_size,
            "max_length": max_length,
        }.items():
            check_count(name, value, least=2 if name == "max_length" else 1, note=" (max_length ≥ 2)")
        self.batch_size, self.eval_batch_size, self.max_length = batch_size, eval_batch_size, max_length
        self.num_workers = num_workers
        self.tokenizer: PreTrainedTokenizerBase = (
            build_corpus_tokenizer() if train_file is None else load_tokenizer(tokenizer, gguf_file)
        )
        self.tokenizer.padding_side = padding_side
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"data.tokenizer={tokenizer!r} has no end-of-text token to end each answer with")
        self.vocab_size: int = len(self.tokenizer)
        self.collate_fn = PreferenceCollator(self.tokenizer.pad_token_id, padding_side)
        self._datasets: dict[Split, PreferenceDataset] = {}

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and tokenise the splits the stage needs."""
        if stage in ("fit", None):
            self.dataset("train")
        self.dataset("validation")

    def dataset(self, split: Split) -> PreferenceDataset:
        """The tokenised ``"train"`` or ``"validation"`` split, read on first use."""
        if split not in self._datasets:
            rows = self._read(split)
            pairs = encode_pairs(rows, self.tokenizer, self.max_length, self.hparams.overlength)
            if not pairs:
                raise ValueError(f"{rows.source}: the {split} split has no preference pairs")
            rank_zero_info(f"{split}: {len(pairs)} preference pairs from {rows.source}")
            users = self._users(rows) if split == "train" else None
            self._datasets[split] = PreferenceDataset(
                pairs, users=users, max_rows_per_user=self.hparams.max_rows_per_user
            )
        return self._datasets[split]

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of pairs (DPStrategy swaps in Poisson sampling of pairs)."""
        return self._loader("train", self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation batches of pairs, in order."""
        return self._loader("validation", self.eval_batch_size, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation pairs (``dplit dpo test``)."""
        return self.val_dataloader()

    def _loader(self, split: Split, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(self.dataset(split), batch_size=batch_size, shuffle=shuffle, collate_fn=self.collate_fn,
                          num_workers=self.num_workers)  # fmt: skip

    def _users(self, rows: PreferenceRows) -> list[int] | None:
        """The training pairs' users, 0..U-1, under ``privacy_unit: user`` (the built-in set: a seeded assignment)."""
        if self.hparams.privacy_unit != "user":
            return None
        ids = rows.users or synthetic_users(len(rows.rows), seed=self.hparams.seed, most_rows=SYNTHETIC_USER_PAIRS)
        users = user_indices(ids)
        warn_dominant_user(users, source=rows.source, quiet=private_diagnostics_off(self))
        return users

    def _read(self, split: Split) -> PreferenceRows:
        hp = self.hparams
        limit = hp.max_train_examples if split == "train" else hp.max_eval_examples
        if hp.train_file is not None:
            user_column = hp.user_column if split == "train" and hp.privacy_unit == "user" else None
            file = Path(hp.train_file if split == "train" else hp.val_file).expanduser()
            return read_preference_file(file, limit, user_column=user_column, tokenizer=self.tokenizer)
        size = hp.builtin_train_size if split == "train" else hp.builtin_val_size
        rows = make_preference_split(split, size if limit is None else min(size, limit), hp.seed)
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
    records = read_records(path, COLUMNS, limit)
    records = render_conversations(path, records, tokenizer) if tokenizer is not None else records
    first = records_to_rows(path, records, COLUMNS)  # checks all three columns; gathers prompt and chosen
    rejected = records_to_rows(path, records, ("rejected",)).texts or []
    rows = [PreferenceRow(*values) for values in zip(first.prompts or [], first.responses or [], rejected, strict=True)]
    users = [record_user(path, record, user_column) for record in records] if user_column is not None else None
    return PreferenceRows(rows, str(path), first.lines, users)


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
