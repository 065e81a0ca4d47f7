"""Every reader of a user's data file: JSONL / JSON / CSV / TXT corpora and GLUE's TSV files.

One function per format (:func:`read_jsonl`, :func:`read_json`, :func:`read_csv`, :func:`read_txt`,
:func:`read_glue_tsv`), all opening the file as UTF-8 with :func:`utf8_text` and refusing bad input in one line with
:func:`refusal`, which names the file and, where there is one, the row (``train.jsonl, line 3: not valid JSON ...``).
A refusal never quotes the row's private text.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TextIO

from dplit.data.sources import TextSplit, non_empty
from dplit.data.tasks import TaskSpec

FILE_TYPES = (".jsonl", ".json", ".csv", ".txt")
"""The suffixes of a corpus file (``data.train_file``, ``--prompts_file``), any case."""
_LONGEST_CSV_FIELD = 2**31 - 1
_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def refusal(path: Path | str, problem: str, where: int | str | None = None) -> ValueError:
    """The one-line refusal of a file, naming the file and the row: ``path, line 3: problem``.

    Args:
        path: the file (or another source, for messages).
        problem: what is wrong.
        where: the row: its 1-based line (an int), another place (``"item 3"`` of a JSON array), or ``None`` for
            the file as a whole (``path: problem``).

    Returns:
        The error, to raise.
    """
    if where is None:
        return ValueError(f"{path}: {problem}")
    return ValueError(f"{path}, {f'line {where}' if isinstance(where, int) else where}: {problem}")


class Record(NamedTuple):
    """One row of a local file: where it is (1-based ``line 3``, or ``item 3`` of a JSON array) and its columns."""

    number: int
    columns: Mapping[str, Any]
    unit: str = "line"


@dataclass(frozen=True)
class TextRows:
    """Raw rows of one split: a text each, or a prompt and a response each, and where they came from."""

    texts: list[str] | None
    prompts: list[str] | None
    responses: list[str] | None
    source: str
    lines: list[int] | None = None
    """The 1-based file line of each row, where it may differ from the row number (local files)."""
    users: list[str] | None = None
    """Each row's user id (``data.user_column``, user-level DP)."""


# ---------------------------------------------------------------------------------------------------------------------
# Corpus files: JSONL / JSON / CSV / TXT (data.train_file, data.val_file, --prompts_file)


def check_data_file(flag: str, value: str) -> None:
    """Refuse a ``data.train_file`` / ``data.val_file`` that is missing, a directory or of an unknown type.

    Args:
        flag: the option, for the message (``"data.train_file"``).
        value: its value, a path.
    """
    path = Path(value).expanduser()
    expected = f"expected a {'/'.join(FILE_TYPES)} file"
    if path.is_dir():
        raise ValueError(f"{flag}={value!r}: is a directory, {expected}")
    if not path.is_file():
        raise ValueError(f"{flag}={value!r}: no such file ({expected})")
    if path.suffix.lower() not in FILE_TYPES:
        raise ValueError(f"{flag}={value!r}: unknown file type {path.suffix!r}; use one of {sorted(FILE_TYPES)}")


def read_rows(
    path: Path, columns: tuple[str, ...], limit: int | None = None, *, user_column: str | None = None
) -> TextRows:
    """Read the ``columns`` of a local JSONL / JSON / CSV / TXT file (UTF-8, one example per row).

    A JSONL file holds one JSON object per line; a JSON file holds an array of objects (or JSON Lines); a CSV
    file has a header line; a TXT file is one text per line (a single column, named ``columns[0]``). Blank
    (whitespace-only) lines are skipped in every format; messages name the file's 1-based line.
    A column's value must be a string (JSON ``null`` reads as an empty text, refused when tokenised).

    Args:
        path: the file.
        columns: the columns to read (``("text",)`` or ``("prompt", "response")``).
        limit: read only the first ``limit`` rows.
        user_column: a column naming each row's user (``data.user_column``: a string or an integer), read into
            ``users``.

    Returns:
        The rows, each with its file line.

    Raises:
        ValueError: naming the file (and the line) for a missing file, a directory, an unknown suffix, an empty
            file, text that is not UTF-8, a line that is not JSON or not an object, a CSV row with the wrong
            number of fields, a missing column, a value that is not a string, or a file with no rows.
    """
    records = read_records(path, columns, limit)
    rows = records_to_rows(path, records, columns)
    if user_column is None:
        return rows
    return replace(rows, users=[record_user(path, record, user_column) for record in records])


