"""Loading a model's tokenizer (hub, local files or GGUF), building word-level tokenizers, checking label words."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GPT2TokenizerFast,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from dplit.backbone.causal_lm import check_gguf_file, unloadable_message

END_OF_TEXT = "<|endoftext|>"
UNKNOWN = "<unk>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "vocab.json", "tokenizer.model")
"""The usual files of a local tokenizer folder (named when a folder fails to load without any of them)."""


def load_tokenizer(name_or_path: str | os.PathLike[str], gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Load a model's tokenizer from a local folder, a GGUF file or the Hugging Face hub, with a pad token set.

    A folder holding GPT-2's ``vocab.json`` and ``merges.txt`` is loaded with
    ``GPT2TokenizerFast.from_pretrained(folder)`` (``AutoTokenizer`` cannot read such a folder, and
    ``GPT2TokenizerFast(vocab_file=..., merges_file=...)`` silently builds an empty tokenizer);
    anything else goes to ``AutoTokenizer.from_pretrained``. A tokenizer without a pad token (GPT-2)
    pads with its end-of-text token.

    Args:
        name_or_path: hub name (``"gpt2"``) or a local folder.
        gguf_file: a GGUF checkpoint inside the folder ``name_or_path``; its tokenizer is loaded.

    Returns:
        The tokenizer.

    Raises:
        ValueError: one line naming ``data.tokenizer`` or ``data.gguf_file`` for a missing folder, a file given
            where a folder is expected, or a tokenizer that does not load (a folder without tokenizer files).
    """
    folder = Path(name_or_path).expanduser()
    check_tokenizer_path(str(name_or_path), gguf_file)
    if gguf_file is not None:
        check_gguf_file(str(folder), gguf_file, "data")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tokenizer = GPT2TokenizerFast.from_pretrained(str(folder))
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
        except (OSError, ValueError) as error:
            if folder.is_dir() and not _has_tokenizer_files(folder):
                files = ", ".join(TOKENIZER_FILES)
                message = f"data.tokenizer={str(name_or_path)!r}: the folder has no tokenizer files ({files})"
            else:
                message = unloadable_message(str(name_or_path), "data.tokenizer", error)
            raise ValueError(" ".join(message.split())) from error  # one line
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_tokenizer_path(name_or_path: str, gguf_file: str | None = None) -> None:
    """Refuse a local ``data.tokenizer`` that is missing or a file instead of a folder, naming the flag.

    A name that does not exist locally and does not start with ``.``, ``/`` or ``~`` is a hub name, left to the hub.
    With ``gguf_file``, ``name_or_path`` must be the local folder holding it.
    """
    path = Path(name_or_path).expanduser()
    flag = f"data.tokenizer={name_or_path!r}"
    if not path.exists():
        if gguf_file is not None:
            raise ValueError(f"{flag}: no such folder (with data.gguf_file it is the folder holding the GGUF file)")
        if name_or_path.startswith((".", "/", "~")):
            raise ValueError(f"{flag}: no such folder")
        return
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            hint = f"set data.tokenizer={str(path.parent)!r} and data.gguf_file={path.name!r}"
            raise ValueError(f"{flag}: is a GGUF file, expected its folder; {hint}")
        hint = f" such as {str(path.parent)!r}" if _has_tokenizer_files(path.parent) else ""
        raise ValueError(f"{flag}: is a file, expected a tokenizer folder{hint}")


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def build_word_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a fixed vocabulary, split on whitespace.

    Token 0 is ``<|endoftext|>`` (end of text and padding), token 1 is ``<unk>``, then ``words`` in order.
    Whitespace only separates words and is dropped, so a word with a leading space (a label word such
    as ``" good"``) is the same single token as the bare word.

    Args:
        words: the vocabulary's words, distinct and without whitespace.

    Returns:
        The tokenizer.
    """
    vocab = {word: index for index, word in enumerate([END_OF_TEXT, UNKNOWN, *words])}
    if len(vocab) != len(words) + 2 or any(not word or word != word.strip() or " " in word for word in words):
        raise ValueError("word-level vocabulary must be distinct words without whitespace")
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT, unk_token=UNKNOWN
    )


def label_word_ids(tokenizer: PreTrainedTokenizerBase, label_words: Mapping[str, str]) -> list[int]:
    """The token id of each label word, in class order.

    Args:
        tokenizer: the task's tokenizer.
        label_words: raw label string → label word.

    Returns:
        One token id per class.

    Raises:
        ValueError: naming ``data.label_words`` when a word is not exactly one token or two words share a token.
    """
    ids = []
    for label, word in label_words.items():
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if len(tokens) != 1:
            pieces = tokenizer.convert_ids_to_tokens(tokens)
            raise ValueError(
                f"data.label_words: the word {word!r} for label {label!r} must be exactly one token, "
                f"but the tokenizer splits it into {len(tokens)}: {pieces} (ids {tokens})"
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"data.label_words {dict(label_words)} must map to distinct tokens, got ids {ids}")
    return ids
