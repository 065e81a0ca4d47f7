"""Two arms of one benchmark run as a ratio, against its target, and as table rows (bench.fsdp, bench.memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BUSY = 0.15
"""The share of the CPUs other processes used above which an arm's timings count as disturbed."""


@dataclass(frozen=True)
class Target:
    """One ratio the benchmark reports: ``field`` of arm ``top`` over arm ``bottom``, and what it should be."""

    name: str
    top: str
    bottom: str
    field: str
    target: float | None
    """``None``: reported for orientation, no verdict."""
    direction: str = "≤"
    """``"≤"`` or ``"≥"``: which side of :attr:`target` meets it."""


def ratios(arms: dict[str, dict[str, Any]], targets: list[Target]) -> list[dict[str, Any]]:
    """Each target's ratio from this run's arms (``None`` where an arm is missing or failed), with its verdict.

    A wall-clock ratio measured while other processes used the CPUs gets no verdict (its CPU time is the steadier
    measure).
    """
    out = []
    for t in targets:
        a, b = arms.get(t.top, {}).get(t.field), arms.get(t.bottom, {}).get(t.field)
        value = a / b if a is not None and b else None
        met = (
            None
            if value is None or t.target is None
            else (value <= t.target if t.direction == "≤" else value >= t.target)
        )
        busy = max(arms.get(arm, {}).get("others_share") or 0 for arm in (t.top, t.bottom)) > BUSY
        disturbed = t.field == "step_time_s" and busy
        out.append({"name": t.name, "field": t.field, "value": value, "target": t.target, "direction": t.direction,
                    "met": None if disturbed else met, "disturbed": disturbed})  # fmt: skip
    return out


def ratio_table(ratios: list[dict[str, Any]]) -> list[str]:
    """The ratios as a markdown table: value, target (``orientation``: none) and whether it was met."""
    lines = ["| ratio | value | target | met |", "|---|---:|---:|---|"]
    for ratio in ratios:
        value = "–" if ratio["value"] is None else f"{ratio['value']:.3f}"
        target = "orientation" if ratio["target"] is None else f"{ratio['direction']} {ratio['target']}"
        met = "–" if ratio["met"] is None else ("yes" if ratio["met"] else "**no**")
        met = "disturbed: see CPU time" if ratio.get("disturbed") else met
        lines.append(f"| {ratio['name']} | {value} | {target} | {met} |")
    return lines


def busy_note(arms: list[dict[str, Any]]) -> str:
    """A sentence when other processes used the CPUs while steps were timed (empty otherwise)."""
    busy = [a["others_share"] for a in arms if (a.get("others_share") or 0) > BUSY]
    if not busy:
        return ""
    return (f"**Disturbed timings**: other processes used up to {max(busy):.0%} of the CPUs while steps were timed; "
            "the CPU time per step is the steadier measure. ")  # fmt: skip
