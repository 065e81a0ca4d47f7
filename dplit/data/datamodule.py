"""The base of dplit's DataModules: the options all of them take, their checks, the tokenizer, the splits, the loaders.

:class:`DPDataModule` holds what GLUE prompts (:mod:`dplit.data.glue`), text (:mod:`dplit.data.text`) and
preference pairs (:mod:`dplit.data.preference`) share; :class:`CorpusDataModule` adds what text and preference pairs
share (the built-in set or local files). A subclass takes its own options, refuses its own bad ones
(:meth:`DPDataModule.check_options`) and reads and tokenises a split (:meth:`DPDataModule.build`): the base reads each
split once, cuts its batches and gives the training split its users under ``privacy_unit: user``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from dplit.data.batches import PadCollator, UnitItems
from dplit.data.corpus import build_corpus_tokenizer
from dplit.data.files import check_data_file
from dplit.data.tokenizer import load_tokenizer
from dplit.data.users import (
    PRIVACY_UNITS,
    SYNTHETIC_USER_ROWS,
    check_several_users,
    check_user_settings,
    synthetic_users,
    user_indices,
    warn_dominant_user,
)
from dplit.privacy.diagnostics import private_diagnostics_allowed

BUILTIN = "builtin"
TRAIN = "train"


def options_signature(cls: type[DPDataModule]) -> inspect.Signature:
    """The signature of ``cls(...)``: the options of its ``__init__``, then those its bases' take through ``**kwargs``.

    ``inspect.signature`` of the class then lists every option a user may set (the config checks ask it).
    """
    parameters: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if not issubclass(klass, DPDataModule):
            continue
        for index, parameter in enumerate(inspect.signature(klass.__init__).parameters.values()):
            if index == 0 or parameter.kind is inspect.Parameter.VAR_KEYWORD or parameter.name in parameters:
                continue
            kind = parameter.kind if klass is cls else inspect.Parameter.KEYWORD_ONLY
            parameters[parameter.name] = parameter.replace(kind=kind)
    return inspect.Signature(list(parameters.values()))


class DPDataModule(LightningDataModule):
    """Tokenised splits whose training split is private: the options and code every dplit DataModule shares.

    Args:
        privacy_unit: what DP-SGD protects; the subclass names its choices (``"example"`` or ``"pair"``, and
            ``"user"``: each user with all of its rows, sampled at q = ``batch_size`` / users and clipped as one).
        tokenizer: hub name or local folder of the model whose tokenizer is used (ignored for built-in data,
            which has its own tokenizer).
        gguf_file: a GGUF checkpoint inside the ``tokenizer`` folder whose tokenizer is used.
        batch_size: expected logical training batch size, in items (the DP strategy Poisson-samples instead).
        eval_batch_size: validation (and test) batch size.
        max_length: longest example in tokens.
        padding_side: pad batches on the right or the left.
        num_workers: DataLoader worker processes.
        max_train_examples: use only the first N training items.
        max_eval_examples: use only the first N evaluation items.
        seed: seed of the built-in data (and of its users).
        user_column: the column naming each training row's user (``privacy_unit: user``; local files, and hub
            datasets for text); built-in data draws its own users (1 to 8 consecutive rows, from ``seed``).
        max_rows_per_user: k, the most rows of one sampled user in one step (drawn uniformly among its rows).
    """

    EVAL_SPLIT: ClassVar[str] = "validation"
    """The split validation (and test) reads."""
    UNITS: ClassVar[tuple[str, ...]] = PRIVACY_UNITS
    """The values ``data.privacy_unit`` takes."""
    SHORTEST: ClassVar[int] = 2
    """The least ``data.max_length``."""
    COLLATOR: ClassVar[type[PadCollator]] = PadCollator
    """What pads a list of items into a batch."""

    def __init__(
        self,
        *,
        privacy_unit: str,
        tokenizer: str = "gpt2",
        gguf_file: str | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        max_length: int = 256,
        padding_side: Literal["right", "left"] = "right",
        num_workers: int = 0,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        seed: int = 0,
        user_column: str | None = None,
        max_rows_per_user: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_user_settings(privacy_unit, user_column, max_rows_per_user, units=self.UNITS)
        self.check_options()
        note = f" (max_length ≥ {self.SHORTEST})" if self.SHORTEST > 1 else ""
        check_count("max_length", max_length, least=self.SHORTEST, note=note)
        check_counts(batch_size=batch_size, eval_batch_size=eval_batch_size, max_train_examples=max_train_examples,
                     max_eval_examples=max_eval_examples)  # fmt: skip
        self.batch_size, self.eval_batch_size, self.max_length = batch_size, eval_batch_size, max_length
        self.num_workers = num_workers
        self.tokenizer: PreTrainedTokenizerBase = self.tokenizer_for(self.hparams)
        self.vocab_size: int = len(self.tokenizer)
        self.collate_fn = self.COLLATOR(self.tokenizer.pad_token_id, padding_side)
        self.train_collate_fn: Callable[[list[Any]], dict[str, Tensor]] = self.collate_fn
        """How training batches are collated (a subclass may pack them); evaluation batches use ``collate_fn``."""
        self._datasets: dict[str, UnitItems] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give the subclass the signature of its whole call: its own options, then its bases' (``**kwargs``)."""
        super().__init_subclass__(**kwargs)
        cls.__signature__ = options_signature(cls)

    def check_options(self) -> None:
        """Refuse this module's own bad options (``self.hparams``) in one line, before any file or tokenizer is read."""

    def build(self, split: str) -> UnitItems:
        """Read and tokenise ``split`` (the training split with its users: :meth:`users_of`)."""
        raise NotImplementedError

    @classmethod
    def builtin_tokenizer(cls, hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase | None:
        """The built-in data's own tokenizer where these hyperparameters choose built-in data, else ``None``."""
        return None

    @classmethod
    def tokenizer_for(cls, hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase:
        """The tokenizer a module with these hyperparameters uses (no data is read: ``dplit export`` calls it)."""
        tokenizer = cls.builtin_tokenizer(hparams)
        if tokenizer is None:
            tokenizer = load_tokenizer(hparams.get("tokenizer", "gpt2"), hparams.get("gguf_file"))
        tokenizer.padding_side = hparams.get("padding_side", "right")
        return tokenizer

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """Each option's default (the subclass' where it declares an option of its bases again)."""
        parameters = options_signature(cls).parameters.values()
        return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

    def warn_ignored(self, ignored: Mapping[str, str], context: str = "") -> None:
        """Warn once for each option of ``ignored`` (name → why) changed from its default: this data ignores it."""
        defaults = self.option_defaults()
        for name, why in ignored.items():
            if self.hparams[name] != defaults[name]:
                rank_zero_warn(f"data.{name}={self.hparams[name]!r} is ignored{context}: {why}")

    @property
    def private_diagnostics(self) -> bool:
        """Whether the trainer's strategy lets values computed from the private split into logs and warnings."""
        return private_diagnostics_allowed(self.trainer.strategy if self.trainer is not None else None)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and tokenise the splits the stage needs (each split once)."""
        if stage in ("fit", None):
            self.dataset(TRAIN)
        self.dataset(self.EVAL_SPLIT)

    def dataset(self, split: str) -> UnitItems:
        """The tokenised ``"train"`` split or the evaluation split, read on first use."""
        if split not in self._datasets:
            self._datasets[split] = self.build(split)
        return self._datasets[split]

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of ``batch_size`` (the DP strategy swaps in Poisson sampling)."""
        return self._loader(TRAIN, self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        """Evaluation batches, in order."""
        return self._loader(self.EVAL_SPLIT, self.eval_batch_size, shuffle=False)

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        collate = self.train_collate_fn if split == TRAIN else self.collate_fn
        return DataLoader(self.dataset(split), batch_size=batch_size, shuffle=shuffle, collate_fn=collate,
                          num_workers=self.num_workers)  # fmt: skip

    def limit(self, split: str) -> int | None:
        """How many rows of ``split`` to read at most (``data.max_train_examples`` / ``data.max_eval_examples``)."""
        return self.hparams.max_train_examples if split == TRAIN else self.hparams.max_eval_examples

    def builtin_size(self, split: str, train: int, evaluation: int) -> int:
        """How many items of built-in data to make for ``split``: its size, within :meth:`limit`."""
        size, limit = (train if split == TRAIN else evaluation), self.limit(split)
        return size if limit is None else min(size, limit)

    def user_column_of(self, split: str) -> str | None:
        """The column of the training split's users (user-level DP); the evaluation split needs none."""
        return self.hparams.user_column if split == TRAIN and self.hparams.privacy_unit == "user" else None

    def users_of(self, ids: Sequence[str] | None, *, rows: int, source: str) -> list[int] | None:
        """The training rows' users, 0..U-1, under ``privacy_unit: user`` (``None`` otherwise).

        Args:
            ids: each row's user id (read from ``data.user_column``), or ``None`` for built-in data's seeded users.
            rows: the number of rows.
            source: where the rows come from (for messages).
        """
        hp = self.hparams
        if hp.privacy_unit != "user":
            return None
        users = user_indices(
            ids if ids is not None else synthetic_users(rows, seed=hp.seed, most_rows=SYNTHETIC_USER_ROWS)
        )
        check_several_users(users, source=source, column=hp.user_column)
        warn_dominant_user(users, source=source, quiet=not self.private_diagnostics)
        rank_zero_info(f"{source}: user-level DP over {max(users) + 1} users (at most {hp.max_rows_per_user} rows of "
                       "a user per step)")  # fmt: skip
        return users


class Rows(Protocol):
    """A split's raw rows as a corpus reader gives them: where they came from, and each one's user (or ``None``)."""

    source: str
    users: list[str] | None


class CorpusDataModule(DPDataModule):
    """Rows of the built-in set or of local files, each tokenised with an end-of-text token (text and pairs).

    Args:
        dataset: ``"builtin"`` (the command's offline set, with its own tokenizer) or a Hugging
            Face hub dataset name (loaded with ``datasets.load_dataset``); ignored with local files.
        train_file: a local ``.jsonl`` / ``.json`` / ``.csv`` file (or for plain text ``.txt``, one text per line).
        val_file: the local validation file (required with ``train_file``).
        overlength: an example longer than ``max_length`` is cut at its end (``"truncate"``) or refused with its
            file and row (``"refuse"``).
        **kwargs: the options of :class:`DPDataModule`.
    """

    ITEMS: ClassVar[str] = "examples"
    """What one item is called in messages."""
    DATASET: ClassVar[Callable[..., UnitItems]]
    """The dataset of the items."""

    def __init__(
        self,
        dataset: str = BUILTIN,
        train_file: str | None = None,
        val_file: str | None = None,
        overlength: Literal["truncate", "refuse"] = "truncate",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"data.tokenizer={self.hparams.tokenizer!r} has no end-of-text token to end each row with")

    @override
    def check_options(self) -> None:
        """Refuse a local file without its pair, a bad ``overlength``, a missing file, or users without a column."""
        hp = self.hparams
        local = hp.train_file is not None
        if hp.privacy_unit == "user" and hp.user_column is None and (local or hp.dataset != BUILTIN):
            raise ValueError("data.privacy_unit=user needs data.user_column: the column naming each row's user")
        if local != (hp.val_file is not None):
            raise ValueError("set both data.train_file and data.val_file, or neither")
        if hp.overlength not in ("truncate", "refuse"):
            raise ValueError(f"data.overlength must be 'truncate' or 'refuse', got {hp.overlength!r}")
        for flag, file in {"data.train_file": hp.train_file, "data.val_file": hp.val_file}.items():
            if file is not None:
                check_data_file(flag, file)

    @override
    @classmethod
    def builtin_tokenizer(cls, hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase | None:
        """The built-in corpus' tokenizer (:mod:`dplit.data.corpus`) unless local files or a hub dataset are read."""
        builtin = hparams.get("dataset", BUILTIN) == BUILTIN and hparams.get("train_file") is None
        return build_corpus_tokenizer() if builtin else None

    def local_file(self, split: str) -> Path | None:
        """The local file of ``split`` (``data.train_file`` / ``data.val_file``), ``None`` without local files."""
        hp = self.hparams
        if hp.train_file is None:
            return None
        return Path(hp.train_file if split == TRAIN else hp.val_file).expanduser()

    def read(self, split: str) -> Rows:
        """The raw rows of ``split``, with where they came from (and their users)."""
        raise NotImplementedError

    def encode(self, rows: Rows) -> list[Any]:
        """Tokenise the rows into items, refusing one the model cannot learn from (its file and row named)."""
        raise NotImplementedError

    @override
    def build(self, split: str) -> UnitItems:
        """Read and tokenise ``split``, refusing it without items (the training split with its users)."""
        rows = self.read(split)
        items = self.encode(rows)
        if not items:
            raise ValueError(f"{rows.source}: the {split} split has no {self.ITEMS}")
        rank_zero_info(f"{split}: {len(items)} {self.ITEMS} from {rows.source}")
        users = self.users_of(rows.users, rows=len(items), source=rows.source) if split == TRAIN else None
        return self.DATASET(items, users=users, max_rows_per_user=self.hparams.max_rows_per_user)


def check_count(name: str, value: int, *, least: int = 1, note: str = "") -> None:
    """Refuse ``data.<name>`` below ``least``: ``data.batch_size must be a positive integer, got 0``.

    Args:
        name: the option, without ``data.`` (``"batch_size"``).
        value: its value (a size or a count).
        least: the smallest value accepted.
        note: added after "a positive integer" (``" (max_length ≥ 2)"``).

    Raises:
        ValueError: naming the option and the value.
    """
    if value < least:
        raise ValueError(f"data.{name} must be a positive integer{note}, got {value}")


def check_counts(**counts: int | None) -> None:
    """:func:`check_count` for each count given (``None``: unset, nothing to check)."""
    for name, value in counts.items():
        if value is not None:
            check_count(name, value)
