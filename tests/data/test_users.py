"""Who owns each row (data.privacy_unit: user): the user column, synthetic users, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dplit.cli.lightning_cli import run_lm_cli
from dplit.data.batches import PadCollator, TokenizedDataset
from dplit.data.corpus import build_corpus_tokenizer
from dplit.data.files import read_glue_tsv, read_rows
from dplit.data.glue import GlueDataModule
from dplit.data.tasks import get_task
from dplit.data.text import TextDataModule
from dplit.data.users import synthetic_users, user_indices, warn_dominant_user
from dplit.privacy.clipping.units import UNIT_KEY
from tests.helpers.commands import CONFIGS, glue_args, lm_args, steps
from tests.helpers.executable import refusal_line, run_dplit_in_process
from tests.helpers.glue_files import write_tsv

HEADER = "sentence\tlabel\tauthor"


def sst2_with_authors(folder: Path, authors: list[str]) -> Path:
    """An SST-2 folder whose train.tsv and dev.tsv have an ``author`` column."""
    rows = [f"a fine film number {i}\t{i % 2}\t{author}" for i, author in enumerate(authors)]
    write_tsv(folder, "train.tsv", HEADER, rows)
    write_tsv(folder, "dev.tsv", HEADER, rows)
    return folder


def test_the_user_column_is_read_and_users_are_numbered_by_first_row(tmp_path: Path) -> None:
    folder = sst2_with_authors(tmp_path, ["ann", "bo", "ann", " cy ", "bo"])
    split = read_glue_tsv(folder / "train.tsv", get_task("sst2"), user_column="author")
    assert split.users == ["ann", "bo", "ann", "cy", "bo"]
    assert user_indices(split.users) == [0, 1, 0, 2, 1]


@pytest.mark.parametrize(
    ("authors", "column", "message"),
    [
        (["ann", "  ", "bo"], "author", r"train.tsv, line 3: the user id \(data.user_column\) is blank"),
        (["ann", "bo"], "writer", r"train.tsv: data.user_column='writer' is not a column"),
    ],
)
def test_a_blank_user_id_or_a_missing_column_names_the_file_and_row(
    tmp_path: Path, authors: list[str], column: str, message: str
) -> None:
    folder = sst2_with_authors(tmp_path, authors)
    with pytest.raises(ValueError, match=message) as refused:
        read_glue_tsv(folder / "train.tsv", get_task("sst2"), user_column=column)
    assert "ann" not in str(refused.value) and "\n" not in str(refused.value)  # a user id is private


def test_synthetic_users_are_seeded_runs_of_1_to_k_consecutive_rows() -> None:
    users = synthetic_users(500, seed=3, most_rows=8)
    assert users == synthetic_users(500, seed=3, most_rows=8) != synthetic_users(500, seed=4, most_rows=8)
    sizes = [users.count(user) for user in dict.fromkeys(users)]
    assert len(users) == 500 and max(sizes) == 8 and min(sizes[:-1]) == 1
    assert users == sorted(users, key=lambda user: int(user.removeprefix("user")))  # consecutive rows


def test_a_user_owning_most_rows_is_warned_about_by_share_only() -> None:
    with pytest.warns(UserWarning, match="one user owns 70% of the training rows"):
        warn_dominant_user([0] * 7 + [1, 2, 3], source="train.tsv")
    with pytest.warns(UserWarning, match="one user owns most of the training rows"):  # private_diagnostics=false
        warn_dominant_user([0] * 7 + [1, 2, 3], source="train.tsv", quiet=True)


def test_the_collator_carries_each_rows_user() -> None:
    dataset = TokenizedDataset([[1, 2], [3], [4, 5, 6]], [0, 1, 0], users=[1, 0, 1], max_rows_per_user=2)
    batch = PadCollator(pad_token_id=0)([dataset[i] for i in range(3)])
    assert batch[UNIT_KEY].tolist() == [1, 0, 1]
    assert UNIT_KEY not in PadCollator(pad_token_id=0)([{"input_ids": [1], "label": 0}])


def test_the_synthetic_task_gives_users_to_its_training_rows_only() -> None:
    data = GlueDataModule(task="synthetic", privacy_unit="user", max_rows_per_user=3, synthetic_train_size=200)
    train, dev = data.dataset("train"), data.dataset("dev")
    assert train.users is not None and train.max_rows_per_user == 3 and max(train.users) + 1 < 200
    assert dev.users is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"privacy_unit": "person"}, "data.privacy_unit must be one of example, user"),
        ({"privacy_unit": "user", "max_rows_per_user": 0}, "data.max_rows_per_user must be an integer ≥ 1"),
        ({"user_column": "author"}, "data.user_column='author' is set but data.privacy_unit='example'"),
        ({"max_rows_per_user": 4}, "data.max_rows_per_user=4 is set but data.privacy_unit='example'"),
        ({"task": "sst2", "privacy_unit": "user"}, "GLUE's sst2 from the hub has no user column"),
        ({"task": "sst2", "privacy_unit": "user", "data_dir": "DIR"}, "data.privacy_unit=user needs data.user_column"),
    ],
)
def test_a_user_setting_without_users_is_refused_in_one_line(
    tmp_path: Path, settings: dict[str, object], message: str
) -> None:
    if settings.get("data_dir") == "DIR":
        settings = {**settings, "data_dir": str(sst2_with_authors(tmp_path, ["ann", "bo"]))}
    with pytest.raises(ValueError, match=message) as refused:
        GlueDataModule(**{"task": "synthetic", **settings})
    assert "\n" not in str(refused.value)


def test_dplit_refuses_a_missing_user_column_in_one_line(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = sst2_with_authors(tmp_path / "sst2", ["ann", "bo", "cy", "ann"])
    args = glue_args(CONFIGS / "sst2_untied.yaml", tmp_path / "run", tiny_bpe_dir)
    users = ["--data.data_dir", str(folder), "--data.privacy_unit", "user", "--data.user_column", "writer"]
    done = run_dplit_in_process("fit", *args, *users)
    assert done.returncode == 2
    assert "train.tsv: data.user_column='writer' is not a column" in refusal_line(done)


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_text_files_user_column_is_read_strings_or_integers(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"text": "a", "who": "ann"}, {"text": "b", "who": 7}, {"text": "c", "who": "ann"}]
    )
    assert read_rows(path, ("text",), user_column="who").users == ["ann", "7", "ann"]


@pytest.mark.parametrize("bad", [None, "  ", True, 1.5])
def test_a_text_files_missing_or_blank_user_is_refused_by_line(tmp_path: Path, bad: object) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a", "who": "ann"}, {"text": "b", "who": bad}])
    with pytest.raises(ValueError, match=r"t.jsonl, line 2: no user id in data.user_column='who'") as refused:
        read_rows(path, ("text",), user_column="who")
    assert "ann" not in str(refused.value)


def test_a_language_model_trains_over_the_users_of_its_file(tmp_path: Path) -> None:
    rows = [{"text": f"It was a great movie, number {i}.", "who": f"u{i % 20}"} for i in range(40)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    build_corpus_tokenizer().save_pretrained(tmp_path / "tokenizer")  # offline: the built-in corpus' tokenizer
    cli = run_lm_cli(["fit", *lm_args(tmp_path / "run", *steps(2)), "--data.train_file", str(train),
                      "--data.tokenizer", str(tmp_path / "tokenizer"),
                      "--data.val_file", str(train), "--data.batch_size", "2", "--data.privacy_unit", "user",
                      "--data.user_column", "who", "--data.max_rows_per_user", "3", "--model.sample_prompts", "[]"])  # fmt: skip
    dpsgd = cli.trainer.strategy.dpsgd
    assert dpsgd.dataset_size == 20 and dpsgd.facts()["users"] == 20 and dpsgd.budget.steps >= 1
    assert dpsgd.facts()["largest_user_rows"] == 2  # a private diagnostic (u0..u19 own 2 rows each)
    assert cli.datamodule.dataset("validation").users is None


def test_a_language_model_file_without_user_column_flag_is_refused(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match="data.privacy_unit=user needs data.user_column"):
        TextDataModule(train_file=str(train), val_file=str(train), privacy_unit="user")
