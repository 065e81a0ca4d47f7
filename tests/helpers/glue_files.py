"""Small files in GLUE's exact TSV formats (real rows, quirks included) for offline tests."""

from __future__ import annotations

from pathlib import Path

SST2_HEADER = "sentence\tlabel"
QNLI_HEADER = "index\tquestion\tsentence\tlabel"
QQP_HEADER = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"

QNLI_ROWS = [
    "0\tWhat came into force after the new constitution was herald?\tAs of that day, the new constitution "
    "heralding the Second Republic came into force.\tentailment",
    '1\t"What is the first major city in the stream of the Rhine?\tThe most important tributaries in this '
    "area are the Ill below of Strasbourg.\tnot_entailment",
    '2\tWhat is the term for a hyperactive immune system?\t"Autoimmunity" is the term used here.\tentailment',
]
QQP_ROWS = [
    "133273\t213221\t213222\tHow is the life of a math student? Could you describe your own experiences?\t"
    "Which level of prepration is enough for the exam jlpt5?\t0",
    '402555\t536040\t536041\tHow do I control my "horny" emotions?\tHow do you control your horniness?\t1',
    "360472\t364011\t490273\tWhat causes stool color to change to yellow?\tWhat can cause stool to come out as "
    "little balls?\t0",
]
SST2_ROWS = [
    "it 's a charming and often affecting journey . \t1",
    "unflinchingly bleak and desperate \t0",
    '" the emperor \'s new clothes " is a waste of time . \t0',
]


def write_tsv(folder: Path, name: str, header: str, rows: list[str]) -> Path:
    r"""A GLUE-format TSV file (header line, tab-separated rows, ``\n`` line ends)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(f"{line}\n" for line in [header, *rows]), encoding="utf-8")
    return path


def write_glue_task(folder: Path, header: str, rows: list[str]) -> Path:
    """A task folder with ``train.tsv`` and ``dev.tsv`` holding the same rows."""
    write_tsv(folder, "train.tsv", header, rows)
    write_tsv(folder, "dev.tsv", header, rows)
    return folder
