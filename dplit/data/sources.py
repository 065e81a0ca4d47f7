"""Reading a GLUE split as texts and label strings: from GLUE's own TSV files or from the Hugging Face hub."""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import datasets
from datasets.exceptions import DatasetNotFoundError

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
    """

    texts: dict[str, list[str]]
    labels: list[str]
    source: str

    def __len__(self) -> int:
        return len(self.labels)


def read_glue_tsv(path: Path, spec: TaskSpec, limit: int | None = None) -> TextSplit:
    """Read a GLUE TSV file (header row, tab-separated, no quoting: QNLI texts may start with ``"``).

    Blank (whitespace-only) lines are skipped.

    Args:
        path: the TSV file, e.g. ``glue/qnli/dev.tsv``.
        spec: the task, giving the header's required columns and the label strings.
        limit: read only the first ``limit`` examples.

    Returns:
        The split.

    Raises:
        FileNotFoundError: when the file is missing.
        ValueError: naming the file (and the 1-based line) for a directory, text that is not UTF-8, a missing
            column, a row with the wrong number of fields, a label outside the task's label set, a row whose
            texts are all empty, or a file without examples (empty, only blank lines, or a header without rows).
    """
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, expected a GLUE {spec.name} TSV file")
    if not path.is_file():
        raise FileNotFoundError(f"GLUE {spec.name} file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); a GLUE {spec.name} TSV starts with its header row")
    texts: dict[str, list[str]] = {column: [] for column in spec.text_columns}
    labels: list[str] = []
    blank_lines = 0
    with utf8_text(path) as file:
        rows = csv_rows(path, file, delimiter="\t", quoting=csv.QUOTE_NONE)
        _, header = next(rows, (1, []))
        if is_blank(header) and all(is_blank(row) for _, row in rows):
            raise ValueError(f"{path}: no examples (only blank lines)")
        positions = _column_positions(path, header, spec)
        for line, row in rows:
            if is_blank(row):
                blank_lines += 1
                continue
            if limit is not None and len(labels) >= limit:
                break
            if len(row) != len(header):
                raise ValueError(
                    f"{path}, line {line}: expected {len(header)} tab-separated fields ({header}), found {len(row)}"
                )
            label = row[positions[spec.label_column]]
            if label not in spec.labels:
                raise ValueError(
                    f"{path}, line {line}: the label is not one of the {spec.name} labels {sorted(spec.labels)}"
                )
            _check_has_text(path, line, row, positions, spec)
            labels.append(label)
            for column, values in texts.items():
                values.append(row[positions[column]])
    if not labels and blank_lines:
        raise ValueError(f"{path}: no examples (only blank lines after the header)")
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
            raise ValueError(f"{source}, row {row_number}: the label is not one of 0..{len(spec.hub_labels) - 1}")
        labels.append(spec.hub_labels[label])
    texts = {column: list(dataset[column]) for column in spec.text_columns}
    return _non_empty(TextSplit(texts, labels, source))


def load_hub_dataset(name: str, flag: str, *args: Any, **options: Any) -> Any:
    """``datasets.load_dataset(name, *args, **options)``, refusing a dataset the hub cannot give in one line.

    Raises:
        ValueError: naming ``flag`` when the hub is unreachable (offline) and the dataset is not cached, or the
            hub has no such dataset (or it is private).
    """
    try:
        return datasets.load_dataset(name, *args, **options)
    except (ConnectionError, DatasetNotFoundError) as error:
        raise ValueError(" ".join(unloadable_message(name, flag, error, what="dataset").split())) from None


def _column_positions(path: Path, header: list[str], spec: TaskSpec) -> dict[str, int]:
    for column in spec.tsv_columns:
        if column not in header:
            raise ValueError(f"{path}: missing column {column!r}; the header (line 1) is {header}")
    return {column: header.index(column) for column in header}


def _check_has_text(path: Path, line: int, row: list[str], positions: dict[str, int], spec: TaskSpec) -> None:
    """Refuse a row whose text columns are all empty or whitespace: it would train on the template alone.

    One empty text of a pair is kept: GLUE's own QQP train.tsv has two rows with an empty ``question2``.
    """
    if not any(row[positions[column]].strip() for column in spec.text_columns):
        raise ValueError(f"{path}, line {line}: empty {' and '.join(spec.text_columns)} (nothing to classify)")


def _non_empty(split: TextSplit) -> TextSplit:
    if not len(split):
        raise ValueError(f"{split.source} has no examples (empty split)")
    return split


@contextmanager
def utf8_text(path: Path) -> Iterator[TextIO]:
    """Open ``path`` as UTF-8 text (a leading byte-order mark dropped, line ends kept as written: ``newline=""``).

    Raises:
        ValueError: naming the file and the 1-based line and column where the text stops being UTF-8.
    """
    try:
        with path.open(encoding="utf-8-sig", newline="") as file:
            yield file
    except UnicodeDecodeError:
        raise ValueError(not_utf8_message(path)) from None


def not_utf8_message(path: Path) -> str:
    """Where ``path`` stops being UTF-8: its 1-based line and column (in characters); never the private byte itself."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = max(data.rfind(b"\n", 0, error.start), data.rfind(b"\r", 0, error.start)) + 1
        line = len(re.findall(rb"\r\n|\r|\n", data[: error.start])) + 1
        column = len(data[line_start : error.start].decode("utf-8").removeprefix("\ufeff")) + 1
        hint = "; it looks like UTF-16: save it as UTF-8" if data.startswith((b"\xff\xfe", b"\xfe\xff")) else ""
        return f"{path}, line {line}: not UTF-8 text (at column {column}){hint}"
    return f"{path}: not UTF-8 text"


def csv_rows(path: Path, file: TextIO, **dialect: Any) -> Iterator[tuple[int, list[str]]]:
    """The rows of ``csv.reader(file, **dialect)``, each with the 1-based line it starts on.

    Raises:
        ValueError: naming the file and line for a row the ``csv`` module cannot read (with ``strict=True``, a
            quote left open: the line it opens on).
    """
    reader = csv.reader(file, **dialect)
    start = 1
    try:
        for row in reader:
            yield start, row
            start = reader.line_num + 1
    except csv.Error as error:
        raise ValueError(_csv_error_message(path, start, reader.line_num, error)) from None


def _csv_error_message(path: Path, start: int, line: int, error: csv.Error) -> str:
    """Where a row the ``csv`` module refused goes wrong: a quote left open on ``start`` reads on to ``line``."""
    if line > start or "end of data" in str(error):  # a quoted field ran past its line end, or to the file's end
        return (
            f"{path}, line {start}: the quote that opens a field on this line is never closed (the field runs on to "
            f'line {line}: {error}); close it, or double each quote inside a quoted field ("")'
        )
    return f"{path}, line {line}: not readable as CSV/TSV ({error})"


def is_blank(row: list[str]) -> bool:
    """Whether a parsed CSV/TSV row comes from a blank (empty or whitespace-only) line."""
    return not row or (len(row) == 1 and not row[0].strip())
