"""The sentiment judge of the controlled-sentiment DPO study: a bag-of-words naive Bayes classifier on SST-2 text.

The DPO paper (Rafailov et al. 2023, §6.1) ranks two continuations of a review prefix by a sentiment classifier. Here
the judge is a multinomial naive Bayes model with add-one smoothing over lower-cased words, trained non-privately on
public SST-2 train rows that the preference data does not use (:mod:`bench.dpo_sentiment` leaves out every train row
that is part of a prompt's sentence), and scored on SST-2 dev. It is small, exact and reproducible on a CPU in
seconds; its limits are those of a bag of words: no negation or word order ("not good" counts "good"), movie-review
vocabulary only, and a word it never saw moves nothing. Its accuracy on dev is recorded with the data it built.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

WORD = re.compile(r"[a-z0-9']+")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text`` (letters, digits and apostrophes)."""
    return WORD.findall(text.lower())


@dataclass(frozen=True)
class SentimentJudge:
    """Naive Bayes log-odds: a prior and one log-likelihood ratio per known word (positive over negative).

    Attributes:
        prior: log P(positive) - log P(negative) of the training rows.
        weights: word → log P(word | positive) - log P(word | negative), add-one smoothed.
    """

    prior: float
    weights: dict[str, float]

    @classmethod
    def fit(cls, texts: Sequence[str], labels: Sequence[int]) -> SentimentJudge:
        """Count the words of the positive (label 1) and negative (label 0) ``texts``; refuse a one-class set."""
        counts = (Counter(), Counter())
        for text, label in zip(texts, labels, strict=True):
            counts[int(label)].update(words(text))
        rows = Counter(int(label) for label in labels)
        if rows[0] == 0 or rows[1] == 0:
            raise ValueError("the judge needs positive and negative rows")
        vocabulary = set(counts[0]) | set(counts[1])
        totals = [sum(c.values()) + len(vocabulary) for c in counts]
        weights = {
            word: math.log((counts[1][word] + 1) / totals[1]) - math.log((counts[0][word] + 1) / totals[0])
            for word in vocabulary
        }
        return cls(math.log(rows[1] / rows[0]), weights)

    def score(self, text: str) -> float:
        """The log-odds that ``text`` is positive (the prior for a text without known words)."""
        return self.prior + sum(self.weights.get(word, 0.0) for word in words(text))

    def positive(self, text: str) -> bool:
        """Whether the judge calls ``text`` positive (log-odds > 0)."""
        return self.score(text) > 0

    def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
        """The share of ``texts`` whose call matches its label."""
        return sum(self.positive(t) == bool(int(y)) for t, y in zip(texts, labels, strict=True)) / len(texts)

    def to_json(self) -> dict[str, object]:
        """The judge as JSON (``SentimentJudge(**data)`` reads it back)."""
        return asdict(self)
