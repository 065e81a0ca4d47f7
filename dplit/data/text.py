"""TextDataModule: a user's corpus (local JSONL / JSON / CSV / TXT, a hub dataset or the built-in one) for LM training.

One example per row: a ``text`` column, or ``prompt`` + ``response`` columns (instruction data, loss on the
response only). Rows are never packed together: under DP the privacy unit is the example, and a row that
shared a sequence with others would let its gradient leak into theirs. Each example is tokenised as the
model's tokenizer does (its BOS if it adds one), followed by its end-of-text token.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from dplit.data.batches import PadCollator, pad_token_rows, user_field
from dplit.data.checks import check_count
from dplit.data.corpus import build_corpus_tokenizer, make_corpus_split
from dplit.data.files import TextRows, check_data_file, read_rows, refusal
from dplit.data.packing import PackingCollator
from dplit.data.sources import load_hub_dataset
from dplit.data.tokenizer import load_tokenizer
from dplit.data.users import (
    check_several_users,
    check_user_settings,
    private_diagnostics_off,
    synthetic_users,
    user_indices,
    warn_dominant_user,
)

if TYPE_CHECKING:
    import datasets

Split = Literal["train", "validation"]
BUILTIN = "builtin"
SYNTHETIC_USER_ROWS = 8
"""The built-in corpus' users own 1 to this many consecutive rows (seeded by ``data.seed``)."""


class TextExample(TypedDict):
    """One tokenised example: its token ids, which of them are trained (1) or context only (0), and its user."""

    input_ids: list[int]
    loss_mask: list[int]
    user: NotRequired[int]


class TextDataset(Dataset[TextExample]):
    """Tokenised examples (with users: DP-SGD then samples and clips by user).

    Args:
        examples: the tokenised rows.
        users: each row's user, 0..U-1 (``None``: each row is its own privacy unit).
        max_rows_per_user: the most rows of one user in one DP step (``data.max_rows_per_user``).
    """

    def __init__(
        self, examples: list[TextExample], *, users: list[int] | None = None, max_rows_per_user: int = 1
    ) -> None:
        self.examples = examples
        self.users = users
        self.max_rows_per_user = max_rows_per_user

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> TextExample:
        if self.users is None:
            return self.examples[index]
        return TextExample(**self.examples[index], user=self.users[index])


class TextCollator(PadCollator):
    """Pads examples to the longest (right or left); an empty list gives tensors of batch size 0.

    Args:
        pad_token_id: token id written at padded positions (attention and loss masks are 0 there).
        padding_side: ``"right"`` or ``"left"``.
    """

    @override
    def __call__(self, examples: Sequence[TextExample]) -> dict[str, Tensor]:  # type: ignore[override]
        """``input_ids``, ``attention_mask`` and ``loss_mask``, each LongTensor[B, T]."""
        input_ids, attention_mask = pad_token_rows(
            [e["input_ids"] for e in examples], self.pad_token_id, self.padding_side
        )
        loss_mask, _ = pad_token_rows([e["loss_mask"] for e in examples], 0, self.padding_side)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        return {**batch, **user_field(examples)}


