"""Where data comes from: a GLUE split from the Hugging Face hub, any hub dataset, and the split type they give.

Local files (GLUE's TSV files, a JSONL / JSON / CSV / TXT corpus) are read by :mod:`dplit.data.files`; the built-in
data by :mod:`dplit.data.synthetic` and :mod:`dplit.data.corpus`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dplit.backbone.causal_lm import unloadable_message
from dplit.data.tasks import TaskSpec

HUB_DATASET = "nyu-mll/glue"


@dataclass(frozen=True)
class TextSplit:
    """One split of a task before tokenisation.

    Args:
        texts: text column → one text per example.
        labels: one raw label string per example (as written in GLUE's TSV files).
        source: where the split came from (a file path or hub name), for messages.
        users: each example's user id (user-level DP), when the source names them.
    """

    texts: dict[str, list[str]]
    labels: list[str]
    source: str
    users: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)


def load_hub_split(spec: TaskSpec, split: str, limit: int | None = None) -> TextSplit:
    """Load a GLUE split from the Hugging Face hub (``nyu-mll/glue``), labels as GLUE's TSV strings.

    Args:
        spec: the task (its name is the hub config).
        split: ``"train"`` or ``"validation"``.
        limit: keep only the first ``limit`` examples.

    Returns:
        The split.
    """
    import datasets  # imported where the hub is used: it costs every ``dplit`` process ~1 s (pandas, arrow)

    dataset = datasets.load_dataset(HUB_DATASET, spec.name)[split]
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    source = f"{HUB_DATASET}/{spec.name}[{split}]"
    labels = []
    for row_number, label in enumerate(dataset["label"], start=1):
        if not 0 <= label < len(spec.hub_labels):
            raise ValueError(f"{source}, row {row_number}: the label is not one of 0..{len(spec.hub_labels) - 1}")
        labels.append(spec.hub_labels[label])
    texts = {column: list(dataset[column]) for column in spec.text_columns}
    return non_empty(TextSplit(texts, labels, source))


def load_hub_dataset(name: str, flag: str, *args: Any, **options: Any) -> Any:
    """``datasets.load_dataset(name, *args, **options)``, refusing a dataset the hub cannot give in one line.

    Raises:
        ValueError: naming ``flag`` when the hub is unreachable (offline) and the dataset is not cached, the
            hub has no such dataset (or it is private), or its files cannot be built into one table per split.
    """
    import datasets
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError

    try:
        return datasets.load_dataset(name, *args, **options)
    except (ConnectionError, DatasetNotFoundError) as error:
        raise ValueError(" ".join(unloadable_message(name, flag, error, what="dataset").split())) from None
    except DatasetGenerationError as error:  # the cause's text may quote rows: only its type is named
        cause = type(error.__cause__).__name__ if error.__cause__ is not None else "no cause given"
        raise ValueError(
            f"{flag}={name!r}: the datasets library could not build this dataset from its files ({cause}; "
            "do all of its splits have the same columns?)"
        ) from None


def non_empty(split: TextSplit) -> TextSplit:
    """``split``, refused (naming its source) when it has no examples."""
    if not len(split):
        raise ValueError(f"{split.source} has no examples (empty split)")
    return split
