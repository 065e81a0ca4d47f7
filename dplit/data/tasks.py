"""Task specifications: text columns, label strings, default prompt template and label words per task."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskSpec:
    """What dplit needs to know about one classification task.

    Args:
        name: task name as given to ``data.task`` (and as the GLUE hub config name).
        text_columns: text columns of the task, named as in GLUE's TSV header and on the hub.
        template: default prompt, a Python format string over ``text_columns``; the answer follows its end.
        label_words: default label words, raw label string → word; class index = position in the dict.
        label_column: name of the label column in GLUE's TSV header.
        id_columns: the columns of GLUE's TSV header before the text columns (an index or ids), unused but required.
        hub_labels: label string (as written in GLUE's TSV) of each integer hub label, by hub index.
    """

    name: str
    text_columns: tuple[str, ...]
    template: str
    label_words: dict[str, str] = field(hash=False)
    label_column: str = "label"
    id_columns: tuple[str, ...] = ()
    hub_labels: tuple[str, ...] = ("0", "1")

    @property
    def tsv_columns(self) -> tuple[str, ...]:
        """The full header of GLUE's TSV files (every column that must be present)."""
        return (*self.id_columns, *self.text_columns, self.label_column)

    @property
    def labels(self) -> frozenset[str]:
        """The task's label strings."""
        return frozenset(self.hub_labels)


SST2 = TaskSpec(
    name="sst2", text_columns=("sentence",), template="{sentence} It was", label_words={"0": " terrible", "1": " great"}
)
QNLI = TaskSpec(
    name="qnli", text_columns=("question", "sentence"), id_columns=("index",),
    template="Question: {question} Sentence: {sentence} Does the sentence answer the question?",
    label_words={"not_entailment": " no", "entailment": " yes"}, hub_labels=("entailment", "not_entailment"),
)  # fmt: skip
QQP = TaskSpec(
    name="qqp", text_columns=("question1", "question2"), id_columns=("id", "qid1", "qid2"),
    template="Question 1: {question1} Question 2: {question2} Same question?",
    label_words={"0": " no", "1": " yes"}, label_column="is_duplicate",
)  # fmt: skip
SYNTHETIC = TaskSpec(
    name="synthetic", text_columns=("sentence",), template="{sentence} overall it was",
    label_words={"0": " bad", "1": " good"},
)  # fmt: skip
"""The built-in offline task (:mod:`dplit.data.synthetic`): it reads no TSV file."""

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (SST2, QNLI, QQP, SYNTHETIC)}


def get_task(name: str) -> TaskSpec:
    """Look up a task by name.

    Args:
        name: one of ``sst2``, ``qnli``, ``qqp``, ``synthetic``.

    Returns:
        The task's specification.

    Raises:
        ValueError: for an unknown task, naming ``data.task`` and the choices.
    """
    if name not in TASKS:
        raise ValueError(f"data.task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]
