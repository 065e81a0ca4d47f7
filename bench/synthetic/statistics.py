"""What the pipeline measures of a synthetic set (diversity, memorisation) and its summary over seeds."""

from __future__ import annotations

import re
from typing import Any

from bench.study.record import mean_std

OVERLAP_N = 8


def words(text: str) -> list[str]:
    """Lower-cased words split as SST-2 is: punctuation and the clitics ``n't``, ``'s``, ``'re``, ... apart."""
    text = re.sub(r"(\w)n't\b", r"\1 n't", text.lower())
    return re.findall(r"n't|'\w+|\w+|[^\w\s]", text)


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The word ``n``-grams of ``text``, in order."""
    tokens = words(text)
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: list[str], n: int) -> float | None:
    """Distinct ``n``-grams over all ``n``-grams of ``texts`` (``None`` when there are none)."""
    grams = [gram for text in texts for gram in ngrams(text, n)]
    return len(set(grams)) / len(grams) if grams else None


def overlap_share(texts: list[str], private: list[str], n: int = OVERLAP_N) -> float | None:
    """The share of the ``n``-grams of ``texts`` found verbatim in ``private`` (``None`` when there are none)."""
    seen = {gram for text in private for gram in ngrams(text, n)}
    grams = [gram for text in texts for gram in ngrams(text, n)]
    return sum(gram in seen for gram in grams) / len(grams) if grams else None


def describe_synthetic(texts: list[str], private: list[str], held_out: list[str] | None) -> dict[str, Any]:
    """Diversity and memorisation of a synthetic set, measured against the private rows.

    Args:
        texts: the synthetic rows (as written to the classifier's train.tsv).
        private: the private training rows.
        held_out: real rows outside the private set, for the chance level of the overlap (``None``: none).
    """
    known = {tuple(words(text)) for text in private}
    return {"distinct_1": distinct_n(texts, 1), "distinct_2": distinct_n(texts, 2), "distinct_3": distinct_n(texts, 3),
            f"overlap_{OVERLAP_N}gram": overlap_share(texts, private),
            f"held_out_overlap_{OVERLAP_N}gram": overlap_share(held_out, private) if held_out else None,
            "copied_rows": sum(tuple(words(text)) in known for text in texts) / len(texts) if texts else None,
            f"{OVERLAP_N}grams": sum(len(ngrams(text, OVERLAP_N)) for text in texts),
            "mean_words": sum(len(words(text)) for text in texts) / len(texts) if texts else None}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (arm, ε): dev accuracy and ε spent (mean ± std over seeds), and the synthetic sets' statistics."""
    keys: list[tuple[str, float | None]] = []
    for row in rows:
        if (row["arm"], row["epsilon"]) not in keys:
            keys.append((row["arm"], row["epsilon"]))
    summary = []
    for arm, epsilon in keys:
        group = [r for r in rows if r["arm"] == arm and r["epsilon"] == epsilon and r.get("status") == "ok"]
        synthetic = [r["synthetic"] for r in group if "synthetic" in r]
        entry = {"arm": arm, "target_epsilon": epsilon, "seeds": [r["seed"] for r in group],
                 "failed": sum(1 for r in rows if r["arm"] == arm and r["epsilon"] == epsilon
                               and r.get("status") != "ok"),
                 "val_acc": mean_std([r.get("val_acc") for r in group]),
                 "epsilon_spent": mean_std([r.get("epsilon_spent") for r in group])}
        for key in ("rows", "distinct_1", "distinct_2", "distinct_3", f"overlap_{OVERLAP_N}gram",
                    f"held_out_overlap_{OVERLAP_N}gram", "copied_rows", "mean_words"):
            entry[key] = mean_std([s.get(key) for s in synthetic]) if synthetic else None
        summary.append(entry)
    return summary
