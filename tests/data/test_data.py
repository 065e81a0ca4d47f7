"""Data package: GLUE TSV parsing, prompts and truncation, label words, errors, batching, synthetic task."""

from __future__ import annotations

import json
import pickle
import re
import warnings
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, RandomSampler
from transformers import PreTrainedTokenizerFast

from dplit.data import GlueDataModule, load_tokenizer
from dplit.data.batches import PadCollator
from dplit.data.files import read_glue_tsv, read_rows
from dplit.data.prompt import PromptTemplate, truncated_lengths
from dplit.data.synthetic import NEGATIVE_WORDS, POSITIVE_WORDS, build_synthetic_tokenizer
from dplit.data.tasks import QNLI, QQP, SST2, TASKS
from dplit.data.text import TextDataModule, encode_rows
from dplit.data.tokenizer import build_word_tokenizer, label_word_ids
from tests.helpers.glue_files import (
    QNLI_HEADER,
    QNLI_ROWS,
    QQP_HEADER,
    QQP_ROWS,
    SST2_HEADER,
    SST2_ROWS,
    write_glue_task,
    write_tsv,
)


@pytest.fixture
def gpt2_dir(shared_data_dir: Path) -> str:
    """The real GPT-2 tokenizer folder (skips without ``DPLIT_DATA_DIR``)."""
    return str(shared_data_dir / "gpt2-tokenizer")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer where every word is one token: easy token counting."""
    words = ["q", "s", "same", "?", *(f"w{i}" for i in range(40))]
    return build_word_tokenizer(words)


def words(count: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + count))


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    """The refusal's message, checked to be one line (the CLI prints it as ``dplit: error: <message>``)."""
    message = str(error.value)
    assert "\n" not in message and "\r" not in message, message
    return message


# --- TSV parsing -------------------------------------------------------------------------------


def test_qnli_tsv_with_unbalanced_quote_parses(tmp_path: Path) -> None:
    path = write_tsv(tmp_path, "dev.tsv", QNLI_HEADER, QNLI_ROWS)
    split = read_glue_tsv(path, QNLI)
    assert len(split) == 3
    assert split.texts["question"][1] == '"What is the first major city in the stream of the Rhine?'
    assert split.texts["sentence"][2] == '"Autoimmunity" is the term used here.'
    assert split.labels == ["entailment", "not_entailment", "entailment"]
    assert split.source == str(path)


def test_qqp_tsv_parses(tmp_path: Path) -> None:
    split = read_glue_tsv(write_tsv(tmp_path, "train.tsv", QQP_HEADER, QQP_ROWS), QQP)
    assert split.texts["question1"][1] == 'How do I control my "horny" emotions?'
    assert split.texts["question2"][0] == "Which level of prepration is enough for the exam jlpt5?"
    assert split.labels == ["0", "1", "0"]


def test_sst2_tsv_parses_and_keeps_trailing_space(tmp_path: Path) -> None:
    split = read_glue_tsv(write_tsv(tmp_path, "train.tsv", SST2_HEADER, SST2_ROWS), SST2)
    assert split.texts["sentence"][0] == "it 's a charming and often affecting journey . "
    assert split.texts["sentence"][2].startswith('" the emperor')
    assert split.labels == ["1", "0", "0"]


def test_tsv_limit_reads_first_rows(tmp_path: Path) -> None:
    split = read_glue_tsv(write_tsv(tmp_path, "train.tsv", QQP_HEADER, QQP_ROWS), QQP, limit=2)
    assert split.labels == ["0", "1"]


@pytest.mark.parametrize(
    ("task", "header", "rows", "labels"),
    [
        ("qnli", QNLI_HEADER, QNLI_ROWS, [1, 0, 1]),  # class order: not_entailment (" no"), entailment (" yes")
        ("qqp", QQP_HEADER, QQP_ROWS, [0, 1, 0]),
        ("sst2", SST2_HEADER, SST2_ROWS, [1, 0, 0]),
    ],
)
def test_datamodule_loads_local_tsv(
    tmp_path: Path, tiny_bpe_dir: Path, task: str, header: str, rows: list[str], labels: list[int]
) -> None:
    data = GlueDataModule(task, data_dir=str(write_glue_task(tmp_path, header, rows)), tokenizer=str(tiny_bpe_dir))
    data.setup("fit")
    assert data.dataset("train").labels == labels
    assert len(data.val_dataloader().dataset) == len(data.test_dataloader().dataset) == 3
    assert data.num_classes == 2 and data.task == task


