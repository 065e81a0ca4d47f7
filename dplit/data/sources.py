"""Reading a GLUE split as texts and label strings: from GLUE's own TSV files or from the Hugging Face hub."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import datasets

from dplit.data.tasks import TaskSpec

HUB_DATASET = "nyu-mll/glue"


@dataclass(frozen=True)
class TextSplit:
    """One split of a task before tokenisation.

    Args:
        texts: text column → one text per example.
        labels: one raw label string per example (as written in GLUE's TSV files).
        source: where the split came from (a file path or hub name), for messages.
    """

    texts: dict[str, list[str]]
    labels: list[str]
    source: str

    def __len__(self) -> int:
        return len(self.labels)


def read_glue_tsv(path: Path, spec: TaskSpec, limit: int | None = None) -> TextSplit:
    """Read a GLUE TSV file (header row, tab-separated, no quoting: QNLI texts may start with ``"``).

    Args:
        path: the TSV file, e.g. ``glue/qnli/dev.tsv``.
        spec: the task, giving the header's required columns and the label strings.
        limit: read only the first ``limit`` examples.

    Returns:
        The split.

    Raises:
        FileNotFoundError: when the file is missing.
        ValueError: naming the file (and the 1-based line) for a missing column, a row with the wrong
            number of fields, a label outside the task's label set, or a file without examples.
    """
    if not path.is_file():
        raise FileNotFoundError(f"GLUE {spec.name} file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); a GLUE {spec.name} TSV starts with its header row")
    texts: dict[str, list[str]] = {column: [] for column in spec.text_columns}
    labels: list[str] = []
    with path.open(encoding="utf-8-sig", newline="") as file:
        reader = csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, [])
        positions = _column_positions(path, header, spec)
        rows = (row for row in reader if row)
        for row in islice(rows, limit):
            if len(row) != len(header):
                raise ValueError(
                    f"{path}, line {reader.line_num}: expected {len(header)} tab-separated fields "
                    f"({header}), found {len(row)}"
                )
            label = row[positions[spec.label_column]]
            if label not in spec.labels:
                raise ValueError(
                    f"{path}, line {reader.line_num}: label {label!r} is not one of the {spec.name} labels "
                    f"{sorted(spec.labels)}"
                )
            labels.append(label)
            for column, values in texts.items():
                values.append(row[positions[column]])
    return _non_empty(TextSplit(texts, labels, str(path)))


def load_hub_split(spec: TaskSpec, split: str, limit: int | None = None) -> TextSplit:
    """Load a GLUE split from the Hugging Face hub (``nyu-mll/glue``), labels as GLUE's TSV strings.

    Args:
        spec: the task (its name is the hub config).
        split: ``"train"`` or ``"validation"``.
        limit: keep only the first ``limit`` examples.

    Returns:
        The split.
    """
    dataset = datasets.load_dataset(HUB_DATASET, spec.name)[split]
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    source = f"{HUB_DATASET}/{spec.name}[{split}]"
    labels = []
    for row_number, label in enumerate(dataset["label"], start=1):
        if not 0 <= label < len(spec.hub_labels):
            raise ValueError(f"{source}, row {row_number}: label {label} is not one of 0..{len(spec.hub_labels) - 1}")
        labels.append(spec.hub_labels[label])
    texts = {column: list(dataset[column]) for column in spec.text_columns}
    return _non_empty(TextSplit(texts, labels, source))


def _column_positions(path: Path, header: list[str], spec: TaskSpec) -> dict[str, int]:
    for column in spec.tsv_columns:
        if column not in header:
            raise ValueError(f"{path}: missing column {column!r}; the header (line 1) is {header}")
    return {column: header.index(column) for column in header}


def _non_empty(split: TextSplit) -> TextSplit:
    if not len(split):
        raise ValueError(f"{split.source} has no examples (empty split)")
    return split
