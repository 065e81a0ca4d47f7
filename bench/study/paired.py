"""Paired comparison of two arms over seeds: mean difference, paired-t confidence interval, sign test, verdict.

Both arms of a pair ran with the same seed (same training rows and order, same initialisation); the seeds are
independent, so the per-seed differences are an i.i.d. sample and the paired t interval and the exact sign test apply.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from scipy import stats

VERDICTS = ("untied better", "tied better", "no difference resolved")


def sign_test(differences: list[float]) -> dict[str, Any]:
    """Exact two-sided sign test of a zero median: ties dropped, Binomial(n, 1/2) on the positive count."""
    positive = sum(d > 0 for d in differences)
    negative = sum(d < 0 for d in differences)
    n = positive + negative
    p = 1.0 if n == 0 else min(1.0, 2 * float(stats.binom.cdf(min(positive, negative), n, 0.5)))
    return {"positive": positive, "negative": negative, "ties": len(differences) - n, "p": p}


def seeds_for_half_width(std: float, half_width: float, *, level: float = 0.95) -> int:
    """The fewest seeds whose paired-t interval has at most ``half_width`` at a paired standard deviation ``std``."""
    n = 2
    while stats.t.ppf(0.5 + level / 2, n - 1) * std / math.sqrt(n) > half_width:
        n += 1
    return n


def paired_statistics(differences: list[float], *, level: float = 0.95) -> dict[str, Any]:
    """Mean untied − tied difference, its paired-t interval at ``level``, the sign test and the verdict.

    The verdict names a direction only when both tests exclude zero at ``level`` (the t interval lies on one side of
    0 and the sign test's p-value is below 1 − level); otherwise it is "no difference resolved".

    Args:
        differences: untied − tied, one per seed both arms finished.
        level: the confidence level of the interval and of the verdict.
    """
    n = len(differences)
    sign = sign_test(differences)
    result: dict[str, Any] = {
        "n": n,
        "level": level,
        "mean": statistics.fmean(differences) if n else None,
        "std": statistics.stdev(differences) if n > 1 else None,
        "ci": None,
        "t_p": None,
        "sign_test": sign,
        "verdict": VERDICTS[2],
    }
    if n < 2:
        return result
    half = stats.t.ppf(0.5 + level / 2, n - 1) * result["std"] / math.sqrt(n)
    result["ci"] = [result["mean"] - half, result["mean"] + half]
    if result["std"] > 0:
        t = result["mean"] / (result["std"] / math.sqrt(n))
        result["t_p"] = float(2 * stats.t.sf(abs(t), n - 1))
    significant = sign["p"] < 1 - level
    if result["ci"][0] > 0 and significant and sign["positive"] > sign["negative"]:
        result["verdict"] = VERDICTS[0]
    elif result["ci"][1] < 0 and significant and sign["negative"] > sign["positive"]:
        result["verdict"] = VERDICTS[1]
    return result


PAIRED_COLUMNS = "| paired seeds | mean (points) | 95% CI | sign test (+/−/tie, p) |"
"""The columns of :func:`paired_row`, after the first (which names the difference)."""


def accuracies(runs: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Dev accuracy (in points) of every finished run, by arm and seed (rows with ``arm``, ``seed``, ``val_acc``)."""
    by_arm: dict[str, dict[int, float]] = {}
    for row in runs:
        if row.get("status") == "ok":
            by_arm.setdefault(row["arm"], {})[row["seed"]] = 100 * row["val_acc"]
    return by_arm


def paired_runs(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The finished runs of the seeds every arm finished, and the names of the other finished runs.

    A table of arms paired by seed takes its arm means over these seeds only, so that they and the paired differences
    describe the same runs. When fewer than two arms finished, or they share no seed, nothing is paired and every
    finished run is kept.
    """
    ok = [row for row in runs if row.get("status") == "ok"]
    by_arm = accuracies(ok)
    seeds = set.intersection(*(set(values) for values in by_arm.values())) if len(by_arm) > 1 else set()
    if not seeds:
        return ok, []
    return [row for row in ok if row["seed"] in seeds], [row["name"] for row in ok if row["seed"] not in seeds]


def unpaired_note(names: list[str]) -> list[str]:
    """The table lines naming the finished runs :func:`paired_runs` left out (none when it left none out)."""
    return [f"Left out (their seed lacks a finished run of another arm): {', '.join(names)}.", ""] if names else []


def paired_row(label: str, first: dict[int, float], second: dict[int, float]) -> str:
    """A table row of :data:`PAIRED_COLUMNS`: ``first`` − ``second`` over the seeds both have (values by seed).

    Args:
        label: the first cell, naming the difference.
        first: one arm's values by seed.
        second: the other arm's values by seed.
    """
    seeds = sorted(set(first) & set(second))
    stats = paired_statistics([first[s] - second[s] for s in seeds])
    ci = "–" if stats["ci"] is None else f"[{stats['ci'][0]:+.1f}, {stats['ci'][1]:+.1f}]"
    mean = "–" if stats["mean"] is None else f"{stats['mean']:+.1f}"
    sign = stats["sign_test"]
    return (
        f"| {label} | {stats['n']} | {mean} | {ci} | "
        f"{sign['positive']}/{sign['negative']}/{sign['ties']}, {sign['p']:.2f} |"
    )