def test_max_examples_cap_splits(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = write_glue_task(tmp_path, QNLI_HEADER, QNLI_ROWS)
    data = GlueDataModule(
        "qnli", data_dir=str(folder), tokenizer=str(tiny_bpe_dir), max_train_examples=2, max_eval_examples=1
    )
    assert len(data.train_dataloader().dataset) == 2
    assert len(data.val_dataloader().dataset) == 1


def test_hub_integer_labels_become_tsv_label_strings(monkeypatch: pytest.MonkeyPatch, tiny_bpe_dir: Path) -> None:
    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "sentence": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "not_entailment"]),
            "idx": datasets.Value("int32"),
        }
    )
    rows = {"question": ["Q one?", "Q two?", "Q three?"], "sentence": ["A.", "B.", "C."], "label": [0, 1, 0]}
    split = datasets.Dataset.from_dict({**rows, "idx": [0, 1, 2]}, features=features)
    calls = []

    def fake_load_dataset(path: str, name: str) -> datasets.DatasetDict:
        calls.append((path, name))
        return datasets.DatasetDict({"train": split, "validation": split})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = GlueDataModule("qnli", tokenizer=str(tiny_bpe_dir), max_train_examples=2)
    assert data.dataset("train").labels == [1, 0]  # entailment → class 1 (" yes")
    assert data.dataset("dev").labels == [1, 0, 1]
    assert calls[0] == ("nyu-mll/glue", "qnli")


# --- prompts and truncation ----------------------------------------------------------------------


def test_truncation_keeps_template_and_cuts_long_second_field() -> None:
    tokenizer = word_tokenizer()
    prompt = PromptTemplate("q {question1} s {question2} same ?", ("question1", "question2"), tokenizer, 12)
    ids = prompt.encode({"question1": [words(3)], "question2": [words(20, start=3)]}).input_ids[0]
    text = tokenizer.decode(ids)
    assert len(ids) == 12
    assert text == f"q {words(3)} s {words(5, start=3)} same ?"  # 4 template tokens + 3 + 5


def test_truncation_cuts_longest_field_first_then_later_on_tie() -> None:
    tokenizer = word_tokenizer()
    prompt = PromptTemplate("q {question1} s {question2} same ?", ("question1", "question2"), tokenizer, 13)
    encoded = prompt.encode({"question1": [words(10), words(5)], "question2": [words(10), words(5)]})
    assert [len(ids) for ids in encoded.input_ids] == [13, 13]
    assert tokenizer.decode(encoded.input_ids[0]) == f"q {words(5)} s {words(4)} same ?"
    assert tokenizer.decode(encoded.input_ids[1]) == f"q {words(5)} s {words(4)} same ?"
    assert encoded.num_truncated == 2


def test_short_prompt_is_not_truncated() -> None:
    prompt = PromptTemplate("{sentence} same ?", ("sentence",), word_tokenizer(), 256)
    encoded = prompt.encode({"sentence": [f"  {words(3)} "]})
    assert word_tokenizer().decode(encoded.input_ids[0]) == f"{words(3)} same ?"
    assert encoded.num_truncated == 0


def test_max_length_too_small_for_template_errors() -> None:
    with pytest.raises(ValueError, match=r"data\.max_length=5 cannot fit the template") as error:
        PromptTemplate("q {question1} s {question2} same ?", ("question1", "question2"), word_tokenizer(), 5)
    assert "4 tokens" in str(error.value)
    with pytest.raises(ValueError, match=r"data\.max_length=3"):
        GlueDataModule("synthetic", max_length=3, synthetic_train_size=10, synthetic_val_size=10)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{question} It was", r"field \{question\} is not one of the task's text columns \['sentence'\]"),
        ("{} It was", r"field \{\} is not one of"),
        ("It was", "must use at least one"),
        ("{sentence!r} It was", "not supported"),
        ("{sentence} {sentence}", "more than once"),
        ("{sentence It was", "not a valid format string"),
    ],
)
def test_bad_template_errors(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        PromptTemplate(template, ("sentence",), word_tokenizer(), 32)
    assert str(error.value).startswith(f"data.template {template!r}")


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=3), budget=st.integers(0, 60))
def test_truncated_lengths_equals_one_token_at_a_time(lengths: list[int], budget: int) -> None:
    expected = list(lengths)
    while sum(expected) > budget:
        longest = max(range(len(expected)), key=lambda index: (expected[index], index))
        expected[longest] -= 1
    assert truncated_lengths(lengths, budget) == expected


def test_prompt_tokens_match_whole_string_tokenisation(tiny_bpe_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_bpe_dir)
    prompt = PromptTemplate(QNLI.template, QNLI.text_columns, tokenizer, 256)
    question, sentence = "  Is the movie great?", '"It was" a great movie. '
    ids = prompt.encode({"question": [question], "sentence": [sentence]}).input_ids[0]
    whole = QNLI.template.format(question=question.strip(), sentence=sentence.strip())
    assert ids == tokenizer.encode(whole, add_special_tokens=False)


