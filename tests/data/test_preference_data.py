"""PreferenceDataModule: pairs read through files.py's readers, laid out as two rows of one unit each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dplit.data.preference import PreferenceDataModule, PreferenceDataset
from dplit.data.preference_set import make_preference_split
from dplit.data.synthetic import NEGATIVE_WORDS, POSITIVE_WORDS
from dplit.privacy.clipping.units import UNIT_KEY, split_batch, units_of
from dplit.privacy.training_units import row_unit_of
from dplit.tasks.preference import CHOSEN_KEY

PAIRS = [
    {"prompt": "Review:", "chosen": "It was great.", "rejected": "It was bad."},
    {"prompt": "", "chosen": "Lovely and moving", "rejected": "Dull"},
    {"prompt": "Rate the movie", "chosen": "Five stars", "rejected": "One star, a waste of an evening"},
]


def _write(folder: Path, name: str) -> Path:
    path = folder / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    else:
        rows = [",".join(f'"{pair[c]}"' for c in ("prompt", "chosen", "rejected")) for pair in PAIRS]
        path.write_text("prompt,chosen,rejected\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs.csv"])
def test_each_pair_is_two_rows_of_one_unit_chosen_first(tmp_path: Path, tiny_bpe_dir: Path, name: str) -> None:
    path = _write(tmp_path, name)
    data = PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir), max_length=64)
    dataset = data.dataset("train")
    assert len(dataset) == 3 and row_unit_of(dataset) == "pair"  # Poisson sampling draws pairs: q = batch / 3
    batch = data.collate_fn([dataset[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 6
    assert batch[CHOSEN_KEY].tolist() == [1, 0, 1, 0, 1, 0] and batch[UNIT_KEY].tolist() == [0, 0, 1, 1, 2, 2]
    tokenizer = data.tokenizer
    for index, pair in enumerate(PAIRS):
        for side, answer in enumerate((pair["chosen"], pair["rejected"])):
            row = 2 * index + side
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            trained = batch["loss_mask"][row][batch["attention_mask"][row].bool()].tolist()
            prompt = tokenizer.encode(pair["prompt"]) if pair["prompt"] else []
            assert ids[: len(prompt)] == prompt and ids[-1] == tokenizer.eos_token_id
            assert trained == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            assert tokenizer.decode(ids[len(prompt) : -1]).strip() == answer.strip()
    micro = list(split_batch(batch, 3))  # micro-batches of at most 3 rows never split a pair
    assert [units_of(m).count for m in micro] == [1, 1, 1] and all(m["input_ids"].shape[0] == 2 for m in micro)


def test_empty_batch_and_overlength_answers(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    path = _write(tmp_path, "pairs.jsonl")
    data = PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir), max_length=8)
    assert all(len(data.dataset("train")[i]["rejected_ids"]) <= 8 for i in range(3))
    assert data.collate_fn([])["input_ids"].shape[0] == 0
    refusing = PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir),
                                    max_length=8, overlength="refuse")  # fmt: skip
    with pytest.raises(ValueError, match=r"pairs\.jsonl, row \d: \d+ tokens, longer than data\.max_length=8"):
        refusing.dataset("train")


def test_builtin_set_prefers_positive_endings_and_splits_are_seeded() -> None:
    rows = make_preference_split("train", 50, seed=0)
    assert rows == make_preference_split("train", 50, seed=0) != make_preference_split("validation", 50, seed=0)
    for row in rows:
        assert row.chosen.split()[1] in POSITIVE_WORDS and row.rejected.split()[1] in NEGATIVE_WORDS
        assert row.chosen.split()[0] == row.rejected.split()[0]  # the same adverb: only the sentiment differs
    data = PreferenceDataModule(builtin_train_size=50, builtin_val_size=10)
    assert len(data.dataset("train")) == 50 and isinstance(data.dataset("validation"), PreferenceDataset)
    assert 1 not in torch.tensor(data.dataset("train")[0]["chosen_ids"]).tolist()  # no unknown word


def test_txt_files_are_refused(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    path = tmp_path / "pairs.txt"
    path.write_text("a\n")
    with pytest.raises(ValueError, match="pairs.txt: a .txt file has no prompt, chosen and rejected columns"):
        PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir)).dataset("train")


def test_user_level_pairs_share_their_users_unit(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    users = ["ann", "bob", "ann"]
    path.write_text("".join(json.dumps({**pair, "who": user}) + "\n" for pair, user in zip(PAIRS, users, strict=True)))
    data = PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir), max_length=64,
                                privacy_unit="user", user_column="who", max_rows_per_user=2)  # fmt: skip
    dataset = data.dataset("train")
    assert dataset.users == [0, 1, 0] and dataset.max_rows_per_user == 2
    batch = data.collate_fn([dataset[i] for i in range(3)])
    assert batch[UNIT_KEY].tolist() == [0, 0, 1, 1, 0, 0] and batch[CHOSEN_KEY].tolist() == [1, 0] * 3
    micro = list(split_batch(batch, 4))  # ann's two pairs (four rows) stay together, chosen before rejected
    assert micro[0][CHOSEN_KEY].tolist() == [1, 0, 1, 0] and micro[0][UNIT_KEY].tolist() == [0, 0, 0, 0]
    assert data.dataset("validation").users is None
    with pytest.raises(ValueError, match="data.user_column='who' is set but data.privacy_unit='pair'"):
        PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir), user_column="who")
    with pytest.raises(ValueError, match="data.privacy_unit=user needs data.user_column"):
        PreferenceDataModule(train_file=str(path), val_file=str(path), tokenizer=str(tiny_bpe_dir), privacy_unit="user")
