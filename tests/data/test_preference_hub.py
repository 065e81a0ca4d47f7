"""Hub preference datasets (``data.dataset``) for ``dplit dpo``, read offline through ``datasets.load_dataset``.

The hub is unreachable here, so the real loading path (:func:`dplit.data.sources.load_hub_dataset`, then the same
checks as a local file) is given what ``load_dataset`` also reads by name: a local dataset folder of JSONL splits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trl.data_utils import maybe_apply_chat_template

from dplit.data.preference import PreferenceDataModule
from dplit.data.tokenizer import load_tokenizer
from tests.data.test_conversational_preference import TEMPLATE, conversation
from tests.helpers.commands import CONFIGS

PAIRS = [
    {"prompt": "Review:", "chosen": "It was great.", "rejected": "It was bad.", "who": "ann"},
    {"prompt": "", "chosen": "Lovely and moving", "rejected": "Dull", "who": "bob"},
    {"prompt": "Rate the movie", "chosen": "Five stars", "rejected": "One star", "who": "ann"},
]


def hub_folder(folder: Path, splits: dict[str, list[dict]]) -> Path:
    """A dataset folder ``datasets.load_dataset(str(folder))`` reads as a hub dataset: one JSONL file a split."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def module(dataset: Path | str, tokenizer: Path, **settings: object) -> PreferenceDataModule:
    return PreferenceDataModule(dataset=str(dataset), tokenizer=str(tokenizer), max_length=64,
                                **settings)  # type: ignore[arg-type]  # fmt: skip


def test_a_hub_dataset_gives_the_same_pairs_as_the_same_rows_in_a_file(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = hub_folder(tmp_path / "prefs", {"train": PAIRS, "test": PAIRS[:2]})
    file = tmp_path / "pairs.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    hub = module(folder, tiny_bpe_dir)
    local = PreferenceDataModule(train_file=str(file), val_file=str(file), tokenizer=str(tiny_bpe_dir), max_length=64)
    assert [hub.dataset("train")[i] for i in range(3)] == [local.dataset("train")[i] for i in range(3)]
    assert len(hub.dataset("validation")) == 2  # no validation split: the test split is read
    assert len(module(folder, tiny_bpe_dir, max_train_examples=1).dataset("train")) == 1


def test_a_validation_split_is_preferred_to_test(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = hub_folder(tmp_path / "prefs", {"train": PAIRS, "validation": PAIRS[:1], "test": PAIRS[:2]})
    assert len(module(folder, tiny_bpe_dir).dataset("validation")) == 1


def test_hub_users_make_a_users_pairs_one_unit(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = hub_folder(tmp_path / "prefs", {"train": PAIRS, "test": PAIRS})
    dataset = module(folder, tiny_bpe_dir, privacy_unit="user", user_column="who", max_rows_per_user=2).dataset("train")
    assert dataset.users == [0, 1, 0] and dataset.max_rows_per_user == 2


def test_conversational_hub_columns_render_as_trl_renders(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_bpe_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tmp_path / "chat")
    rows = [conversation(index) for index in range(3)]
    rendered = [maybe_apply_chat_template(row, tokenizer) for row in rows]  # TRL's own rendering, as text columns
    chat = module(hub_folder(tmp_path / "chat_set", {"train": rows, "test": rows}), tmp_path / "chat")
    text = module(hub_folder(tmp_path / "text_set", {"train": rendered, "test": rendered}), tmp_path / "chat")
    assert [chat.dataset("train")[i] for i in range(3)] == [text.dataset("train")[i] for i in range(3)]


@pytest.mark.parametrize(
    ("splits", "settings", "message"),
    [
        ({"train": [{k: v for k, v in p.items() if k != "rejected"} for p in PAIRS]}, {},
         r"prefs \[train\]: missing column\(s\) \['rejected'\]"),
        ({"train": [{**PAIRS[0], "chosen": " "}, *PAIRS[1:]]}, {}, r"prefs \[train\], row 1: empty chosen answer"),
        ({"train": [*PAIRS[:2], {**PAIRS[2], "rejected": "Five stars"}]}, {},
         r"prefs \[train\], row 3: the chosen and rejected answers are the same"),
        ({"train": [{**PAIRS[0], "chosen": 3}]}, {}, r"prefs \[train\], row 1: column 'chosen' is a JSON number"),
        ({"train": [{**PAIRS[1], "who": " "}, PAIRS[0]]}, {"privacy_unit": "user", "user_column": "who"},
         r"prefs \[train\], row 1: no user id in data.user_column='who'"),
        ({"train": PAIRS}, {"privacy_unit": "user", "user_column": "person"},
         r"prefs \[train\]: missing column\(s\) \['person'\]"),
    ],
)  # fmt: skip
def test_bad_hub_rows_are_refused_in_one_line_naming_the_row(
    tmp_path: Path, tiny_bpe_dir: Path, splits: dict, settings: dict, message: str
) -> None:
    folder = hub_folder(tmp_path / "prefs", splits)
    with pytest.raises(ValueError, match=message) as refused:
        module(folder, tiny_bpe_dir, **settings).dataset("train")
    assert "\n" not in str(refused.value) and "ann" not in str(refused.value)  # one line, no user id


def test_a_missing_split_or_an_unreachable_hub_names_data_dataset(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    folder = hub_folder(tmp_path / "prefs", {"train": PAIRS})
    with pytest.raises(ValueError, match=r"data.dataset='.*prefs' has no 'validation' split \(it has \['train'\]\)"):
        module(folder, tiny_bpe_dir).dataset("validation")
    with pytest.raises(
        ValueError, match=r"^data.dataset='someone/prefs' could not be loaded from the Hugging Face hub"
    ):
        module("someone/prefs", tiny_bpe_dir).dataset("train")


def test_dplit_dpo_fit_trains_privately_on_a_hub_dataset(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    from dplit.cli.lightning_cli import run_dpo_cli

    pairs = [{"prompt": f"Review {i}:", "chosen": f"A warm film {i}.", "rejected": "A dull mess."} for i in range(12)]
    folder = hub_folder(tmp_path / "prefs", {"train": pairs, "test": pairs[:4]})
    cli = run_dpo_cli([
        "fit", "--config", str(CONFIGS / "dpo_quickstart.yaml"), "--data.dataset", str(folder),
        "--data.tokenizer", str(tiny_bpe_dir), "--data.max_length", "32", "--model.config.n_positions", "32",
        "--data.batch_size", "4", "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
    ])  # fmt: skip
    assert cli.trainer.strategy.accountant.steps == 1 and cli.trainer.strategy.dpsgd.dataset_size == 12
    assert len(cli.datamodule.dataset("validation")) == 4 and "val/reward_accuracy" in cli.trainer.callback_metrics
