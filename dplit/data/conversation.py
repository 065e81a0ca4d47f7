"""Conversational preference pairs: ``prompt``, ``chosen`` and ``rejected`` as lists of messages, rendered as TRL does.

A row of a conversational preference file (TRL's and the hub's conversational format) holds lists of
``{"role", "content"}`` messages: the prompt's turns, then the chosen and the rejected answer's turns. The tokenizer's
chat template renders them to text as TRL's ``maybe_apply_chat_template`` does: the prompt with the generation prompt
(the assistant's turn opened), each answer as the rest of the template applied to the prompt and that answer. The
text then goes through the same checks and tokenisation as a plain-text pair. No value of a row is ever named in a
message: only the file, the row and what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from dplit.data.files import Record, refusal

CONVERSATION_COLUMNS = ("prompt", "chosen", "rejected")


def render_conversations(path: Path | str, records: list[Record], tokenizer: PreTrainedTokenizerBase) -> list[Record]:
    """The records, each conversational one (any of its three columns a list) rendered to text; others as they are.

    Raises:
        ValueError: one line naming the file and the row: a tokenizer without a chat template, a row mixing text
            and messages, a message that is not ``{"role": str, "content": str}``, or a template whose rendering of
            the prompt and an answer does not start with its rendering of the prompt alone.
    """
    rendered = []
    for record in records:
        values = [record.columns.get(column) for column in CONVERSATION_COLUMNS]
        if not any(isinstance(value, list) for value in values):
            rendered.append(record)
            continue
        where = f"{record.unit} {record.number}"
        if getattr(tokenizer, "chat_template", None) is None:
            raise refusal(
                path,
                "prompt, chosen and rejected are lists of messages, but data.tokenizer has no chat template to render "
                "them with: give a tokenizer with one, or plain-text columns",
                where,
            )
        prompt, chosen, rejected = (_messages(path, column, value, where) for column, value in
                                    zip(CONVERSATION_COLUMNS, values, strict=True))  # fmt: skip
        texts = render_pair(prompt, chosen, rejected, tokenizer, source=path, where=where)
        rendered.append(
            record._replace(columns={**record.columns, **dict(zip(CONVERSATION_COLUMNS, texts, strict=True))})
        )
    return rendered


def render_pair(
    prompt: list[dict[str, str]], chosen: list[dict[str, str]], rejected: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase, *, source: Path | str, where: str,
) -> tuple[str, str, str]:  # fmt: skip
    """The prompt and both answers as text: the prompt's template with the assistant's turn opened, then the rest."""
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    answers = []
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer:
            raise refusal(source, f"empty {name} answer (no message)", where)
        whole = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
        if not whole.startswith(prompt_text):
            raise refusal(
                source,
                f"the chat template renders the prompt with the {name} answer other than the prompt alone followed by "
                "the answer, so the answer's tokens cannot be told apart: use a template that extends the prompt",
                where,
            )
        answers.append(whole[len(prompt_text) :])
    return _without_added_bos(prompt_text, tokenizer), answers[0], answers[1]


def _messages(path: Path | str, column: str, value: Any, where: str) -> list[dict[str, str]]:
    """A column's list of ``{"role", "content"}`` messages (an empty prompt is allowed; answers are checked later)."""
    if not isinstance(value, list):
        kind = "missing" if value is None else "text"
        raise refusal(path, f"column {column!r} is {kind} while the row's other columns are lists of messages", where)
    for message in value:
        if not _is_message(message):
            raise refusal(
                path, f'column {column!r} holds an item that is not a message {{"role": str, "content": str}}', where
            )
    return [{"role": message["role"], "content": message["content"]} for message in value]


def _is_message(message: object) -> bool:
    if not isinstance(message, Mapping):
        return False
    return isinstance(message.get("role"), str) and isinstance(message.get("content"), str)


def _without_added_bos(text: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt without the beginning-of-text token its template wrote, when tokenising adds that token again."""
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer.bos_token_id in tokenizer.encode("", add_special_tokens=True)
    return text[len(bos) :] if adds_bos and text.startswith(bos) else text  # type: ignore[arg-type]
