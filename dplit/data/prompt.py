"""Prompt templates: fill a task's text fields into a fixed text and tokenise it within ``max_length``."""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class _Field:
    """One ``{column}`` of the template, with the whitespace that the template puts before it."""

    column: str
    prefix: str


class EncodedPrompts(NamedTuple):
    """Token ids of a batch of prompts, and how many of them had their text truncated."""

    input_ids: list[list[int]]
    num_truncated: int


class PromptTemplate:
    """A prompt over a task's text columns, tokenised with only the text truncated to fit ``max_length``.

    The template is a Python format string such as ``"{sentence} It was"``. A causal LM answers at the
    END of the prompt, so the fixed template text is never cut: when a prompt is too long, tokens are
    removed from the end of the longest text field (the later field on a tie) until it fits. Each
    field's text is stripped of surrounding whitespace; the whitespace the template writes before a
    field is tokenised with the field's text (so ``"Question: {question}"`` gives ``" What"``, as
    tokenising the whole string would), and an empty text leaves the field out.

    Args:
        template: format string over ``columns`` (no positional fields, conversions or format specs).
        columns: the task's text columns.
        tokenizer: the tokenizer.
        max_length: the longest prompt in tokens.

    Raises:
        ValueError: naming ``data.template`` for fields that are not columns, or ``data.max_length``
            when the template text leaves no room for at least one token per field.
    """

    def __init__(
        self, template: str, columns: Sequence[str], tokenizer: PreTrainedTokenizerBase, max_length: int
    ) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.max_length = max_length
        literals, self.fields = _parse(template, columns)
        self._literal_ids = [self._tokenize([text])[0] if text else [] for text in literals]
        template_length = sum(len(ids) for ids in self._literal_ids)
        if template_length + len(self.fields) > max_length:
            raise ValueError(
                f"data.max_length={max_length} cannot fit the template {template!r}: its fixed text takes "
                f"{template_length} tokens and each of its {len(self.fields)} text field(s) needs at least one"
            )
        self.text_budget = max_length - template_length

    def encode(self, texts: Mapping[str, Sequence[str]]) -> EncodedPrompts:
        """Tokenise the prompts of a batch of examples.

        Args:
            texts: column → the examples' texts (all columns used by the template, equal lengths).

        Returns:
            The token ids of each prompt (at most ``max_length``) and the number of truncated prompts.
        """
        field_ids = [
            self._tokenize([_field_text(field.prefix, text) for text in texts[field.column]]) for field in self.fields
        ]
        prompts, num_truncated = [], 0
        for per_field in zip(*field_ids, strict=True):
            lengths = [len(ids) for ids in per_field]
            kept = truncated_lengths(lengths, self.text_budget)
            num_truncated += int(kept != lengths)
            prompt = list(self._literal_ids[0])
            for ids, length, literal in zip(per_field, kept, self._literal_ids[1:], strict=True):
                prompt += ids[:length]
                prompt += literal
            prompts.append(prompt)
        return EncodedPrompts(prompts, num_truncated)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def truncated_lengths(lengths: Sequence[int], budget: int) -> list[int]:
    """How many tokens of each text field to keep so that they total at most ``budget``.

    Longest-first: the same result as removing one token at a time from the currently longest field
    (the later one on a tie), computed in closed form.

    Args:
        lengths: token count of each field.
        budget: tokens available for all fields together.

    Returns:
        Tokens to keep per field.
    """
    if sum(lengths) <= budget:
        return list(lengths)
    low, high = 0, max(lengths)  # largest cap with sum(min(length, cap)) <= budget
    while low < high:
        cap = (low + high + 1) // 2
        if sum(min(length, cap) for length in lengths) <= budget:
            low = cap
        else:
            high = cap - 1
    kept = [min(length, low) for length in lengths]
    spare = budget - sum(kept)  # fewer than the fields longer than the cap; earlier ones keep one more
    for index, length in enumerate(lengths):
        if spare and length > low:
            kept[index] += 1
            spare -= 1
    return kept


def _field_text(prefix: str, text: str) -> str:
    text = text.strip()
    return prefix + text if text else ""


def _parse(template: str, columns: Sequence[str]) -> tuple[list[str], list[_Field]]:
    """Split a template into literal texts and fields: ``literal0 field0 literal1 ... fieldN literalN+1``."""
    literals, fields = [""], []
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"data.template {template!r} is not a valid format string: {error}") from error
    for literal, column, format_spec, conversion in parts:
        literals[-1] += literal
        if column is None:
            continue
        if column not in columns:
            raise ValueError(
                f"data.template {template!r}: field {{{column}}} is not one of the task's text columns {list(columns)}"
            )
        if format_spec or conversion:
            raise ValueError(
                f"data.template {template!r}: conversions and format specs are not supported in {{{column}}}"
            )
        if any(field.column == column for field in fields):
            raise ValueError(f"data.template {template!r} uses the field {{{column}}} more than once")
        stripped = literals[-1].rstrip()
        fields.append(_Field(column, literals[-1][len(stripped) :]))
        literals[-1] = stripped
        literals.append("")
    if not fields:
        raise ValueError(f"data.template {template!r} must use at least one of the task's text columns {list(columns)}")
    return literals, fields