def record_user(path: Path | str, record: Record, column: str) -> str:
    """A record's user id (a string or an integer), refusing a missing or blank one (never printing an id)."""
    where = f"{record.unit} {record.number}"
    value = record.columns.get(column)
    if value is None or isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise refusal(path, f"no user id in data.user_column={column!r} (missing, blank or not a string)", where)
    return str(value).strip()


def read_records(path: Path, columns: tuple[str, ...], limit: int | None = None) -> list[Record]:
    """The rows of a local JSONL / JSON / CSV / TXT file as :func:`read_rows` parses them, columns not yet checked.

    ``dplit lm generate`` reads its prompts file with it, so prompts and training files are read alike.

    Args:
        path: the file.
        columns: the columns to be read (a TXT file's one column is named ``columns[0]``).
        limit: read only the first ``limit`` rows.

    Returns:
        The non-blank rows, each with its 1-based line (or JSON array item) and all of its columns.

    Raises:
        ValueError: naming the file (and the line) for a missing file, a directory, an unknown suffix, an empty
            file, text that is not UTF-8, a line that is not JSON or not an object, a CSV quote left open, a CSV
            row with the wrong number of fields, or a file with no rows.
    """
    if path.is_dir():
        raise refusal(path, f"is a directory, expected a {'/'.join(FILE_TYPES)} file")
    if not path.is_file():
        raise refusal(path, "no such file")
    suffix = path.suffix.lower()
    if suffix not in FILE_TYPES:
        raise refusal(path, f"unknown file type {path.suffix!r}; use one of {sorted(FILE_TYPES)}")
    if path.stat().st_size == 0:
        raise refusal(path, "the file is empty (0 bytes)")
    if suffix == ".txt" and len(columns) != 1:
        raise refusal(
            path,
            f"a .txt file is one text per line, without the columns {list(columns)} of instruction data "
            "(data.prompt_column, data.response_column); use a .jsonl, .json or .csv file",
        )
    with utf8_text(path) as file:
        records = list(islice(_READERS[suffix](path, file, columns[0]), limit))
    if not records and limit != 0:
        raise refusal(path, "no examples (only blank lines)")
    return records


def read_txt(path: Path, file: TextIO, column: str) -> Iterator[Record]:
    """The non-blank lines of a TXT file, one text each (its line end dropped), as the one column ``column``."""
    for line, text in enumerate(file, start=1):
        if text.strip():
            yield Record(line, {column: text.rstrip("\r\n")})


def read_jsonl(path: Path, file: TextIO, column: str = "") -> Iterator[Record]:
    """The JSON objects of a JSON Lines file, one per non-blank line (every column of an object is read).

    Raises:
        ValueError: naming the file and line of a line that is not JSON, or not a JSON object.
    """
    for line, text in enumerate(file, start=1):
        if text.strip():
            yield Record(line, _json_object(path, line, _json_value(path, text, line)))


def read_json(path: Path, file: TextIO, column: str = "") -> Iterator[Record]:
    """The objects of a ``.json`` file: one JSON array of objects (rows numbered by item), or else JSON Lines.

    Raises:
        ValueError: naming the file and line (or array item) of text that is not JSON, or not JSON objects, or
            an empty array.
    """
    text = file.read()
    if not text.lstrip().startswith("["):
        yield from read_jsonl(path, io.StringIO(text, newline=""), column)
        return
    items = _json_value(path, text)
    if not items:
        raise refusal(path, "no examples (an empty JSON array)")
    for item, value in enumerate(items, start=1):
        yield Record(item, _json_object(path, f"item {item}", value), unit="item")


