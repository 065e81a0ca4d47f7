"""Resuming a study paired by seed: finished runs of an earlier sitting with the same settings are kept, not rerun.

A study (:mod:`bench.clip_modes`, :mod:`bench.user_level`) records its settings (every argument except how a sitting
runs: :data:`SITTING`) and each run by name (its arm and seed) in ``--out``/results.json. A rerun with the same
settings keeps the runs that finished and runs only the planned ones not among them; a rerun with other settings is
refused. The folders (:data:`PLACES`) say where, not what: a study moved to another checkout resumes.

Each row also records the files its arm read (:func:`input_fingerprint`: SST-2's TSVs and the GGUF checkpoint, by
size and the digest of their ends), and a rerun runs again every recorded run whose files have changed since
(:func:`unchanged_inputs`). Rows recorded before this was recorded are kept: not recorded is not changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

SITTING = ("seeds", "jobs", "timeout", "dry_run", "render")
"""Arguments of one sitting (which seeds now, how many at once, how long): not part of the study's settings."""

PLACES = ("out", "logs")
"""Arguments naming folders: recorded, but a study whose folders moved is the same study."""

ENDS = 2**20
"""Bytes read from each end of an input file for its fingerprint (the whole file when it is at most twice this)."""


def add_seed_arguments(parser: argparse.ArgumentParser, seeds: tuple[int, ...] = (0, 1, 2, 3, 4)) -> None:
    """``--seeds`` (the pairing seeds, default ``seeds``) and ``--render`` (re-render table.md only)."""
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(seeds),
        help="seeds: each fixes initialisation, data order, Poisson batches and noise for every arm",
    )
    parser.add_argument("--render", action="store_true", help="only re-render table.md from --out's results.json")


def study_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings a results.json records: every argument but :data:`SITTING`, as text."""
    return {key: str(value) for key, value in vars(args).items() if key not in SITTING}


def same_settings(recorded: dict[str, str], settings: dict[str, str]) -> bool:
    """Whether two recorded settings make the same study (:data:`SITTING` and :data:`PLACES` left out of both)."""
    ignored = SITTING + PLACES
    return {k: v for k, v in recorded.items() if k not in ignored} == {
        k: v for k, v in settings.items() if k not in ignored
    }


def planned_runs(
    seeds: list[int], arms: dict[str, dict[str, Any]], done: set[str], stamp: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The runs of ``seeds`` not in ``done``, seed by seed (every arm of a seed together), named ``{arm}_seed{seed}``.

    Args:
        seeds: the pairing seeds of this sitting.
        arms: each arm's own fields, by arm name.
        done: the names of the runs already recorded.
        stamp: what this sitting writes into each row (:func:`bench.study.record.run_stamp`).
    """
    return [
        {"name": f"{arm}_seed{seed}", "arm": arm, "seed": seed, **fields, **(stamp or {})}
        for seed in seeds
        for arm, fields in arms.items()
        if f"{arm}_seed{seed}" not in done
    ]


def earlier_sitting(
    out: Path, settings: dict[str, str], migrate: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The earlier results.json in ``out`` (``{}`` if none) and its finished runs.

    Args:
        out: the study's results folder.
        settings: this sitting's :func:`study_settings`.
        migrate: rewrites an older record into the study's current form (run names, keys) before it is read.

    Raises:
        SystemExit: the earlier results were made with other settings.
    """
    path = out / "results.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    if previous and migrate is not None:
        previous = migrate(previous)
    if previous and not same_settings(previous.get("settings", {}), settings):
        raise SystemExit(f"{path} was made with other settings: move it away to start over")
    return previous, [row for row in previous.get("runs", []) if row.get("status") == "ok"]


def render(out: Path, table: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Re-render ``out``/table.md from ``out``/results.json with ``table``, print it and return the results."""
    results = json.loads((out / "results.json").read_text())
    text = table(results)
    (out / "table.md").write_text(text)
    print(text)
    return results


def file_fingerprint(path: Path) -> dict[str, Any]:
    """A cheap fingerprint of a file's content: its size and a SHA-256 of its first and last :data:`ENDS` bytes.

    By content, not modification time: the studies rewrite their data copies (the same bytes) at every sitting.
    """
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as file:
        digest.update(file.read(ENDS))
        file.seek(max(ENDS, size - ENDS))
        digest.update(file.read())
    return {"size": size, "sha256_ends": digest.hexdigest()[:16]}


def input_fingerprint(files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """:func:`file_fingerprint` of each of an arm's input ``files`` that exists, by role (a name without its path)."""
    return {role: file_fingerprint(path) for role, path in sorted(files.items()) if path.is_file()}


def unchanged_inputs(rows: list[dict[str, Any]], inputs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded ``rows`` whose input files are ``inputs`` now; the others are to be run again.

    A row without ``inputs`` was recorded before they were fingerprinted: it is kept (not recorded, not changed).
    """
    changed = [row["name"] for row in rows if row.get("inputs", inputs) != inputs]
    if changed:
        print(f"input files changed since {len(changed)} recorded runs ({', '.join(changed)}): running them again")
    return [row for row in rows if row["name"] not in changed]
