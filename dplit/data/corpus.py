"""The built-in offline corpus ``builtin``: short movie-review sentences from a small grammar, with its own tokenizer.

Each text is two clauses, "<subject> <verb> <adverb> <adjective> and/but <subject> <verb> <adverb> <adjective> .",
whose adjectives agree in polarity after "and" and disagree after "but". A model that learns the grammar and the
agreement predicts much better than chance, so a 2-layer model's validation perplexity falls clearly within a
couple of minutes of DP-SGD on a CPU. Splits come from independent seeded streams (``random.Random``).
"""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerFast

from dplit.data.synthetic import FILLER_WORDS, NEGATIVE_WORDS, POSITIVE_WORDS
from dplit.data.tokenizer import build_word_tokenizer

DETERMINERS = ("the", "this", "that", "a")
NOUNS = ("movie", "film", "story", "plot", "actor", "actress", "scene", "music", "script", "ending", "cast")
VERBS = ("is", "seems", "feels", "looks")
ADVERBS = ("very", "quite", "rather", "really", "so", "too")
CONNECTIVES = ("and", "but")
PUNCTUATION = (".",)


def corpus_vocabulary() -> list[str]:
    """Every word of the corpus, in token order after the two special tokens."""
    words = [*FILLER_WORDS, *POSITIVE_WORDS, *NEGATIVE_WORDS, *PUNCTUATION]
    return list(dict.fromkeys(words))


def build_corpus_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer of the built-in corpus (end of text ``<|endoftext|>`` is also padding)."""
    return build_word_tokenizer(corpus_vocabulary())


def make_corpus_split(split: str, size: int, seed: int) -> list[str]:
    """``size`` texts of the ``"train"`` or ``"validation"`` split."""
    rng = random.Random(f"dplit-corpus-{split}-{seed}")
    return [_text(rng) for _ in range(size)]


def _clause(rng: random.Random, positive: bool) -> list[str]:
    adjective = rng.choice(POSITIVE_WORDS if positive else NEGATIVE_WORDS)
    return [rng.choice(DETERMINERS), rng.choice(NOUNS), rng.choice(VERBS), rng.choice(ADVERBS), adjective]


def _text(rng: random.Random) -> str:
    positive, connective = rng.random() < 0.5, rng.choice(CONNECTIVES)
    second = positive if connective == "and" else not positive
    return " ".join([*_clause(rng, positive), connective, *_clause(rng, second), "."])