def _json_value(path: Path, text: str, line: int = 1) -> Any:
    """``json.loads(text)`` for ``text`` starting on ``line`` of the file; an error names the file's line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = line + error.lineno - 1
        raise refusal(path, f"not valid JSON ({error.msg} at column {error.colno})", where) from None


def _json_object(path: Path, where: int | str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise refusal(path, f"expected a JSON object (one example), found a JSON {_json_kind(value)}", where)
    return value


def _json_kind(value: Any) -> str:
    return "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)


def read_csv(path: Path, file: TextIO, column: str = "") -> Iterator[Record]:
    """Rows of a CSV file after its header line, each with the same number of fields as the header.

    Parsed strictly: a quote left open would otherwise swallow every later row into one field (one example where
    there are many, so N and δ would be wrong), so it is refused naming the line it opens on. Every column of the
    header is read.

    Raises:
        ValueError: naming the file and line of a quote left open or a row with the wrong number of fields, or
            the file when it has only a header line.
    """
    csv.field_size_limit(max(csv.field_size_limit(), _LONGEST_CSV_FIELD))  # the default, 128 KiB, cuts documents
    rows = ((line, row) for line, row in csv_rows(path, file, strict=True) if not is_blank(row))
    header_line, header = next(rows, (0, []))
    if not header:
        return
    count = 0
    for line, row in rows:
        if len(row) != len(header):
            raise refusal(
                path,
                f"expected {len(header)} comma-separated fields like the header (line {header_line}), found {len(row)}",
                line,
            )
        count += 1
        yield Record(line, dict(zip(header, row, strict=True)))
    if not count:
        raise refusal(path, "no examples (only the header line)")


class Reader(Protocol):
    """The reader of one file format (:func:`read_jsonl`, :func:`read_json`, :func:`read_csv`, :func:`read_txt`)."""

    def __call__(self, path: Path, file: TextIO, column: str, /) -> Iterator[Record]:
        """The file's non-blank rows, each with its 1-based line (or JSON array item) and its columns.

        Args:
            path: the file (for messages).
            file: the file, open as :func:`utf8_text` opens it.
            column: the name of a TXT file's one column (the other formats read every column of a row).
        """
        ...


_READERS: dict[str, Reader] = {
    ".jsonl": read_jsonl,
    ".json": read_json,
    ".csv": read_csv,
    ".txt": read_txt,
}


def records_to_rows(path: Path | str, records: list[Record], columns: tuple[str, ...], *, flag: str = "") -> TextRows:
    """Check that every record has the ``columns``, as strings (``null``: empty), and gather them.

    Args:
        path: the file the records come from (for messages).
        records: what :func:`read_records` read.
        columns: the columns to gather (``("text",)`` or ``("prompt", "response")``).
        flag: the option that names the columns, added to a missing-column message (``"--prompt_column"``).

    Raises:
        ValueError: naming the file (and the row's line or item) for a missing column or a value that is not
            a string.
    """
    seen = list(dict.fromkeys(key for record in records for key in record.columns))
    missing = [column for column in columns if column not in seen]
    if missing:
        raise refusal(path, f"missing column(s) {missing}; the file has {seen}" + (f" ({flag})" if flag else ""))
    values: list[list[str]] = [[] for _ in columns]
    for record in records:
        where = f"{record.unit} {record.number}"
        for column, column_values in zip(columns, values, strict=True):
            if column not in record.columns:
                raise refusal(path, f"missing column {column!r} (other rows have it)", where)
            value = record.columns[column]
            if value is not None and not isinstance(value, str):
                raise refusal(path, f"column {column!r} is a JSON {_json_kind(value)}, expected a string", where)
            column_values.append(value or "")
    lines = [record.number for record in records] if records and records[0].unit == "line" else None
    if len(columns) == 1:
        return TextRows(values[0], None, None, str(path), lines)
    return TextRows(None, values[0], values[1], str(path), lines)


# ---------------------------------------------------------------------------------------------------------------------
# GLUE's TSV files (data.data_dir)


def read_glue_tsv(path: Path, spec: TaskSpec, limit: int | None = None, *, user_column: str | None = None) -> TextSplit:
    """Read a GLUE TSV file (header row, tab-separated, no quoting: QNLI texts may start with ``"``).

    Blank (whitespace-only) lines are skipped.

    Args:
        path: the TSV file, e.g. ``glue/qnli/dev.tsv``.
        spec: the task, giving the header's required columns and the label strings.
        limit: read only the first ``limit`` examples.
        user_column: a column naming each row's user (``data.user_column``), read into ``users``.

    Returns:
        The split.

    Raises:
        FileNotFoundError: when the file is missing.
        ValueError: naming the file (and the 1-based line) for a directory, text that is not UTF-8, a missing
            column, a row with the wrong number of fields, a label outside the task's label set, a row whose
            texts are all empty, or a file without examples (empty, only blank lines, or a header without rows).
    """
    if path.is_dir():
        raise refusal(path, f"is a directory, expected a GLUE {spec.name} TSV file")
    if not path.is_file():
        raise FileNotFoundError(f"GLUE {spec.name} file not found: {path}")
    if path.stat().st_size == 0:
        raise refusal(path, f"the file is empty (0 bytes); a GLUE {spec.name} TSV starts with its header row")
    texts: dict[str, list[str]] = {column: [] for column in spec.text_columns}
    labels: list[str] = []
    users: list[str] | None = [] if user_column is not None else None
    blank_lines = 0
    with utf8_text(path) as file:
        rows = csv_rows(path, file, delimiter="\t", quoting=csv.QUOTE_NONE)
        _, header = next(rows, (1, []))
        if is_blank(header) and all(is_blank(row) for _, row in rows):
            raise refusal(path, "no examples (only blank lines)")
        positions = _column_positions(path, header, spec)
        if user_column is not None and user_column not in positions:
            raise refusal(path, f"data.user_column={user_column!r} is not a column; the header (line 1) is {header}")
        for line, row in rows:
            if is_blank(row):
                blank_lines += 1
                continue
            if limit is not None and len(labels) >= limit:
                break
            if len(row) != len(header):
                raise refusal(path, f"expected {len(header)} tab-separated fields ({header}), found {len(row)}", line)
            label = row[positions[spec.label_column]]
            if label not in spec.labels:
                raise refusal(path, f"the label is not one of the {spec.name} labels {sorted(spec.labels)}", line)
            _check_has_text(path, line, row, positions, spec)
            labels.append(label)
            for column, values in texts.items():
                values.append(row[positions[column]])
            if users is not None:
                users.append(_user_id(path, line, row[positions[str(user_column)]]))
    if not labels and blank_lines:
        raise refusal(path, "no examples (only blank lines after the header)")
    return non_empty(TextSplit(texts, labels, str(path), users))


def _user_id(path: Path, line: int, value: str) -> str:
    """A row's user id, refusing a blank one (the id itself is private: never in the message)."""
    if not value.strip():
        raise refusal(path, "the user id (data.user_column) is blank", line)
    return value.strip()


def _column_positions(path: Path, header: list[str], spec: TaskSpec) -> dict[str, int]:
    for column in spec.tsv_columns:
        if column not in header:
            raise refusal(path, f"missing column {column!r}; the header (line 1) is {header}")
    return {column: header.index(column) for column in header}


def _check_has_text(path: Path, line: int, row: list[str], positions: dict[str, int], spec: TaskSpec) -> None:
    """Refuse a row whose text columns are all empty or whitespace: it would train on the template alone.

    One empty text of a pair is kept: GLUE's own QQP train.tsv has two rows with an empty ``question2``.
    """
    if not any(row[positions[column]].strip() for column in spec.text_columns):
        raise refusal(path, f"empty {' and '.join(spec.text_columns)} (nothing to classify)", line)


# ---------------------------------------------------------------------------------------------------------------------
# What every reader shares: UTF-8 text, CSV/TSV rows with their lines


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
        return str(refusal(path, f"not UTF-8 text (at column {column}){hint}", line))
    return str(refusal(path, "not UTF-8 text"))


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
        raise _csv_refusal(path, start, reader.line_num, error) from None


def _csv_refusal(path: Path, start: int, line: int, error: csv.Error) -> ValueError:
    """Where a row the ``csv`` module refused goes wrong: a quote left open on ``start`` reads on to ``line``."""
    if line > start or "end of data" in str(error):  # a quoted field ran past its line end, or to the file's end
        return refusal(
            path,
            f"the quote that opens a field on this line is never closed (the field runs on to line {line}: {error}); "
            'close it, or double each quote inside a quoted field ("")',
            start,
        )
    return refusal(path, f"not readable as CSV/TSV ({error})", line)


def is_blank(row: list[str]) -> bool:
    """Whether a parsed CSV/TSV row comes from a blank (empty or whitespace-only) line."""
    return not row or (len(row) == 1 and not row[0].strip())
