"""GlueDataModule: GLUE SST-2 / QNLI / QQP (hub or local TSV) or the offline synthetic task, as prompts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from dplit.data.batches import TokenizedDataset
from dplit.data.datamodule import TRAIN, DPDataModule, check_counts
from dplit.data.files import read_glue_tsv
from dplit.data.prompt import PromptTemplate
from dplit.data.sources import HUB_DATASET, TextSplit, load_hub_split
from dplit.data.synthetic import build_synthetic_tokenizer, make_synthetic_split
from dplit.data.tasks import TaskSpec, get_task
from dplit.data.tokenizer import label_word_ids

Split = Literal["train", "dev"]
_HUB_SPLITS: dict[str, str] = {"train": "train", "dev": "validation"}


class GlueDataModule(DPDataModule):
    """Prompt-style classification data for a causal LM: the answer is the label word after the prompt.

    Each example becomes ``template`` filled with its texts (truncated to ``max_length`` tokens, the
    template text never cut) and a class index; the model scores the label words at the last token.
    Validation and test both use GLUE's dev split (GLUE's test split has no labels). An option that the task
    ignores (``data_dir`` for ``synthetic``, ``synthetic_train_size`` for a GLUE task, ...) is warned about when
    it was changed from its default. The user column of ``privacy_unit: user`` is a ``train.tsv`` column; the
    synthetic task draws its own users (:func:`~dplit.data.users.synthetic_users`).

    Args:
        task: ``"sst2"``, ``"qnli"``, ``"qqp"`` or ``"synthetic"`` (built-in, offline, own tokenizer).
        data_dir: folder with GLUE's ``train.tsv`` and ``dev.tsv`` for the task; ``None`` loads
            ``nyu-mll/glue`` from the Hugging Face hub.
        template: prompt format string over the task's text columns (default: the task's).
        label_words: raw label string → single-token word (leading space for GPT-2); the class index of
            a label is its position in the dict (default: the task's).
        synthetic_train_size: training examples of the synthetic task.
        synthetic_val_size: dev examples of the synthetic task.
        privacy_unit: ``"example"`` (each row is protected) or ``"user"`` (each user, all of its rows).
        **kwargs: the options every DataModule takes (:class:`~dplit.data.datamodule.DPDataModule`).
    """

    EVAL_SPLIT = "dev"
    SHORTEST = 1

    def __init__(
        self,
        task: str = "sst2",
        data_dir: str | None = None,
        template: str | None = None,
        label_words: dict[str, str] | None = None,
        synthetic_train_size: int = 20_000,
        synthetic_val_size: int = 1_000,
        privacy_unit: Literal["example", "user"] = "example",
        **kwargs: Any,
    ) -> None:
        super().__init__(privacy_unit=privacy_unit, **kwargs)
        self.spec: TaskSpec = get_task(task)
        self.task = task
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None and task != "synthetic" else None
        self.label_words = _resolve_label_words(self.spec, label_words)
        self.label_word_ids: list[int] = label_word_ids(self.tokenizer, self.label_words)
        self.num_classes: int = len(self.label_words)
        self.prompt = PromptTemplate(template or self.spec.template, self.spec.text_columns, self.tokenizer,
                                     self.max_length)  # fmt: skip
        self._class_index = {label: index for index, label in enumerate(self.label_words)}

    @override
    def check_options(self) -> None:
        """Refuse an unknown task, users on a source without them, a bad size or ``data_dir``; warn of ignored ones."""
        hp = self.hparams
        _check_user_source(hp.task, hp.data_dir, hp.privacy_unit, hp.user_column)
        get_task(hp.task)
        check_counts(synthetic_train_size=hp.synthetic_train_size, synthetic_val_size=hp.synthetic_val_size)
        self.warn_ignored(_ignored_options(hp.task), context=f" with data.task={hp.task}")
        if hp.data_dir is not None and hp.task != "synthetic":
            _check_data_dir(Path(hp.data_dir).expanduser(), hp.task)

    @override
    @classmethod
    def builtin_tokenizer(cls, hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase | None:
        """The synthetic task's own tokenizer for ``task: synthetic``."""
        return build_synthetic_tokenizer() if hparams.get("task", "sst2") == "synthetic" else None

    @override
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

    @override
    def test_dataloader(self) -> DataLoader:
        """GLUE dev batches, in order (GLUE's test split has no labels)."""
        return self.val_dataloader()

    def _read(self, split: Split) -> TextSplit:
        hp = self.hparams
        if self.task == "synthetic":
            return make_synthetic_split(split, self.builtin_size(split, hp.synthetic_train_size, hp.synthetic_val_size),
                                        hp.seed)  # fmt: skip
        if self.data_dir is not None:
            path = self.data_dir / f"{split}.tsv"
            if not path.exists():
                raise FileNotFoundError(f"data.data_dir: {path} not found (GLUE's {self.task} {split} split)")
            return read_glue_tsv(path, self.spec, self.limit(split), user_column=self.user_column_of(split))
        return load_hub_split(self.spec, _HUB_SPLITS[split], self.limit(split))

    @override
    def build(self, split: str) -> TokenizedDataset:
        """Encode a split's prompts, logging their length statistics.

        The statistics stay out of the logs when the split is private and the trainer's strategy keeps private
        diagnostics out of them (``DPStrategy.private_diagnostics=false``).
        """
        texts, private = self._read(split), split == TRAIN  # type: ignore[arg-type]
        encoded = self.prompt.encode(texts.texts)
        labels = [self._class_index[label] for label in texts.labels]
        longest = max(len(ids) for ids in encoded.input_ids)
        statistics = (
            ""
            if private and not self.private_diagnostics
            else f", longest prompt {longest} tokens, {encoded.num_truncated} truncated to "
            f"data.max_length={self.prompt.max_length}"
        )
        rank_zero_info(f"{self.task}: {len(labels)} examples from {texts.source}{statistics}")
        users = self.users_of(texts.users, rows=len(texts), source=texts.source) if private else None
        return TokenizedDataset(
            encoded.input_ids, labels, users=users, max_rows_per_user=self.hparams.max_rows_per_user
        )


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


def _ignored_options(task: str) -> dict[str, str]:
    """The options ``task`` ignores, and why."""
    if task == "synthetic":
        return dict.fromkeys(("data_dir", "tokenizer", "gguf_file"), "it makes its own examples and tokenizer")
    return dict.fromkeys(("synthetic_train_size", "synthetic_val_size", "seed"), "only data.task=synthetic uses it")


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