class TextDataModule(LightningDataModule):
    """Text for private next-token fine-tuning.

    Args:
        dataset: ``"builtin"`` (the offline corpus of :mod:`dplit.data.corpus`, with its own tokenizer) or a
            Hugging Face hub dataset name (loaded with ``datasets.load_dataset``); ignored for local files.
        train_file: a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.txt`` file (a TXT file is one text per line).
        val_file: the local validation file (required with ``train_file``).
        text_column: the text column (plain text data).
        prompt_column: the prompt column of instruction data (set with ``response_column``); the loss is then
            on the response tokens only and ``text_column`` is unused.
        response_column: the response column of instruction data.
        tokenizer: hub name or folder of the model whose tokenizer is used (ignored for ``builtin``).
        gguf_file: a GGUF checkpoint inside the ``tokenizer`` folder.
        batch_size: expected logical training batch size.
        eval_batch_size: validation batch size.
        max_length: longest example in tokens (end-of-text token included).
        overlength: an example longer than ``max_length`` is cut at its end (``"truncate"``) or refused with its
            file and row (``"refuse"``).
        packing: pack each sampled training batch into rows of ``max_length`` tokens (:mod:`dplit.data.packing`):
            documents isolated from one another, each still its own privacy unit (ghost clipping per document).
        padding_side: pad batches on the right or the left.
        num_workers: DataLoader worker processes.
        max_train_examples: use only the first N training rows.
        max_eval_examples: use only the first N validation rows.
        builtin_train_size: training texts of the built-in corpus.
        builtin_val_size: validation texts of the built-in corpus.
        seed: seed of the built-in corpus.
        privacy_unit: ``"example"`` (each row is protected) or ``"user"`` (each user with all of its rows: DP-SGD
            samples users at q = ``batch_size`` / users and clips each user's summed gradient as one).
        user_column: the column naming each training row's user (local files and hub datasets); the built-in
            corpus draws its own users (1 to 8 consecutive rows, from ``seed``).
        max_rows_per_user: k, the most rows of one sampled user in one step (drawn uniformly among its rows).
    """

    def __init__(
        self,
        dataset: str = BUILTIN,
        train_file: str | None = None,
        val_file: str | None = None,
        text_column: str = "text",
        prompt_column: str | None = None,
        response_column: str | None = None,
        tokenizer: str = "gpt2",
        gguf_file: str | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        max_length: int = 256,
        overlength: Literal["truncate", "refuse"] = "truncate",
        packing: bool = False,
        padding_side: Literal["right", "left"] = "right",
        num_workers: int = 0,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        builtin_train_size: int = 8000,
        builtin_val_size: int = 400,
        seed: int = 0,
        privacy_unit: Literal["example", "user"] = "example",
        user_column: str | None = None,
        max_rows_per_user: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_user_settings(privacy_unit, user_column, max_rows_per_user)
        if privacy_unit == "user" and user_column is None and (train_file is not None or dataset != BUILTIN):
            raise ValueError("data.privacy_unit=user needs data.user_column: the column naming each row's user")
        if (prompt_column is None) != (response_column is None):
            raise ValueError("set both data.prompt_column and data.response_column (instruction data), or neither")
        if (train_file is None) != (val_file is None):
            raise ValueError("set both data.train_file and data.val_file, or neither")
        if overlength not in ("truncate", "refuse"):
            raise ValueError(f"data.overlength must be 'truncate' or 'refuse', got {overlength!r}")
        for flag, file in {"data.train_file": train_file, "data.val_file": val_file}.items():
            if file is not None:
                check_data_file(flag, file)
        _warn_ignored_options(self.hparams)
        for name, value in {
            "batch_size": batch_size,
            "eval_batch_size": eval_batch_size,
            "max_length": max_length,
        }.items():
            check_count(name, value, least=2 if name == "max_length" else 1, note=" (max_length ≥ 2)")
        self.batch_size, self.eval_batch_size, self.max_length = batch_size, eval_batch_size, max_length
        self.num_workers = num_workers
        self.tokenizer: PreTrainedTokenizerBase = self.tokenizer_for(self.hparams)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"data.tokenizer={tokenizer!r} has no end-of-text token to end each example with")
        self.vocab_size: int = len(self.tokenizer)
        self.collate_fn = TextCollator(self.tokenizer.pad_token_id, padding_side)
        self.train_collate_fn: TextCollator | PackingCollator = (
            PackingCollator(max_length=max_length, pad_token_id=self.tokenizer.pad_token_id)
            if packing
            else self.collate_fn
        )
        self._datasets: dict[Split, TextDataset] = {}

    @staticmethod
    def tokenizer_for(hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase:
        """The tokenizer a module with these hyperparameters uses (no data is read: ``dplit export`` calls it)."""
        builtin = hparams.get("dataset", BUILTIN) == BUILTIN and hparams.get("train_file") is None
        name = hparams.get("tokenizer", "gpt2")
        tokenizer = build_corpus_tokenizer() if builtin else load_tokenizer(name, hparams.get("gguf_file"))
        tokenizer.padding_side = hparams.get("padding_side", "right")
        return tokenizer

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and tokenise the splits the stage needs."""
        if stage in ("fit", None):
            self.dataset("train")
        self.dataset("validation")

    def dataset(self, split: Split) -> TextDataset:
        """The tokenised ``"train"`` or ``"validation"`` split, read on first use."""
        if split not in self._datasets:
            rows = self._read(split)
            examples = encode_rows(rows, self.tokenizer, self.max_length, self.hparams.overlength)
            if not examples:
                raise ValueError(f"{rows.source}: the {split} split has no examples")
            rank_zero_info(f"{split}: {len(examples)} examples from {rows.source}")
            users = self._users(rows) if split == "train" else None
            self._datasets[split] = TextDataset(examples, users=users, max_rows_per_user=self.hparams.max_rows_per_user)
        return self._datasets[split]

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (DPStrategy swaps in Poisson sampling)."""
        return self._loader("train", self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation batches, in order."""
        return self._loader("validation", self.eval_batch_size, shuffle=False)

    def _loader(self, split: Split, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.dataset(split), batch_size=batch_size, shuffle=shuffle,
            collate_fn=self.train_collate_fn if split == "train" else self.collate_fn,
            num_workers=self.num_workers,
        )  # fmt: skip

    def _read(self, split: Split) -> TextRows:
        hp = self.hparams
        limit = hp.max_train_examples if split == "train" else hp.max_eval_examples
        if hp.train_file is not None:
            file = Path(hp.train_file if split == "train" else hp.val_file).expanduser()
            return read_rows(file, self._columns(), limit, user_column=self._user_column(split))
        if hp.dataset == BUILTIN:
            size = hp.builtin_train_size if split == "train" else hp.builtin_val_size
            texts = make_corpus_split(split, size if limit is None else min(size, limit), hp.seed)
            return TextRows(texts, None, None, f"builtin corpus [{split}, seed={hp.seed}]")
        table = load_hub_dataset(hp.dataset, "data.dataset", split=split if limit is None else f"{split}[:{limit}]")
        return _rows_of(table, self._columns(), f"{hp.dataset} [{split}]", self._user_column(split))

    def _users(self, rows: TextRows) -> list[int] | None:
        """The training rows' users, 0..U-1, under ``privacy_unit: user`` (the built-in corpus: a seeded assignment)."""
        if self.hparams.privacy_unit != "user":
            return None
        ids = rows.users
        if ids is None:  # the built-in corpus: users of 1 to 8 consecutive rows
            count = len(rows.texts or rows.responses or [])
            ids = synthetic_users(count, seed=self.hparams.seed, most_rows=SYNTHETIC_USER_ROWS)
        users = user_indices(ids)
        check_several_users(users, source=rows.source, column=self.hparams.user_column)
        warn_dominant_user(users, source=rows.source, quiet=private_diagnostics_off(self))
        return users

    def _user_column(self, split: Split) -> str | None:
        """The user column of the training split (user-level DP); the validation split needs none."""
        return self.hparams.user_column if split == "train" and self.hparams.privacy_unit == "user" else None

    def _columns(self) -> tuple[str, ...]:
        hp = self.hparams
        return (hp.prompt_column, hp.response_column) if hp.prompt_column else (hp.text_column,)


def _rows_of(table: datasets.Dataset, columns: tuple[str, ...], source: str, user_column: str | None) -> TextRows:
    wanted = columns + ((user_column,) if user_column is not None else ())
    missing = [column for column in wanted if column not in table.column_names]
    if missing:
        raise refusal(source, f"missing column(s) {missing}; the file has {table.column_names}")
    values = [[value if value is not None else "" for value in table[column]] for column in columns]
    users = _hub_users(table, user_column, source) if user_column is not None else None
    if len(columns) == 1:
        return TextRows(values[0], None, None, source, users=users)
    return TextRows(None, values[0], values[1], source, users=users)


def _hub_users(table: datasets.Dataset, column: str, source: str) -> list[str]:
    """A hub dataset's user ids, refusing a blank one by its row (never printing an id)."""
    users = []
    for index, value in enumerate(table[column]):
        if value is None or not str(value).strip():
            raise refusal(source, f"no user id in data.user_column={column!r}", f"row {index + 1}")
        users.append(str(value).strip())
    return users


def encode_rows(
    rows: TextRows, tokenizer: PreTrainedTokenizerBase, max_length: int, overlength: str
) -> list[TextExample]:
    """Tokenise every row (text, or prompt + response), end it with end-of-text, and apply ``overlength``."""
    eos = tokenizer.eos_token_id
    examples = []
    contexts = rows.prompts if rows.prompts is not None else [""] * len(rows.texts or [])
    targets = rows.responses if rows.responses is not None else rows.texts or []
    for index, (context, target) in enumerate(zip(contexts, targets, strict=True)):
        if not str(target).strip():
            what = "response" if rows.responses is not None else "text"
            raise refusal(rows.source, f"empty {what}", _row(rows, index))
        prompt_ids = tokenizer.encode(str(context)) if context else []
        target_ids = tokenizer.encode(str(target), add_special_tokens=not prompt_ids) + [eos]
        ids, trained = prompt_ids + target_ids, [0] * len(prompt_ids) + [1] * len(target_ids)
        if len(ids) > max_length:
            if overlength == "refuse" or len(prompt_ids) + 1 >= max_length:
                fix = (
                    " (set data.overlength=truncate to cut it)" if overlength == "refuse" else " (the prompt fills it)"
                )
                raise refusal(
                    rows.source, f"{len(ids)} tokens, longer than data.max_length={max_length}{fix}", _row(rows, index)
                )
            ids, trained = ids[:max_length], trained[:max_length]
        examples.append(TextExample(input_ids=ids, loss_mask=trained))
    return examples


def _row(rows: TextRows, index: int) -> str:
    """Where row ``index`` (0-based) is, for a refusal: ``row 3``, and its file line where that differs."""
    line = rows.lines[index] if rows.lines is not None else index + 1
    return f"row {index + 1}" + (f" (line {line})" if line != index + 1 else "")


def _warn_ignored_options(options: Mapping[str, Any]) -> None:
    """Warn once for each TextDataModule option that was changed from its default but that this data ignores."""
    local, builtin = options["train_file"] is not None, options["dataset"] == BUILTIN
    ignored: dict[str, str] = {}
    if local and not builtin:
        ignored["dataset"] = "data.train_file and data.val_file are read instead"
    if builtin and not local:
        ignored |= dict.fromkeys(("tokenizer", "gguf_file"), "the builtin corpus has its own tokenizer")
        ignored |= dict.fromkeys(
            ("text_column", "prompt_column", "response_column"), "the builtin corpus is plain text without columns"
        )
    else:
        ignored |= dict.fromkeys(("builtin_train_size", "builtin_val_size", "seed"), "only the builtin corpus uses it")
        if options["prompt_column"] is not None:
            ignored["text_column"] = "instruction data reads data.prompt_column and data.response_column"
    defaults = inspect.signature(TextDataModule.__init__).parameters
    for name, why in ignored.items():
        if options[name] != defaults[name].default:
            rank_zero_warn(f"data.{name}={options[name]!r} is ignored: {why}")
