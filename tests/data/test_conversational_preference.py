"""Conversational preference pairs (lists of messages) rendered with the tokenizer's chat template, as TRL renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers.processors import TemplateProcessing
from trl.data_utils import maybe_apply_chat_template

from dplit.data.conversation import render_pair
from dplit.data.preference import PreferenceDataModule
from dplit.data.tokenizer import load_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A chat template of the usual shape: every turn marked by its role and closed, the assistant's turn opened."""


def conversation(index: int) -> dict[str, list[dict[str, str]]]:
    """One conversational pair of TRL's format (a system and a user turn, one assistant turn per answer)."""
    return {
        "prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": f"Review film {index}?"}],
        "chosen": [{"role": "assistant", "content": f"A warm film {index}."}],
        "rejected": [{"role": "assistant", "content": "A dull mess."}],
    }


@pytest.fixture
def chat_tokenizer(tmp_path: Path, tiny_bpe_dir: Path) -> Path:
    """The tiny BPE tokenizer with :data:`TEMPLATE` as its chat template, saved as a folder."""
    tokenizer = load_tokenizer(tiny_bpe_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tmp_path / "chat")
    return tmp_path / "chat"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def module(train: Path, tokenizer: Path, **settings: object) -> PreferenceDataModule:
    return PreferenceDataModule(train_file=str(train), val_file=str(train), tokenizer=str(tokenizer), max_length=64,
                                **settings)  # type: ignore[arg-type]  # fmt: skip


def test_conversational_pairs_tokenise_as_the_text_trl_renders(tmp_path: Path, chat_tokenizer: Path) -> None:
    rows = [conversation(index) for index in range(4)]
    tokenizer = load_tokenizer(chat_tokenizer)
    rendered = [maybe_apply_chat_template(row, tokenizer) for row in rows]  # TRL's own rendering
    assert rendered[0]["prompt"].endswith("<|assistant|>") and rendered[0]["chosen"] == "A warm film 0.<|end|>\n"
    as_text = write(tmp_path / "text.jsonl", rendered)
    conversational = module(write(tmp_path / "chat.jsonl", rows), chat_tokenizer).dataset("train")
    plain = module(as_text, chat_tokenizer).dataset("train")
    assert len(conversational) == 4 and [conversational[i] for i in range(4)] == [plain[i] for i in range(4)]


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_bos_the_template_writes_is_not_added_twice(chat_tokenizer: Path, adds_bos: bool) -> None:
    """A tokenizer that adds its beginning-of-text token when encoding gets the template's prompt without its own."""
    tokenizer = load_tokenizer(chat_tokenizer)
    tokenizer.bos_token = bos = tokenizer.eos_token  # the tiny tokenizer has none: its end-of-text stands in
    single = f"{bos} $A" if adds_bos else "$A"
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=single, special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    row = conversation(0)
    prompt, _, _ = render_pair(row["prompt"], row["chosen"], row["rejected"], tokenizer, source="f", where="line 1")
    ids = tokenizer.encode(prompt)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id  # one BOS, first
    assert prompt.startswith(bos) != adds_bos


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        (
            {**conversation(0), "chosen": "A warm film."},
            "column 'chosen' is text while the row's other columns are lists",
        ),
        (
            {**conversation(0), "rejected": [{"role": "assistant"}]},
            "column 'rejected' holds an item that is not a message",
        ),
        ({**conversation(0), "chosen": []}, "empty chosen answer (no message)"),
        ({**conversation(0), "rejected": conversation(0)["chosen"]}, "the chosen and rejected answers are the same"),
    ],
)
def test_a_bad_conversational_row_is_refused_in_one_line_naming_the_row(
    tmp_path: Path, chat_tokenizer: Path, row: dict, problem: str
) -> None:
    train = write(tmp_path / "chat.jsonl", [conversation(1), row])
    with pytest.raises(ValueError, match="chat.jsonl, (line|row) 2") as error:
        module(train, chat_tokenizer).dataset("train")
    assert problem in str(error.value) and "\n" not in str(error.value)
    assert "film 1" not in str(error.value)  # no value of the data in the message


def test_messages_without_a_chat_template_are_refused(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    train = write(tmp_path / "chat.jsonl", [conversation(0)])
    with pytest.raises(ValueError, match=r"chat\.jsonl, line 1: prompt, chosen and rejected are lists of messages, but "
                                         r"data\.tokenizer has no chat template"):  # fmt: skip
        module(train, tiny_bpe_dir).dataset("train")
