"""TextDataModule: a user's corpus (local JSONL / JSON / CSV / TXT, a hub dataset or the built-in one) for LM training.

One example per row: a ``text`` column, or ``prompt`` + ``response`` columns (instruction data, loss on the
response only). Rows are never packed together: under DP the privacy unit is the example, and a row that
shared a sequence with others would let its gradient leak into theirs. Each example is tokenised as the
model's tokenizer does (its BOS if it adds one), followed by its end-of-text token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from torch import Tensor
from typing_extensions import override

from dplit.data.batches import PadCollator, UnitItems, pad_token_rows, user_field
from dplit.data.corpus import make_corpus_split
from dplit.data.datamodule import BUILTIN, CorpusDataModule
from dplit.data.files import TextRows, read_rows, refusal
from dplit.data.packing import PackingCollator
from dplit.data.sources import load_hub_dataset

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

Split = Literal["train", "validation"]


class TextExample(TypedDict):
    """One tokenised example: its token ids, which of them are trained (1) or context only (0), and its user."""

    input_ids: list[int]
    loss_mask: list[int]
    user: NotRequired[int]


class TextDataset(UnitItems[TextExample]):
    """Tokenised examples (with users: DP-SGD then samples and clips by user).

    Args:
        items: the tokenised rows, an example each.
        users: each row's user, 0..U-1 (``None``: each row is its own privacy unit).
        max_rows_per_user: the most rows of one user in one DP step (``data.max_rows_per_user``).
    """


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


class TextDataModule(CorpusDataModule):
    """Text for private next-token fine-tuning.

    Args:
        text_column: the text column (plain text data).
        prompt_column: the prompt column of instruction data (set with ``response_column``); the loss is then
            on the response tokens only and ``text_column`` is unused.
        response_column: the response column of instruction data.
        packing: pack each sampled training batch into rows of ``max_length`` tokens (:mod:`dplit.data.packing`):
            documents isolated from one another, each still its own privacy unit (ghost clipping per document).
        builtin_train_size: training texts of the built-in corpus (:mod:`dplit.data.corpus`).
        builtin_val_size: validation texts of the built-in corpus.
        privacy_unit: ``"example"`` (each row is protected) or ``"user"`` (each user with all of its rows).
        **kwargs: the options of :class:`~dplit.data.datamodule.CorpusDataModule` (``dataset``, ``train_file``,
            ``val_file``, ``overlength``) and of every DataModule (:class:`~dplit.data.datamodule.DPDataModule`).
    """

    COLLATOR = TextCollator
    DATASET = TextDataset

    def __init__(
        self,
        text_column: str = "text",
        prompt_column: str | None = None,
        response_column: str | None = None,
        packing: bool = False,
        builtin_train_size: int = 8000,
        builtin_val_size: int = 400,
        privacy_unit: Literal["example", "user"] = "example",
        **kwargs: Any,
    ) -> None:
        super().__init__(privacy_unit=privacy_unit, **kwargs)
        if packing:  # the training batches only: validation stays padded
            self.train_collate_fn = PackingCollator(
                max_length=self.max_length, pad_token_id=self.tokenizer.pad_token_id
            )

    @override
    def check_options(self) -> None:
        """Refuse half of an instruction pair's columns; warn of options this data ignores."""
        super().check_options()
        hp = self.hparams
        if (hp.prompt_column is None) != (hp.response_column is None):
            raise ValueError("set both data.prompt_column and data.response_column (instruction data), or neither")
        self.warn_ignored(_ignored_options(hp))

    @override
    def encode(self, rows: TextRows) -> list[TextExample]:  # type: ignore[override]
        """One example a row (:func:`encode_rows`)."""
        return encode_rows(rows, self.tokenizer, self.max_length, self.hparams.overlength)

    @override
    def read(self, split: str) -> TextRows:
        hp, file, limit = self.hparams, self.local_file(split), self.limit(split)
        if file is not None:
            return read_rows(file, self._columns(), limit, user_column=self.user_column_of(split))
        if hp.dataset == BUILTIN:
            texts = make_corpus_split(
                split, self.builtin_size(split, hp.builtin_train_size, hp.builtin_val_size), hp.seed
            )
            return TextRows(texts, None, None, f"builtin corpus [{split}, seed={hp.seed}]")
        table = load_hub_dataset(hp.dataset, "data.dataset", split=split if limit is None else f"{split}[:{limit}]")
        return _rows_of(table, self._columns(), f"{hp.dataset} [{split}]", self.user_column_of(split))

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


def _ignored_options(options: Mapping[str, Any]) -> dict[str, str]:
    """The TextDataModule options this data ignores (name → why)."""
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
    return ignored
