"""The study's summary: each arm's mean ± std over seeds, untied − tied paired by seed, the sweep's choice."""

from __future__ import annotations

from typing import Any

from bench.study.paired import paired_statistics, seeds_for_half_width
from bench.study.record import mean_std
from bench.tying.arms import PAIRS
from bench.tying.plan import chosen_lr

RESOLUTION = 0.005
"""The untied − tied difference (accuracy, 0.5 points) the seed count is sized to resolve."""


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (scale, arm, ε): accuracy mean ± std over seeds and costs; untied − tied paired by seed; the sweep."""
    trained = [r for r in rows if not r.get("sweep")]
    ok = [r for r in trained if r.get("status") == "ok"]
    keys = list(dict.fromkeys((r.get("rows"), r["arm"], r["epsilon"]) for r in trained))
    arms = []
    for scale, arm, epsilon in keys:
        group = [r for r in ok if (r.get("rows"), r["arm"], r["epsilon"]) == (scale, arm, epsilon)]
        failed = [r for r in trained if (r.get("rows"), r["arm"], r["epsilon"]) == (scale, arm, epsilon)
                  and r.get("status") != "ok"]
        arms.append({
            "rows": scale, "arm": arm, "target_epsilon": epsilon, "seeds": [r["seed"] for r in group],
            "failed": len(failed), "lr": sorted({r["lr"] for r in group if r.get("lr")}) or None,
            **{key: mean_std([r.get(key) for r in group]) for key in (
                "val_acc", "epsilon_spent", "steps", "peak_rss_mb", "train_peak_mb", "step_time_s",
                "noise_multiplier")},
        })
    scales = list(dict.fromkeys(r.get("rows") for r in ok))
    differences = [d for pair in PAIRS for scale in scales for d in paired(ok, scale, *pair)]
    return {"arms": arms, "untied_minus_tied": differences, "sweep": sweep_summary(rows)}


def paired(ok: list[dict[str, Any]], scale: int | None, name: str, untied_arm: str,
           tied_arm: str) -> list[dict[str, Any]]:
    """Per ε at one scale: untied − tied validation accuracy over the seeds both arms finished, with its statistics."""
    here = [r for r in ok if r.get("rows") == scale and r["arm"] in (untied_arm, tied_arm)]
    differences = []
    for epsilon in sorted({r["epsilon"] for r in here}):
        tied = {r["seed"]: r["val_acc"] for r in here if r["arm"] == tied_arm and r["epsilon"] == epsilon}
        untied = {r["seed"]: r["val_acc"] for r in here if r["arm"] == untied_arm and r["epsilon"] == epsilon}
        seeds = sorted(set(tied) & set(untied))
        if not seeds:
            continue
        values = [untied[s] - tied[s] for s in seeds]
        statistics = paired_statistics(values)
        needed = seeds_for_half_width(statistics["std"], RESOLUTION) if statistics["std"] else None
        differences.append({"comparison": name, "rows": scale, "target_epsilon": epsilon, "seeds": seeds,
                            "per_seed": dict(zip(map(str, seeds), values, strict=True)), **statistics,
                            "seeds_for_half_width": {"half_width": RESOLUTION, "seeds": needed}})
    return differences


def sweep_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scale: each candidate learning rate's held-out accuracy and the one chosen."""
    sweeps = [r for r in rows if r.get("sweep") and r.get("status") == "ok"]
    summary = []
    for scale in dict.fromkeys(r["rows"] for r in sweeps):
        here = sorted((r for r in sweeps if r["rows"] == scale), key=lambda r: r["lr"])
        candidates = [r["lr"] for r in here]
        summary.append({"rows": scale, "held_out_rows": here[0]["val_examples"],
                        "train_rows": here[0]["train_examples"],
                        "held_out_acc": {f"{r['lr']:g}": r["val_acc"] for r in here},
                        "chosen_lr": chosen_lr(here, scale, candidates)})
    return summary
