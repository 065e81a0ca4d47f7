"""The plan: every run of the grid in priority order, each named, and the learning rate the sweep chose."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

GROUPS = (("dp_tied", "dp_untied"), ("lora_tied", "lora_untied", "lora_frozen"))
"""DP arms in priority order: every scale of a group runs before the next group."""


def rows_text(rows: int | None) -> str:
    """A data scale as the table and the progress lines write it: ``all`` or the row count."""
    return "all" if rows is None else f"{rows:,}"


def run_name(run: dict[str, Any]) -> str:
    """A run's folder name: its scale, arm, ε and seed (or the sweep's learning rate)."""
    if run["arm"] == "zero_shot":
        return "zero_shot"
    scale = f"rows{run['rows'] or 'all'}"
    if run.get("sweep"):
        return f"{scale}-sweep-lr{run['lr']:g}"
    eps = f"-eps{run['epsilon']:g}" if run["epsilon"] is not None else ""
    return f"{scale}-{run['arm']}{eps}-seed{run['seed']}"


def _named(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**run, "name": run_name(run)} for run in runs]


def grid_runs(args: argparse.Namespace, arms: tuple[str, ...], rows: int | None) -> list[dict[str, Any]]:
    """The DP runs of ``arms`` at one scale, seed by seed (so a partial grid holds whole pairs).

    With common noise both arms of seed s run ``DPStrategy(seed=s)`` (``dp_seed``).
    """
    chosen = [arm for arm in arms if arm in args.arms]
    return _named([{"arm": arm, "epsilon": epsilon, "seed": seed, "rows": rows,
                    "dp_seed": seed if args.noise == "common" else None}
                   for seed in args.seeds for epsilon in args.epsilons for arm in chosen])


def sweep_runs(args: argparse.Namespace, rows: int | None) -> list[dict[str, Any]]:
    """The non-private learning-rate sweep at one scale: one seed, validated on held-out training rows."""
    return _named([{"arm": "non_private", "epsilon": None, "seed": args.seeds[0], "rows": rows, "lr": lr,
                    "sweep": True} for lr in args.sweep_lrs])


def reference_runs(args: argparse.Namespace, rows: int | None, lr: float) -> list[dict[str, Any]]:
    """The non-private arm at one scale, at the sweep's learning rate, on the first ``--reference-seeds`` seeds."""
    return _named([{"arm": "non_private", "epsilon": None, "seed": seed, "rows": rows, "lr": lr}
                   for seed in args.seeds[: args.reference_seeds]])


def chosen_lr(rows: list[dict[str, Any]], scale: int | None, candidates: list[float]) -> float | None:
    """The sweep's learning rate at ``scale``; ``None`` until every candidate has a result.

    The rate with the best held-out accuracy (ties: the smaller rate).
    """
    done = {r["lr"]: r["val_acc"] for r in rows if r.get("sweep") and r["rows"] == scale and r["status"] == "ok"}
    if not candidates or any(lr not in done for lr in candidates):
        return None
    return max(sorted(candidates), key=lambda lr: done[lr])


def plan(args: argparse.Namespace, reference_lr: Callable[[int | None], float | None]) -> Iterator[list[dict[str, Any]]]:
    """Every run in priority order, in chunks: a chunk ends where the next needs its results (a sweep's choice).

    Zero-shot, then per group of :data:`GROUPS` and per scale its DP grid; after full fine-tuning at a scale, its
    learning-rate sweep, then (in the next chunk) the non-private reference at ``reference_lr(scale)``, left out
    while that is ``None``.
    """
    chunk = _named([{"arm": "zero_shot", "epsilon": None, "seed": args.seeds[0], "rows": None}]) \
        if "zero_shot" in args.arms else []
    for index, group in enumerate(GROUPS):
        for rows in args.train_examples:
            chunk += grid_runs(args, group, rows)
            if index == 0 and "non_private" in args.arms:
                chunk += sweep_runs(args, rows)
                yield chunk
                lr = reference_lr(rows)
                if lr is None:
                    print(f"the sweep at {rows_text(rows)} rows is incomplete: no non-private reference", flush=True)
                chunk = reference_runs(args, rows, lr) if lr is not None else []
    yield chunk
