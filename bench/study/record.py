"""What every study records beside its numbers.

Machine and commit (:mod:`bench.machine`), mean ± std, and results written atomically.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from bench.machine import ROOT, git_info, machine_description, machine_info, version

__all__ = ["ROOT", "copy_ledger_facts", "git_info", "machine_description", "machine_info", "machine_line", "mean_std",
           "plus_minus", "relative", "run_stamp", "version", "write_json"]


def relative(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it, else absolute."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def machine_line(results: dict[str, Any]) -> str:
    """The machine, package versions and dplit commit of a study's ``results``, as a sentence for its table."""
    return (
        f"Machine: {machine_description(results['machine'])}. dplit commit `{results['git']['commit'][:12]}`"
        + (" (+ uncommitted changes)" if results["git"]["uncommitted_changes"] else "")
    )


def run_stamp(
    machine: dict[str, Any], git: dict[str, Any], inputs: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """What a sitting writes into each run's row: its code, machine and input files, so a resumed study can tell.

    Args:
        machine: the sitting's :func:`machine_info` (kept as :func:`machine_description`, the line tables print).
        git: the sitting's :func:`git_info` (kept as its ``describe``).
        inputs: the fingerprint of the files the arms read (:func:`bench.study.resume.input_fingerprint`).
    """
    stamp = {"git": git["describe"], "machine": machine_description(machine)}
    return stamp if inputs is None else {**stamp, "inputs": inputs}


def mean_std(values: list[float | None]) -> dict[str, Any]:
    """Mean, sample standard deviation and count of the finite ``values`` (``None`` when there are none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values), "values": values}


def plus_minus(stats: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    """``mean ± std`` of :func:`mean_std`'s result (``–`` when nothing was measured)."""
    if stats.get("mean") is None:
        return "–"
    text = f"{stats['mean'] * scale:.{digits}f}"
    if stats.get("std") is not None:
        text += f" ± {stats['std'] * scale:.{digits}f}"
    return text


def write_json(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` to ``path`` through a temporary file, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, path)


def copy_ledger_facts(results: dict[str, Any], key: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """Copy ``fields`` of each run's privacy ledger (in its ``log_dir``) into the run's row as ``key``, once.

    Args:
        results: a study's record; rows that already have ``key``, or no ledger, are left as they are.
        key: the row's key for the facts.
        fields: the ledger's keys to copy (``None`` where the ledger has none).
    """
    for row in results["runs"]:
        ledger = Path(row.get("log_dir") or "/nonexistent") / "privacy_ledger.json"
        if key not in row and ledger.is_file():
            facts = json.loads(ledger.read_text())
            row[key] = {field: facts.get(field) for field in fields}
    return results
