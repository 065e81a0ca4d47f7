"""A benchmark run's rows: what identifies a configuration, its group (size), its baseline and its ratios to it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

METHOD_NAMES = {
    "non_private": "non-private",
    "dplit_ghost": "dplit ghost",
    "dplit_per_example": "dplit per-example",
    "opacus_hooks": "opacus hooks",
    "opacus_ghost": "opacus ghost",
    "non_private_lora": "non-private LoRA",
    "dplit_ghost_lora": "dplit ghost LoRA",
    "dplit_ghost_lora_embedding": "dplit ghost LoRA + embedding",
    "opacus_hooks_lora": "opacus hooks LoRA",
    "opacus_ghost_lora": "opacus ghost LoRA",
    "opacus_ghost_lora_embedding": "opacus ghost LoRA + embedding",
}
Row = dict[str, Any]
GroupKey = tuple[str, int, int]


PRIVATIZE_NAMES = {"flat": "flat noise", "per_parameter": "per-param noise"}
"""Labels of the non-default noise steps of dplit rows (the default, ``strategy``, is DPStrategy's own)."""


def row_key(row: Row) -> tuple[str, str, str, int, int, str | None]:
    """A configuration's identity: (method, policy, model, batch, seq_len, noise step of dplit rows)."""
    return (row["method"], row["policy"], row["model"], row["batch"], row["seq_len"], row.get("privatize"))


def display_name(row: Row) -> str:
    """'dplit ghost', or 'dplit ghost [flat noise]' for a non-default noise step."""
    variant = PRIVATIZE_NAMES.get(row.get("privatize") or "")
    return METHOD_NAMES[row["method"]] + (f" [{variant}]" if variant else "")


def group_key(row: Row) -> GroupKey:
    """The (model, batch, seq_len) a row was measured at."""
    return (row["model"], row["batch"], row["seq_len"])


def groups(rows: Iterable[Row]) -> dict[GroupKey, list[Row]]:
    """Rows by (model, batch, seq_len), in first-seen order."""
    out: dict[GroupKey, list[Row]] = {}
    for row in rows:
        out.setdefault(group_key(row), []).append(row)
    return out


def find_row(rows: list[Row], method: str, policy: str, privatize: str = "strategy") -> Row | None:
    """The row of (method, policy); for dplit methods the one with noise step ``privatize``."""
    return next(
        (r for r in rows if r["method"] == method and r["policy"] == policy
         and (not method.startswith("dplit") or (r.get("privatize") or "strategy") == privatize)),
        None,
    )


def measured(row: Row | None) -> bool:
    """Whether the configuration ran and was timed."""
    return row is not None and row.get("status") == "ok" and row.get("step_time_s") is not None


def baseline_method(method: str) -> str:
    """The non-private method a row's ratios are to: non-private LoRA for the LoRA rows, else non-private."""
    return "non_private_lora" if "_lora" in method else "non_private"


def add_ratios(rows: list[Row]) -> None:
    """Set ``step_time_ratio`` and ``peak_mem_ratio`` of each row to non-private (same size and policy, same run).

    A LoRA row's ratios are to non-private LoRA training of the same model.
    """
    for group in groups(rows).values():
        for row in group:
            base = find_row(group, baseline_method(row["method"]), row["policy"])
            usable = measured(row) and measured(base)
            row["step_time_ratio"] = row["step_time_s"] / base["step_time_s"] if usable else None
            row["peak_mem_ratio"] = row["peak_mem_mb"] / base["peak_mem_mb"] if usable else None
            cpu = usable and row.get("step_cpu_s") and base.get("step_cpu_s")
            row["step_cpu_ratio"] = row["step_cpu_s"] / base["step_cpu_s"] if cpu else None  # steadier when shared
            row["ratio_baseline"] = f"{baseline_method(row['method'])}/{row['policy']}"


