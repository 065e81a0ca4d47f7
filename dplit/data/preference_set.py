"""The built-in offline preference set ``builtin``: review openings, a positive answer preferred to a negative one.

Each prompt opens a review clause of the built-in corpus' grammar, "<determiner> <noun> <verb>"; both answers
finish it, "<adverb> <adjective> .", with the same adverb: the chosen answer's adjective is positive, the rejected
one's negative (the sentiment preference of the DPO paper's §6.1, made by code). A policy that learns to prefer
positive adjectives after any opening ranks held-out pairs above chance within a few DP steps on a CPU. The
vocabulary and tokenizer are the built-in corpus' (:mod:`dplit.data.corpus`); splits come from independent seeded
streams (``random.Random``).
"""

from __future__ import annotations

import random
from typing import NamedTuple

from dplit.data.corpus import ADVERBS, DETERMINERS, NOUNS, VERBS
from dplit.data.synthetic import NEGATIVE_WORDS, POSITIVE_WORDS


class PreferenceRow(NamedTuple):
    """One raw preference pair: the prompt and its chosen (preferred) and rejected answers."""

    prompt: str
    chosen: str
    rejected: str


def make_preference_split(split: str, size: int, seed: int) -> list[PreferenceRow]:
    """``size`` pairs of the ``"train"`` or ``"validation"`` split."""
    rng = random.Random(f"dplit-preferences-{split}-{seed}")
    return [_pair(rng) for _ in range(size)]


def _pair(rng: random.Random) -> PreferenceRow:
    prompt = " ".join([rng.choice(DETERMINERS), rng.choice(NOUNS), rng.choice(VERBS)])
    adverb = rng.choice(ADVERBS)
    chosen = f"{adverb} {rng.choice(POSITIVE_WORDS)} ."
    rejected = f"{adverb} {rng.choice(NEGATIVE_WORDS)} ."
    return PreferenceRow(prompt, chosen, rejected)
