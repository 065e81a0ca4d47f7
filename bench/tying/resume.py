"""Resuming the study: the recorded rows a sitting keeps, records of an older format, and what a rerun would run.

A row is kept when its results.json has the same settings key (:func:`settings_key`) and the row finished; a planned
run is skipped when a kept row has its fingerprint (:meth:`bench.tying.arms.Study.fingerprint`).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.study import sst2
from bench.study.version import STUDY_CODE_VERSION, migrate_fingerprint
from bench.tying.arguments import parse_args
from bench.tying.arms import Study, model_identity
from bench.tying.plan import chosen_lr, plan

NUMERIC_SETTINGS = ("epochs", "batch_size", "lr", "lora_lr", "max_length", "eval_batch_size", "eval_examples",
                    "max_grad_norm", "physical_batch_size", "accelerator", "precision", "sweep_lrs", "holdout_rows",
                    "noise")
"""The settings every row of one results.json shares (the grid's axes, arms × scales × ε × seeds, may grow)."""


def settings_key(args: argparse.Namespace, sources: dict[str, Any], code: str) -> dict[str, Any]:
    """What every row of one results.json shares: the code version, the model and the non-grid settings."""
    return {"code": code, "model": model_identity(sources), **{key: getattr(args, key) for key in NUMERIC_SETTINGS}}


def recorded_rows(earlier: dict[str, Any], key: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The finished rows of an earlier sitting's results with the same settings key, and how many were dropped."""
    rows = earlier.get("runs", [])
    same = earlier.get("settings_key") == key
    kept = [r for r in rows if same and r.get("status") == "ok" and r.get("fingerprint")]
    return kept, len(rows) - len(kept)


def migrate_record(record: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``record`` (a results.json) in the current format, and how many row fingerprints were migrated.

    Row fingerprints of format 1 become format 2 (:func:`bench.study.version.migrate_fingerprint`). A settings key
    without ``noise`` comes from before ``--noise`` existed, when every DP arm drew its noise and batches from OS
    entropy: ``independent`` (its rows record ``"noise": "os_entropy"``). Nothing else (no number) changes.
    """
    key = dict(record.get("settings_key") or {})
    if key and "noise" not in key:
        key["noise"] = "independent"
    runs, migrated = [], 0
    for row in record.get("runs", []):
        if row.get("fingerprint"):
            new = migrate_fingerprint(row["fingerprint"])
            migrated += new != row["fingerprint"]
            row = {**row, "fingerprint": new}
        runs.append(row)
    return {**record, "settings_key": key, "runs": runs}, migrated


def rerun_plan(record: dict[str, Any], argv: list[str], code: str = STUDY_CODE_VERSION) -> dict[str, list[str]]:
    """What ``python -m bench.tying ARGV`` would do with ``record`` as its results.json, at code version ``code``.

    The names of the recorded rows it keeps (``kept``) and drops (``dropped``), of the runs it plans and finds
    recorded (``skip``) and of those it would run (``run``).

    Nothing runs and no data is read: the arms' sources are the ones ``record`` names (the fingerprints leave their
    paths out). A complete grid rerun with the command that made it runs nothing.
    """
    args = parse_args(argv)
    record, _ = migrate_record(record)
    sources = record["sources"]
    holdout = None
    if "non_private" in args.arms and args.sweep_lrs:
        total = (record.get("holdout") or {}).get("train_rows_total") or sst2.TRAIN_ROWS
        holdout = {**sources, "data_dir": "<held-out>", "max_eval_examples": None, "train_rows_total": total}
    study = Study(args, sources, holdout, code)
    kept, _ = recorded_rows(record, settings_key(args, sources, code))
    recorded = {r["fingerprint"] for r in kept}
    planned = {"skip": [], "run": []}
    for chunk in plan(args, lambda rows: chosen_lr(kept, rows, args.sweep_lrs) if args.sweep_lrs else args.lr):
        for run in chunk:
            planned["skip" if study.fingerprint(run) in recorded else "run"].append(run["name"])
    kept_names = {r["name"] for r in kept}
    dropped = [r["name"] for r in record.get("runs", []) if r["name"] not in kept_names]
    return {"kept": sorted(kept_names), "dropped": sorted(dropped), **planned}
