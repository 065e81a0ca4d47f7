"""GlueDataModule: GLUE SST-2 / QNLI / QQP (hub or local TSV) or the offline synthetic task, as prompts."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from dplit.data.batches import PadCollator, TokenizedDataset
from dplit.data.checks import check_count
from dplit.data.files import read_glue_tsv
from dplit.data.prompt import PromptTemplate
from dplit.data.sources import HUB_DATASET, TextSplit, load_hub_split
from dplit.data.synthetic import build_synthetic_tokenizer, make_synthetic_split
from dplit.data.tasks import TaskSpec, get_task
from dplit.data.tokenizer import label_word_ids, load_tokenizer
from dplit.data.users import (
    check_several_users,
    check_user_settings,
    private_diagnostics_off,
    synthetic_users,
    user_indices,
    warn_dominant_user,
)

Split = Literal["train", "dev"]
_HUB_SPLITS: dict[str, str] = {"train": "train", "dev": "validation"}


class GlueDataModule(LightningDataModule):
    """Prompt-style classification data for a causal LM: the answer is the label word after the prompt.

    Each example becomes ``template`` filled with its texts (truncated to ``max_length`` tokens, the
    template text never cut) and a class index; the model scores the label words at the last token.
    Validation and test both use GLUE's dev split (GLUE's test split has no labels). An option that the task
    ignores (``data_dir`` for ``synthetic``, ``synthetic_train_size`` for a GLUE task, ...) is warned about when
    it was changed from its default.

    Args:
        task: ``"sst2"``, ``"qnli"``, ``"qqp"`` or ``"synthetic"`` (built-in, offline, own tokenizer).
        data_dir: folder with GLUE's ``train.tsv`` and ``dev.tsv`` for the task; ``None`` loads
            ``nyu-mll/glue`` from the Hugging Face hub.
        tokenizer: hub name or local folder of the model whose tokenizer is used (ignored for ``synthetic``).
        gguf_file: a GGUF checkpoint inside the ``tokenizer`` folder whose tokenizer is used.
        batch_size: expected logical training batch size (the DP strategy may Poisson-sample instead).
        eval_batch_size: validation and test batch size.
        max_length: longest prompt in tokens.
        template: prompt format string over the task's text columns (default: the task's).
        label_words: raw label string → single-token word (leading space for GPT-2); the class index of
            a label is its position in the dict (default: the task's).
        padding_side: pad batches on the right or the left.
        num_workers: DataLoader worker processes.
        max_train_examples: use only the first N training examples.
        max_eval_examples: use only the first N dev examples.
        synthetic_train_size: training examples of the synthetic task.
        synthetic_val_size: dev examples of the synthetic task.
        seed: seed of the synthetic task's data.
        privacy_unit: ``"example"`` (each row is protected) or ``"user"`` (each user, all of its rows: DP-SGD then
            samples users at rate q = ``batch_size`` / users and clips each user's summed gradient as one).
        user_column: the ``train.tsv`` column naming each row's user (``privacy_unit: user``); the synthetic task
            draws its own users (:func:`~dplit.data.users.synthetic_users`, 1 to 8 rows each, from ``seed``).
        max_rows_per_user: k, the most rows of one sampled user in one step (drawn uniformly among its rows).
    """

    def __init__(
        self,
        task: str = "sst2",
        data_dir: str | None = None,
        tokenizer: str = "gpt2",
        gguf_file: str | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        max_length: int = 256,
        template: str | None = None,
        label_words: dict[str, str] | None = None,
        padding_side: Literal["right", "left"] = "right",
        num_workers: int = 0,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        synthetic_train_size: int = 20_000,
        synthetic_val_size: int = 1_000,
        seed: int = 0,
        privacy_unit: Literal["example", "user"] = "example",
        user_column: str | None = None,
        max_rows_per_user: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_user_settings(privacy_unit, user_column, max_rows_per_user)
        _check_user_source(task, data_dir, privacy_unit, user_column)
        self.spec: TaskSpec = get_task(task)
        self.task = task
        _check_counts(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_length=max_length,
            max_train_examples=max_train_examples,
            max_eval_examples=max_eval_examples,
            synthetic_train_size=synthetic_train_size,
            synthetic_val_size=synthetic_val_size,
        )
        _warn_ignored_options(task, self.hparams)
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None and task != "synthetic" else None
        if self.data_dir is not None:
            _check_data_dir(self.data_dir, task)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.max_length = max_length
        self.tokenizer: PreTrainedTokenizerBase = self.tokenizer_for(self.hparams)
        self.label_words = _resolve_label_words(self.spec, label_words)
        self.label_word_ids: list[int] = label_word_ids(self.tokenizer, self.label_words)
        self.num_classes: int = len(self.label_words)
        self.vocab_size: int = len(self.tokenizer)
        self.prompt = PromptTemplate(template or self.spec.template, self.spec.text_columns, self.tokenizer, max_length)
        self.collate_fn = PadCollator(self.tokenizer.pad_token_id, padding_side)
        self._class_index = {label: index for index, label in enumerate(self.label_words)}
        self._datasets: dict[Split, TokenizedDataset] = {}

    def prepare_data(self) -> None:
        """Download the GLUE task from the hub once (only when ``data_dir`` is ``None``).

        Refuses in one line when the hub cannot give it.
        """
        if self.task != "synthetic" and self.data_dir is None:
            import datasets  # here, not at the top: it costs every ``dplit`` process ~1 s of imports (pandas, arrow)
            from datasets.exceptions import DatasetNotFoundError

            try:
                datasets.load_dataset(HUB_DATASET, self.task)
            except (ConnectionError, DatasetNotFoundError):
                raise ValueError(
                    f"data.task={self.task}: GLUE's {self.task} could not be loaded from the Hugging Face hub "
                    f"({HUB_DATASET}; offline?): set data.data_dir to a folder with GLUE's train.tsv and dev.tsv"
                ) from None

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenise the splits the stage needs (each split once)."""
        if stage in ("fit", None):
            self.dataset("train")
        self.dataset("dev")

    def dataset(self, split: Split) -> TokenizedDataset:
        """The tokenised ``"train"`` or ``"dev"`` split, read on first use.

        Args:
            split: ``"train"`` or ``"dev"``.

        Returns:
            The split as a map-style dataset of ``{"input_ids": list[int], "label": int}``.
        """
        if split not in self._datasets:
            self._datasets[split] = self._tokenize(self._read(split), private=split == "train")
        return self._datasets[split]

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of ``batch_size`` (the DP strategy may swap in Poisson sampling)."""
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """GLUE dev batches, in order."""
        return self._loader("dev", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """GLUE dev batches, in order (GLUE's test split has no labels)."""
        return self._loader("dev", self.eval_batch_size, shuffle=False)

    def _loader(self, split: Split, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.dataset(split),
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
        )

    @staticmethod
    def tokenizer_for(hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase:
        """The tokenizer a module with these hyperparameters uses (no data is read: ``dplit export`` calls it)."""
        if hparams.get("task", "sst2") == "synthetic":
            tokenizer = build_synthetic_tokenizer()
        else:
            tokenizer = load_tokenizer(hparams.get("tokenizer", "gpt2"), hparams.get("gguf_file"))
        tokenizer.padding_side = hparams.get("padding_side", "right")
        return tokenizer

    def _read(self, split: Split) -> TextSplit:
        hp = self.hparams
        limit = hp.max_train_examples if split == "train" else hp.max_eval_examples
        if self.task == "synthetic":
            size = hp.synthetic_train_size if split == "train" else hp.synthetic_val_size
            return make_synthetic_split(split, size if limit is None else min(size, limit), hp.seed)
        if self.data_dir is not None:
            path = self.data_dir / f"{split}.tsv"
            if not path.exists():
                raise FileNotFoundError(f"data.data_dir: {path} not found (GLUE's {self.task} {split} split)")
            return read_glue_tsv(path, self.spec, limit, user_column=self._user_column(split))
        return load_hub_split(self.spec, _HUB_SPLITS[split], limit)

    def _user_column(self, split: Split) -> str | None:
        """The column of the training split's users (user-level DP); the dev split is public to no one: none."""
        return self.hparams.user_column if split == "train" and self.hparams.privacy_unit == "user" else None

    def _tokenize(self, texts: TextSplit, *, private: bool) -> TokenizedDataset:
        """Encode a split's prompts, logging their length statistics.

        The statistics stay out of the logs when the split is private and the trainer's strategy keeps private
        diagnostics out of them (``DPStrategy.private_diagnostics=false``).
        """
        encoded = self.prompt.encode(texts.texts)
        labels = [self._class_index[label] for label in texts.labels]
        quiet = private and not getattr(getattr(self.trainer, "strategy", None), "private_diagnostics", True)
        longest = max(len(ids) for ids in encoded.input_ids)
        statistics = (
            ""
            if quiet
            else f", longest prompt {longest} tokens, {encoded.num_truncated} truncated to "
            f"data.max_length={self.prompt.max_length}"
        )
        rank_zero_info(f"{self.task}: {len(labels)} examples from {texts.source}{statistics}")
        users = self._users(texts) if private else None
        return TokenizedDataset(
            encoded.input_ids, labels, users=users, max_rows_per_user=self.hparams.max_rows_per_user
        )

    def _users(self, texts: TextSplit) -> list[int] | None:
        """The training rows' users, 0..U-1, under ``privacy_unit: user`` (synthetic: a seeded assignment)."""
        if self.hparams.privacy_unit != "user":
            return None
        ids = texts.users
        if ids is None:  # the synthetic task: users of 1 to 8 consecutive rows
            ids = synthetic_users(len(texts), seed=self.hparams.seed, most_rows=SYNTHETIC_USER_ROWS)
        users = user_indices(ids)
        check_several_users(users, source=texts.source, column=self.hparams.user_column)
        warn_dominant_user(users, source=texts.source, quiet=private_diagnostics_off(self))
        rank_zero_info(f"{self.task}: user-level DP over {max(users) + 1} users (at most "
                       f"{self.hparams.max_rows_per_user} rows of a user per step)")  # fmt: skip
        return users


def _resolve_label_words(spec: TaskSpec, label_words: dict[str, str] | None) -> dict[str, str]:
    """The label words to use, keys as strings, checked to cover exactly the task's labels."""
    if label_words is None:
        return dict(spec.label_words)
    words = {str(label): word for label, word in label_words.items()}
    if set(words) != spec.labels:
        raise ValueError(
            f"data.label_words must have one word for each {spec.name} label {sorted(spec.labels)}, "
            f"got keys {sorted(words)}"
        )
    return words


def _warn_ignored_options(task: str, options: Mapping[str, Any]) -> None:
    """Warn once for each option that ``task`` ignores and that was changed from its default."""
    if task == "synthetic":
        ignored = dict.fromkeys(("data_dir", "tokenizer", "gguf_file"), "it makes its own examples and tokenizer")
    else:
        ignored = dict.fromkeys(
            ("synthetic_train_size", "synthetic_val_size", "seed"), "only data.task=synthetic uses it"
        )
    defaults = inspect.signature(GlueDataModule.__init__).parameters
    for name, why in ignored.items():
        if options[name] != defaults[name].default:
            rank_zero_warn(f"data.{name}={options[name]!r} is ignored with data.task={task}: {why}")


SYNTHETIC_USER_ROWS = 8
"""The synthetic task's users own 1 to this many consecutive rows (seeded by ``data.seed``)."""


def _check_user_source(task: str, data_dir: str | None, privacy_unit: str, user_column: str | None) -> None:
    """Refuse user-level DP on a source without users: GLUE from the hub, or a TSV without ``data.user_column``."""
    if privacy_unit != "user" or task == "synthetic":
        return
    if data_dir is None:
        raise ValueError(
            f"data.privacy_unit=user: GLUE's {task} from the hub has no user column; set data.data_dir to TSV files "
            "with one and name it with data.user_column"
        )
    if user_column is None:
        raise ValueError("data.privacy_unit=user needs data.user_column: the train.tsv column naming each row's user")


def _check_data_dir(folder: Path, task: str) -> None:
    """Refuse a ``data.data_dir`` that is missing, a file, or a folder with neither of the task's TSV files."""
    flag, files = f"data.data_dir={str(folder)!r}", f"GLUE's {task} train.tsv and dev.tsv"
    if not folder.exists():
        raise ValueError(f"{flag}: no such folder (expected {files} there)")
    if not folder.is_dir():
        raise ValueError(f"{flag}: is a file, expected a folder with {files}")
    if not any((folder / f"{split}.tsv").exists() for split in ("train", "dev")):
        below = folder / task
        hint = f"; they are in {below}: set data.data_dir to it" if (below / "dev.tsv").is_file() else ""
        raise ValueError(f"{flag}: the folder has neither train.tsv nor dev.tsv (expected {files}){hint}")


def _check_counts(**counts: int | None) -> None:
    for name, value in counts.items():
        if value is not None:
            check_count(name, value)