# --- label words ---------------------------------------------------------------------------------


def test_default_label_words_are_single_gpt2_tokens(gpt2_dir: str) -> None:
    tokenizer = load_tokenizer(gpt2_dir)
    for spec in (SST2, QNLI, QQP):
        for word in spec.label_words.values():
            assert word.startswith(" ")
            assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, (spec.name, word)
    assert tokenizer.encode(" terrible") == [7818] and tokenizer.encode(" great") == [1049]


def test_load_tokenizer_hello_world(gpt2_dir: str) -> None:
    tokenizer = load_tokenizer(gpt2_dir)
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert len(tokenizer) == 50257
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"


def test_load_tokenizer_from_local_bpe_files(tiny_bpe_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_bpe_dir)
    assert len(tokenizer) > 256  # not the silently empty tokenizer of vocab_file=/merges_file=
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None


def test_multi_token_label_word_errors(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = write_glue_task(tmp_path, SST2_HEADER, SST2_ROWS)
    with pytest.raises(ValueError, match="data.label_words") as error:
        GlueDataModule(
            "sst2", data_dir=str(folder), tokenizer=str(tiny_bpe_dir), label_words={"0": " xylophone", "1": " great"}
        )
    assert "' xylophone'" in str(error.value) and "exactly one token" in str(error.value)
    with pytest.raises(ValueError, match=r"data\.label_words: the word ' very good' for label '1'"):
        GlueDataModule("synthetic", label_words={"0": " bad", "1": " very good"})


def test_label_words_keys_must_match_task_labels() -> None:
    expected = r"data\.label_words .*synthetic label \['0', '1'\].*got keys \['neg', 'pos'\]"
    with pytest.raises(ValueError, match=expected):
        GlueDataModule("synthetic", label_words={"neg": " bad", "pos": " good"})
    data = GlueDataModule("synthetic", label_words={1: " bad", 0: " good"})  # YAML may give int keys
    assert data.label_word_ids == [data.tokenizer.convert_tokens_to_ids(word) for word in ("bad", "good")]
    assert data._class_index == {"1": 0, "0": 1}


def test_label_words_must_be_distinct_tokens() -> None:
    with pytest.raises(ValueError, match="distinct"):
        GlueDataModule("synthetic", label_words={"0": " good", "1": "good"})


# --- errors naming the file and row --------------------------------------------------------------


def test_unknown_task_errors() -> None:
    expected = r"data\.task must be one of \['qnli', 'qqp', 'sst2', 'synthetic'\], got 'mnli'"
    with pytest.raises(ValueError, match=expected):
        GlueDataModule("mnli")


def test_missing_column_names_file_column_and_header(tmp_path: Path) -> None:
    path = write_tsv(tmp_path, "train.tsv", "index\tquestion\tlabel", ["0\tWhy?\tentailment"])
    with pytest.raises(ValueError) as error:
        read_glue_tsv(path, QNLI)
    message = str(error.value)
    assert str(path) in message and "missing column 'sentence'" in message
    assert "['index', 'question', 'label']" in message


def test_unknown_label_names_file_row_and_label_set_but_not_the_private_value(tmp_path: Path) -> None:
    rows = [*QNLI_ROWS[:2], "2\tWhy?\tBecause.\tneutral"]
    path = write_tsv(tmp_path, "dev.tsv", QNLI_HEADER, rows)
    with pytest.raises(ValueError) as error:
        read_glue_tsv(path, QNLI)
    message = str(error.value)
    assert f"{path}, line 4" in message and "neutral" not in message
    assert "['entailment', 'not_entailment']" in message


def test_row_with_wrong_field_count_names_line(tmp_path: Path) -> None:
    path = write_tsv(tmp_path, "train.tsv", SST2_HEADER, [SST2_ROWS[0], "no label here"])
    with pytest.raises(ValueError, match=rf"{path}, line 3: expected 2 tab-separated fields"):
        read_glue_tsv(path, SST2)


def test_empty_split_names_file(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = tmp_path / "sst2"
    write_tsv(folder, "train.tsv", SST2_HEADER, SST2_ROWS)
    write_tsv(folder, "dev.tsv", SST2_HEADER, [])
    data = GlueDataModule("sst2", data_dir=str(folder), tokenizer=str(tiny_bpe_dir))
    with pytest.raises(ValueError, match=rf"{folder / 'dev.tsv'} has no examples"):
        data.setup("validate")


def test_missing_file_names_flag_and_path(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    write_tsv(tmp_path, "dev.tsv", QQP_HEADER, QQP_ROWS)  # enough to validate, not to fit
    data = GlueDataModule("qqp", data_dir=str(tmp_path), tokenizer=str(tiny_bpe_dir))
    data.setup("validate")
    with pytest.raises(FileNotFoundError) as error:
        data.setup("fit")
    assert one_line(error) == f"data.data_dir: {tmp_path / 'train.tsv'} not found (GLUE's qqp train split)"


@pytest.mark.parametrize("name", ["batch_size", "max_length", "max_train_examples"])
def test_non_positive_counts_error(name: str) -> None:
    with pytest.raises(ValueError, match=rf"data\.{name} must be a positive integer"):
        GlueDataModule("synthetic", **{name: 0})


# --- bad files: one-line refusals naming the file and line -------------------------------------------


NOT_UTF8 = b"it was fine . \t1\nit was b\xe9te . \t0\n"  # Latin-1 "bête" on line 3 (after the header)


def test_tsv_that_is_not_utf8_names_line_byte_and_column(tmp_path: Path) -> None:
    path = tmp_path / "train.tsv"
    path.write_bytes(SST2_HEADER.encode() + b"\n" + NOT_UTF8)
    with pytest.raises(ValueError) as error:
        read_glue_tsv(path, SST2)
    assert one_line(error) == f"{path}, line 3: not UTF-8 text (at column 9)"
    path.write_text(f"{SST2_HEADER}\n{SST2_ROWS[0]}\n", encoding="utf-16")
    with pytest.raises(ValueError, match=r"line 1: not UTF-8 text \(at column 1\); it looks like UTF-16"):
        read_glue_tsv(path, SST2)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        ("\n  \n\n", "no examples (only blank lines)"),
        (f"{SST2_HEADER}\n\n \n", "no examples (only blank lines after the header)"),
        (f"{SST2_HEADER}\n", "has no examples (empty split)"),
    ],
    ids=["blank-lines", "header-and-blank-lines", "header-only"],
)
def test_tsv_without_examples_says_why(contents: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "dev.tsv"
    path.write_text(contents)
    with pytest.raises(ValueError) as error:
        read_glue_tsv(path, SST2)
    assert one_line(error).startswith(str(path)) and one_line(error).endswith(message)


def test_tsv_blank_lines_between_rows_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "train.tsv"
    path.write_text(f"{SST2_HEADER}\n{SST2_ROWS[0]}\n   \n\n{SST2_ROWS[1]}\nnot a row\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 6: expected 2 tab-separated fields"):
        read_glue_tsv(path, SST2)
    assert read_glue_tsv(path, SST2, limit=2).labels == ["1", "0"]


@pytest.mark.parametrize("sentence", ["", "   "], ids=["empty", "spaces"])
def test_sst2_row_without_a_sentence_is_refused_naming_its_line(sentence: str, tmp_path: Path) -> None:
    path = write_tsv(tmp_path, "train.tsv", SST2_HEADER, [*SST2_ROWS, f"{sentence}\t1", SST2_ROWS[0]])
    with pytest.raises(ValueError) as error:
        read_glue_tsv(path, SST2)
    assert one_line(error) == f"{path}, line 5: empty sentence (nothing to classify)"


def test_a_pair_with_one_empty_text_is_kept_as_glue_qqp_has_two(tmp_path: Path) -> None:
    row = "7\t8\t9\tHow can I create an Android app?\t\t0"  # real QQP train rows have an empty question2
    split = read_glue_tsv(write_tsv(tmp_path, "train.tsv", QQP_HEADER, [*QQP_ROWS, row]), QQP)
    assert split.texts["question2"][-1] == "" and len(split) == 4
    with pytest.raises(ValueError, match=r"line 2: empty question1 and question2 \(nothing to classify\)$"):
        read_glue_tsv(write_tsv(tmp_path, "dev.tsv", QQP_HEADER, ["7\t8\t9\t \t\t0"]), QQP)


def test_data_dir_that_is_not_a_task_folder_names_the_flag(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    def refusal(data_dir: Path) -> str:
        with pytest.raises(ValueError) as error:
            GlueDataModule("sst2", data_dir=str(data_dir), tokenizer=str(tiny_bpe_dir))
        return one_line(error)

    root = tmp_path / "glue"
    write_glue_task(root / "sst2", SST2_HEADER, SST2_ROWS)
    files = "GLUE's sst2 train.tsv and dev.tsv"
    assert refusal(tmp_path / "nope") == f"data.data_dir='{tmp_path / 'nope'}': no such folder (expected {files} there)"
    train = root / "sst2" / "train.tsv"
    assert refusal(train) == f"data.data_dir='{train}': is a file, expected a folder with {files}"
    assert refusal(root) == (
        f"data.data_dir='{root}': the folder has neither train.tsv nor dev.tsv (expected {files}); "
        f"they are in {root / 'sst2'}: set data.data_dir to it"
    )
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "dev.tsv").mkdir()
    data = GlueDataModule("sst2", data_dir=str(tmp_path / "odd"), tokenizer=str(tiny_bpe_dir))
    with pytest.raises(ValueError) as error:
        data.setup("validate")
    assert one_line(error) == f"{tmp_path / 'odd' / 'dev.tsv'}: is a directory, expected a GLUE sst2 TSV file"


def test_tokenizer_paths_that_do_not_fit_name_the_flag(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    def refusal(name: Path | str, gguf_file: str | None = None) -> str:
        with pytest.raises(ValueError) as error:
            load_tokenizer(str(name), gguf_file)
        return one_line(error)

    (tmp_path / "empty").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert refusal(tmp_path / "nope") == f"data.tokenizer='{tmp_path / 'nope'}': no such folder"
    assert refusal(tiny_bpe_dir / "vocab.json") == (
        f"data.tokenizer='{tiny_bpe_dir / 'vocab.json'}': is a file, expected a tokenizer folder such as '{tiny_bpe_dir}'"
    )
    assert refusal(tmp_path / "model.gguf") == (
        f"data.tokenizer='{tmp_path / 'model.gguf'}': is a GGUF file, expected its folder; "
        f"set data.tokenizer='{tmp_path}' and data.gguf_file='model.gguf'"
    )
    assert refusal(tmp_path / "empty").startswith(f"data.tokenizer='{tmp_path / 'empty'}': the folder has no tokenizer")
    assert refusal(tmp_path / "nope", "model.gguf").startswith(f"data.tokenizer='{tmp_path / 'nope'}': no such folder")
    assert refusal("no-such-org/no-such-tokenizer").startswith("data.tokenizer='no-such-org/no-such-tokenizer' could")


def text_file(folder: Path, name: str, contents: str | bytes) -> Path:
    path = folder / name
    path.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    return path


@pytest.mark.parametrize(
    ("name", "contents", "line", "column"),
    [
        ("train.jsonl", b'{"text": "fine"}\n\n{"text": "b\xe9te"}\n', 3, 12),
        ("train.json", b'[{"text": "fine"},\n {"text": "b\xe9te"}]\n', 2, 13),
        ("train.csv", b"text\nfine\nb\xe9te\n", 3, 2),
        ("train.txt", b"fine\r\nb\xe9te\r\n", 2, 2),
    ],
)
def test_text_file_that_is_not_utf8_names_line_and_column(
    name: str, contents: bytes, line: int, column: int, tmp_path: Path
) -> None:
    path = text_file(tmp_path, name, contents)
    with pytest.raises(ValueError) as error:
        read_rows(path, ("text",))
    assert one_line(error) == f"{path}, line {line}: not UTF-8 text (at column {column})"


@pytest.mark.parametrize(
    ("name", "contents", "message"),
    [
        ("t.jsonl", '{"text": "fine"}\n{"text": fine}\n', r"line 2: not valid JSON \(Expecting value at column 10\)"),
        ("t.jsonl", '{"text": "a"}\n["a"]\n', r"line 2: expected a JSON object \(one example\), found a JSON array"),
        ("t.jsonl", '{"text": "a"}\n"a"\n', r"line 2: expected a JSON object \(one example\), found a JSON string"),
        ("t.jsonl", '{"text": "a"}\n\n{"body": "b"}\n', r"line 3: missing column 'text' \(other rows have it\)"),
        ("t.jsonl", '{"text": "a"}\n{"text": 5}\n', r"line 2: column 'text' is a JSON number, expected a string"),
        ("t.json", '[{"text": "a"},\n {"text": "b"},\n]', r"line 3: not valid JSON \(.+ at column 1\)"),
        ("t.json", '[{"text": "a"}, ["b"]]', r"item 2: expected a JSON object \(one example\), found a JSON array"),
        ("t.json", '{"text": "a"}\n{"text": b}\n', r"line 2: not valid JSON \(Expecting value at column 10\)"),  # JSON Lines
        ("t.csv", "text,label\nfine,1\n\nbad,0,extra\n", r"line 4: expected 2 comma-separated fields like the header \(line 1\), found 3"),
    ],
    ids=["not-json", "array-line", "string-line", "missing-column", "number", "json-syntax", "json-item", "json-lines", "csv-fields"],
)  # fmt: skip
def test_bad_line_of_a_text_file_names_file_and_line(name: str, contents: str, message: str, tmp_path: Path) -> None:
    path = text_file(tmp_path, name, contents)
    with pytest.raises(ValueError) as error:
        read_rows(path, ("text",))
    assert re.fullmatch(rf"{re.escape(str(path))}, {message}", one_line(error)), one_line(error)


@pytest.mark.parametrize(
    ("contents", "line", "until"),
    [
        ('text\nfine\n"an unclosed quote\nrow 3\nrow 4\n', 3, 5),  # one column: every later row joins it
        ('text,label\nfine,1\n"oops,1\nrow 3,0\n"a, b",1\nlast,0\n', 3, 5),  # runs into the next quoted field
        ('text,label\nfine,1\n"unclosed at the end,1', 3, 3),
    ],
    ids=["to-the-end", "into-the-next-quote", "last-line"],
)
def test_csv_quote_that_is_never_closed_is_refused_naming_the_line_it_opens_on(
    contents: str, line: int, until: int, tmp_path: Path
) -> None:
    path = text_file(tmp_path, "t.csv", contents)
    with pytest.raises(ValueError) as error:
        read_rows(path, ("text",))
    assert one_line(error).startswith(f"{path}, line {line}: the quote that opens a field on this line is never closed")
    assert f"runs on to line {until}" in one_line(error)
    inner = text_file(tmp_path, "inner.csv", 'text,label\nit was "good",1\n"a ""quoted"" one",0\n')
    assert read_rows(inner, ("text",)).texts == ['it was "good"', 'a "quoted" one']  # as spreadsheets write them


@pytest.mark.parametrize(
    ("name", "contents", "reason"),
    [
        ("t.jsonl", "\n  \n\t\n", "only blank lines"),
        ("t.json", "  \n\n", "only blank lines"),
        ("t.txt", "\r\n \r\n", "only blank lines"),
        ("t.csv", "\n\n", "only blank lines"),
        ("t.csv", "text\n\n  \n", "only the header line"),
        ("t.json", " [ ]\n", "an empty JSON array"),
    ],
)
def test_text_file_without_examples_says_why(name: str, contents: str, reason: str, tmp_path: Path) -> None:
    path = text_file(tmp_path, name, contents)
    with pytest.raises(ValueError) as error:
        read_rows(path, ("text",))
    assert one_line(error) == f"{path}: no examples ({reason})"


def test_blank_lines_are_skipped_and_later_refusals_name_the_file_line(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    path = text_file(tmp_path, "t.jsonl", '{"text": "fine"}\n\n{"text": "  "}\n')
    rows = read_rows(path, ("text",))
    assert rows.texts == ["fine", "  "] and rows.lines == [1, 3]
    with pytest.raises(ValueError) as error:
        encode_rows(rows, load_tokenizer(tiny_bpe_dir), 16, "truncate")
    assert one_line(error) == f"{path}, row 2 (line 3): empty text"
    csv_path = text_file(tmp_path, "t.csv", 'prompt,response\n"Is it\ngreat?",yes\n\nWhy?,no\n')
    csv_rows = read_rows(csv_path, ("prompt", "response"))
    assert csv_rows.prompts == ["Is it\ngreat?", "Why?"] and csv_rows.lines == [2, 5]
    assert read_rows(text_file(tmp_path, "t.txt", "a\n\nb\r\n"), ("body",)).texts == ["a", "b"]
    long = "word " * 40_000  # 200 kB: past the csv module's default field limit
    assert read_rows(text_file(tmp_path, "long.csv", f"text\n{long}\n"), ("text",)).texts == [long]
    array = read_rows(text_file(tmp_path, "t.json", json.dumps([{"text": "a"}, {"text": None}])), ("text",), limit=5)
    assert array.texts == ["a", ""] and array.lines is None


def test_train_and_val_files_that_are_not_files_name_the_flag(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    good = text_file(tmp_path, "val.jsonl", '{"text": "fine"}\n')

    def refusal(train_file: Path) -> str:
        with pytest.raises(ValueError) as error:
            TextDataModule(train_file=str(train_file), val_file=str(good), tokenizer=str(tiny_bpe_dir))
        return one_line(error)

    (tmp_path / "corpus").mkdir()
    expected = "expected a .jsonl/.json/.csv/.txt file"
    assert refusal(tmp_path / "corpus") == f"data.train_file='{tmp_path / 'corpus'}': is a directory, {expected}"
    assert refusal(tmp_path / "nope.jsonl") == f"data.train_file='{tmp_path / 'nope.jsonl'}': no such file ({expected})"
    assert refusal(text_file(tmp_path, "t.parquet", "x")).endswith("unknown file type '.parquet'; use one of "
                                                                   "['.csv', '.json', '.jsonl', '.txt']")  # fmt: skip
    with pytest.raises(ValueError, match=r"^data\.val_file=.*: is a directory"):
        TextDataModule(train_file=str(good), val_file=str(tmp_path / "corpus"), tokenizer=str(tiny_bpe_dir))


def test_text_file_with_prompt_columns_must_not_be_txt(tmp_path: Path) -> None:
    path = text_file(tmp_path, "t.txt", "Is it great? yes\n")
    with pytest.raises(ValueError, match=r"a \.txt file is one text per line") as error:
        read_rows(path, ("prompt", "response"))
    one_line(error)


# --- options the data ignores: one warning line each ---------------------------------------------


def warned(build: object) -> list[str]:
    """The warning messages emitted while calling ``build()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()  # type: ignore[operator]
    return [str(warning.message) for warning in caught if "is ignored" in str(warning.message)]


def test_glue_options_the_task_ignores_are_warned_about(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    small = {"synthetic_train_size": 10, "synthetic_val_size": 10}
    assert warned(lambda: GlueDataModule("synthetic", **small)) == []
    options = {"data_dir": "/x", "tokenizer": "gpt2-large", "gguf_file": "m.gguf"}
    said = warned(lambda: GlueDataModule("synthetic", **options, **small))
    why = "is ignored with data.task=synthetic: it makes its own examples and tokenizer"
    assert said == [f"data.data_dir='/x' {why}", f"data.tokenizer='gpt2-large' {why}", f"data.gguf_file='m.gguf' {why}"]
    folder = str(write_glue_task(tmp_path, SST2_HEADER, SST2_ROWS))
    assert warned(lambda: GlueDataModule("sst2", data_dir=folder, tokenizer=str(tiny_bpe_dir))) == []
    said = warned(lambda: GlueDataModule("sst2", data_dir=folder, tokenizer=str(tiny_bpe_dir), seed=3, **small))
    assert said == [
        f"data.{name}={value} is ignored with data.task=sst2: only data.task=synthetic uses it"
        for name, value in [("synthetic_train_size", 10), ("synthetic_val_size", 10), ("seed", 3)]
    ]


def test_text_options_the_data_ignores_are_warned_about(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    file = str(text_file(tmp_path, "t.jsonl", '{"prompt": "Is it?", "response": "yes"}\n'))
    files = {"train_file": file, "val_file": file, "tokenizer": str(tiny_bpe_dir)}
    instruction = {"prompt_column": "prompt", "response_column": "response"}
    assert warned(lambda: TextDataModule(**files, **instruction)) == []
    assert warned(lambda: TextDataModule(builtin_train_size=10)) == []
    said = warned(lambda: TextDataModule(**files, **instruction, dataset="someone/notes", text_column="body", seed=1))
    assert said == [
        "data.dataset='someone/notes' is ignored: data.train_file and data.val_file are read instead",
        "data.seed=1 is ignored: only the builtin corpus uses it",
        "data.text_column='body' is ignored: instruction data reads data.prompt_column and data.response_column",
    ]
    said = warned(lambda: TextDataModule(tokenizer="gpt2-large", text_column="body", builtin_train_size=10))
    assert said == [
        "data.tokenizer='gpt2-large' is ignored: the builtin corpus has its own tokenizer",
        "data.text_column='body' is ignored: the builtin corpus is plain text without columns",
    ]


# --- batching ------------------------------------------------------------------------------------


def test_collate_pads_to_longest_on_the_right() -> None:
    batch = PadCollator(pad_token_id=0)([{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8], "label": 0}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0]
    assert all(tensor.dtype == torch.long for tensor in batch.values())


def test_collate_pads_on_the_left() -> None:
    batch = PadCollator(pad_token_id=9, padding_side="left")(
        [{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8, 4], "label": 0}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 8, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]


def test_collate_empty_batch() -> None:
    batch = PadCollator(pad_token_id=0)([])
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (0, 1)
    assert batch["labels"].shape == (0,)
    assert all(tensor.dtype == torch.long for tensor in batch.values())


def test_collate_rejects_unknown_padding_side() -> None:
    with pytest.raises(ValueError, match="data.padding_side"):
        PadCollator(0, padding_side="middle")  # type: ignore[arg-type]


def test_batches_are_dynamically_padded_per_batch() -> None:
    data = GlueDataModule("synthetic", eval_batch_size=4, synthetic_train_size=50, synthetic_val_size=40)
    widths = {batch["input_ids"].shape[1] for batch in data.val_dataloader()}
    assert len(widths) > 1  # 8–14 words + 3 template words, padded per batch
    for batch in data.val_dataloader():
        assert batch["attention_mask"].sum(1).max() == batch["input_ids"].shape[1]


def test_train_loader_can_be_rebuilt_with_poisson_batches() -> None:
    data = GlueDataModule("synthetic", batch_size=16, synthetic_train_size=100, synthetic_val_size=10, num_workers=0)
    loader = data.train_dataloader()
    assert type(loader) is DataLoader and isinstance(loader.sampler, RandomSampler)
    assert loader.batch_size == 16
    collate = pickle.loads(pickle.dumps(loader.collate_fn))
    poisson_batches = [[0, 5, 7], []]
    rebuilt = DataLoader(
        loader.dataset, batch_sampler=poisson_batches, collate_fn=collate, num_workers=loader.num_workers
    )
    full, empty = list(rebuilt)
    assert full["input_ids"].shape[0] == 3 and empty["input_ids"].shape == (0, 1)


def test_padding_side_reaches_batches_and_tokenizer() -> None:
    data = GlueDataModule("synthetic", padding_side="left", synthetic_train_size=10, synthetic_val_size=10)
    batch = next(iter(data.val_dataloader()))
    assert data.tokenizer.padding_side == "left"
    assert batch["attention_mask"][:, -1].all()  # the answer position is the last column for every row


# --- synthetic task ------------------------------------------------------------------------------


def test_synthetic_interface_and_tokenizer() -> None:
    with pytest.warns(UserWarning, match=r"^data\.tokenizer='not-a-tokenizer' is ignored with data\.task=synthetic"):
        data = GlueDataModule("synthetic", tokenizer="not-a-tokenizer", synthetic_train_size=20, synthetic_val_size=10)
    assert data.num_classes == 2 and data.task == "synthetic"
    assert data.vocab_size == len(data.tokenizer) <= 128
    assert data.tokenizer.pad_token_id == data.tokenizer.eos_token_id == 0
    for word, token_id in zip(TASKS["synthetic"].label_words.values(), data.label_word_ids, strict=True):
        assert data.tokenizer.encode(word, add_special_tokens=False) == [token_id]
    assert data.tokenizer.encode("good") == data.tokenizer.encode(" good")


def test_synthetic_is_deterministic_per_seed() -> None:
    def train_examples(seed: int, size: int = 200) -> list[tuple[list[int], int]]:
        data = GlueDataModule("synthetic", seed=seed, synthetic_train_size=size, synthetic_val_size=10)
        dataset = data.dataset("train")
        return [(example["input_ids"], example["label"]) for example in dataset]

    assert train_examples(0) == train_examples(0)
    assert train_examples(0) != train_examples(1)
    assert train_examples(0, size=300)[:200] == train_examples(0)


def test_synthetic_is_balanced_short_and_labelled_by_majority() -> None:
    data = GlueDataModule("synthetic", synthetic_train_size=2000, synthetic_val_size=500)
    train = data.dataset("train")
    counts = Counter(train.labels)
    assert 0.45 < counts[1] / len(train) < 0.55
    tokenizer = build_synthetic_tokenizer()
    positive = set(tokenizer.convert_tokens_to_ids(list(POSITIVE_WORDS)))
    negative = set(tokenizer.convert_tokens_to_ids(list(NEGATIVE_WORDS)))
    template = tokenizer.encode(" overall it was")
    for example in train:
        ids = example["input_ids"]
        assert 8 + len(template) <= len(ids) <= 14 + len(template) and ids[-len(template) :] == template
        balance = sum(token in positive for token in ids) - sum(token in negative for token in ids)
        assert balance != 0 and example["label"] == int(balance > 0)
    assert len(data.dataset("dev")) == 500


# --- real data -----------------------------------------------------------------------------------


def test_real_sst2(shared_data_dir: Path) -> None:
    data = GlueDataModule(
        "sst2",
        data_dir=str(shared_data_dir / "glue" / "sst2"),
        tokenizer=str(shared_data_dir / "gpt2-tokenizer"),
        batch_size=8,
    )
    assert data.label_word_ids == [7818, 1049]  # " terrible", " great"
    assert data.vocab_size == 50257 and data.num_classes == 2
    data.setup("fit")
    assert len(data.train_dataloader().dataset) == 67_349
    assert len(data.val_dataloader().dataset) == len(data.test_dataloader().dataset) == 872
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 64 and batch["labels"].shape == (64,)
    first = data.tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert first == "it 's a charming and often affecting journey . It was"


def test_smollm2_gguf_tokenizer_gives_its_own_label_word_ids(shared_data_dir: Path) -> None:
    folder, gguf = shared_data_dir / "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (folder / gguf).is_file():
        pytest.skip(f"{folder / gguf} is absent from DPLIT_DATA_DIR")
    tokenizer = load_tokenizer(folder, gguf_file=gguf)
    assert len(tokenizer) == 49152 and tokenizer.pad_token is not None
    assert label_word_ids(tokenizer, {"0": " terrible", "1": " great"}) == [13321, 1109]
    with pytest.raises(ValueError, match=r"data.label_words: the word ' unforgettably' for label '1' must be exactly one"):
        label_word_ids(tokenizer, {"0": " terrible", "1": " unforgettably"})
