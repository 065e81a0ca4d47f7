"""The built-in offline task ``synthetic``: a tiny sentiment language made by code, with its own tokenizer.

Each sentence is 8 to 14 words: neutral filler words plus one or three sentiment words, shuffled. The
label is the majority polarity of the sentiment words (1 = positive): a sentence with one sentiment
word is easy, one with three needs them counted (two against one in half of those). The prompt is
``"{sentence} overall it was"`` → ``" bad"`` / ``" good"``. A bag-of-words majority vote solves it
exactly, so a 2-layer, 64-wide GPT-2 learns it under DP-SGD within a minute on a CPU.

Everything comes from ``seed`` (Python's ``random.Random``, stable across platforms); the training and
validation splits are drawn from independent streams, so either size leaves the other split unchanged.
"""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerFast

from dplit.data.sources import TextSplit
from dplit.data.tokenizer import build_word_tokenizer

POSITIVE_WORDS = (
    "wonderful", "excellent", "lovely", "superb", "delightful", "brilliant",
    "charming", "pleasant", "moving", "fantastic", "enjoyable", "beautiful",
)  # fmt: skip
NEGATIVE_WORDS = (
    "awful", "boring", "dull", "horrible", "painful", "clumsy",
    "tedious", "ugly", "weak", "dreadful", "messy", "annoying",
)  # fmt: skip
FILLER_WORDS = (
    "the", "a", "this", "that", "movie", "film", "story", "plot", "actor", "actress",
    "scene", "music", "script", "director", "ending", "camera", "cast", "role", "dialogue", "set",
    "and", "but", "with", "of", "in", "on", "for", "by", "as", "to",
    "is", "seems", "feels", "looks", "has", "had", "very", "quite", "rather", "somewhat",
    "really", "so", "too", "again", "then", "still", "also", "just", "more", "less",
    "old", "new", "long", "short", "french", "early", "late", "first", "second", "final",
)  # fmt: skip
TEMPLATE_WORDS = ("overall", "it", "was")
LABEL_WORDS = ("bad", "good")

MIN_WORDS, MAX_WORDS = 8, 14


def synthetic_vocabulary() -> list[str]:
    """The task's words, in token order after the two special tokens."""
    return [*TEMPLATE_WORDS, *LABEL_WORDS, *POSITIVE_WORDS, *NEGATIVE_WORDS, *FILLER_WORDS]


def build_synthetic_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer of the synthetic task (``" good"`` is one token).

    Returns:
        The tokenizer (see :func:`dplit.data.tokenizer.build_word_tokenizer`).
    """
    return build_word_tokenizer(synthetic_vocabulary())


def make_synthetic_split(split: str, size: int, seed: int) -> TextSplit:
    """Draw one split of the synthetic task.

    Args:
        split: ``"train"`` or ``"dev"``; each split has its own random stream.
        size: number of examples.
        seed: the task's seed.

    Returns:
        The split, labels ``"0"`` (negative) and ``"1"`` (positive).
    """
    rng = random.Random(f"dplit-synthetic-{split}-{seed}")
    sentences, labels = [], []
    for _ in range(size):
        label = rng.randrange(2)
        sentences.append(" ".join(_sentence(rng, positive=label == 1)))
        labels.append(str(label))
    return TextSplit({"sentence": sentences}, labels, f"synthetic[{split}, seed={seed}]")


def _sentence(rng: random.Random, positive: bool) -> list[str]:
    majority, minority = (POSITIVE_WORDS, NEGATIVE_WORDS) if positive else (NEGATIVE_WORDS, POSITIVE_WORDS)
    num_sentiment = rng.choice((1, 3))
    num_minority = rng.choice((0, 1)) if num_sentiment == 3 else 0
    words = [rng.choice(majority) for _ in range(num_sentiment - num_minority)]
    words += [rng.choice(minority) for _ in range(num_minority)]
    words += [rng.choice(FILLER_WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS) - num_sentiment)]
    rng.shuffle(words)
    return words
