"""How tight is dplit's DP guarantee in practice, and can the audit see a bug? ``dplit audit`` over a grid.

Every run reports both analyses of the same canaries: the one-run f-DP bound (Mahloujifar et al. 2025, Gaussian
curve; ``audit.analysis: fdp``, the default) and the (ε, δ) bound of Steinke et al. 2023 (``eps_delta``).
Table 1: claimed ε ∈ {1, 2, 4, 8} and the non-private row (σ = 0) against ε̂, white-box (gradient canaries) and
black-box (random-token canaries), m = 1000, for the quickstart model (Poisson batches at q = 0.05, and 64 rows in
full batches, where a one-run audit has most power) and a tiny Llama LM (full batches).
Table 2: the quickstart model in full batches, m = 10,000, with deliberately broken mechanisms
(``tests/helpers/audit_mechanisms.py``): noise std halved, division by the realised batch size, a canary's clipping
skipped, no clipping at all; with the white-box scale checks.
Table 3: repeated runs (independent noise and canaries), full batches, m = 10,000: the correct mechanism 10 times at
claimed ε = 1 and 4 and 5 times at 8, halved noise 5 times at ε = 1 and 4.

Run:  python -m bench.audit            (71 runs, about 45 minutes on 2 free CPU cores)
      python -m bench.audit --smoke    (two tiny runs, seconds: checks the pipeline)
Writes bench/results/audit/{results.json,table.md}; each run's output goes to bench/out/audit/. ``--resume`` keeps
results.json's machine and commit and adds its own sitting (commit, date, machine) to its ``sittings``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.audit_grid import MECHANISMS, SETUPS, plan
from bench.audit_tables import cell, table
from bench.study.arm import install_stop_handlers, run_process
from bench.study.record import ROOT, git_info, machine_description, machine_info, relative, write_json

OUTPUT = ROOT / "bench" / "results" / "audit"
LOGS = ROOT / "bench" / "out" / "audit"
"""Each run's output (git-ignored), beside the committed results."""


def privacy_args(claimed: float | None) -> list[str]:
    """``--trainer.strategy`` flags for a claimed ε (``None``: the non-private row, σ = 0)."""
    if claimed is None:
        return [
            "--trainer.strategy.init_args.target_epsilon",
            "null",
            "--trainer.strategy.init_args.noise_multiplier",
            "0",
        ]
    return ["--trainer.strategy.init_args.target_epsilon", str(claimed)]



def command(run: dict[str, Any], root: Path) -> list[str]:
    """``python -m dplit <audit> ...`` for ``run``, its logs under ``root``."""
    subcommand, args = SETUPS[run["setup"]]
    mechanism = MECHANISMS[run["mechanism"]]
    strategy = ["--trainer.strategy.class_path", f"tests.helpers.audit_mechanisms.{mechanism}"] if mechanism else []
    return [
        sys.executable, "-m", "dplit", *subcommand.split(), *args, *strategy, *privacy_args(run["claimed"]),
        "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
        "--trainer.limit_val_batches", "0", "--audit.mode", run["mode"], "--audit.canaries", str(run["canaries"]),
        *(["--trainer.max_epochs", str(run["epochs"])] if "epochs" in run else []),
    ]  # fmt: skip


def planned_part(row: dict[str, Any]) -> dict[str, Any]:
    """The plan entry a results row was run from (its keys before ``execute`` added the outcome)."""
    keys = ("table", "setup", "mode", "claimed", "mechanism", "canaries", "repeat", "epochs")
    return {key: row[key] for key in keys if key in row}


def execute(run: dict[str, Any], index: int, logs: Path, timeout: float) -> dict[str, Any]:
    """Run one audit; its row (the report, or why it failed)."""
    with tempfile.TemporaryDirectory() as scratch:
        argv = command(run, Path(scratch))
        started = time.monotonic()
        log = logs / f"{index:02d}.log"
        problem = run_process(argv, log, header=" ".join(argv[1:]), threads=0, timeout=timeout)
        reports = list(Path(scratch).rglob("audit.json"))
        row = {**run, "wall_s": round(time.monotonic() - started, 1), "log": relative(log)}
        if reports and (problem is None or problem.startswith("exited with code 3")):
            return {**row, "report": json.loads(reports[0].read_text())}
        return {**row, "error": problem or "no audit.json"}


def sitting(machine: dict[str, Any], git: dict[str, Any]) -> dict[str, Any]:
    """One sitting of the grid, as results.json lists it: its commit (:func:`git_info`), date (UTC) and machine."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {**git, "date": date, "machine": machine_description(machine)}


def sittings(previous: dict[str, Any]) -> list[dict[str, Any]]:
    """The sittings of an earlier results.json, first to last.

    Before results.json listed them, a resume overwrote its ``git`` with its own and kept the one before as
    ``resumed_from``: those become the first sittings, their date and machine not recorded.
    """
    if "sittings" in previous:
        return previous["sittings"]
    older = [previous["resumed_from"]] if "resumed_from" in previous else []
    return [{**git, "date": None, "machine": None} for git in [*older, previous["git"]]]


def main(argv: list[str] | None = None) -> None:
    """Run the grid (or ``--smoke``), writing results.json and table.md after every run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="two tiny runs (checks the pipeline)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--render", action="store_true", help="only re-render table.md from --output's results.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep --output's finished runs; run only the planned runs missing or failed there")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((args.output / "results.json").read_text())
        (args.output / "table.md").write_text(table(results) + "\n")
        print(table(results))
        return
    install_stop_handlers()
    args.output.mkdir(parents=True, exist_ok=True)
    logs = LOGS if args.output == OUTPUT else args.output / "runs"
    logs.mkdir(parents=True, exist_ok=True)
    machine, git = machine_info(), git_info("dplit", "tests/helpers/audit_mechanisms.py")
    now = sitting(machine, git)
    results: dict[str, Any] = {"machine": machine, "git": git, "sittings": [now],
                               "profile": "smoke" if args.smoke else "default", "runs": [], "wall_s": 0.0}  # fmt: skip
    runs = plan(args.smoke)
    if args.resume:
        previous = json.loads((args.output / "results.json").read_text())
        kept = [row for row in previous["runs"] if "report" in row]
        done = [planned_part(row) for row in kept]
        runs = [run for run in runs if run not in done]
        results.update(runs=kept, wall_s=previous["wall_s"], machine=previous["machine"], git=previous["git"],
                       sittings=[*sittings(previous), now])  # fmt: skip
    started = time.monotonic() - results["wall_s"]
    for index, run in enumerate(runs):
        row = execute(run, index, logs, args.timeout)
        results["runs"].append(row)
        results["wall_s"] = time.monotonic() - started
        write_json(results, args.output / "results.json")
        (args.output / "table.md").write_text(table(results) + "\n")
        print(
            f"[{index + 1}] {run['setup'][:40]} {run['mode']} ε={run['claimed']} {run['mechanism']} m={run['canaries']}: {cell(row)} ({row['wall_s']} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
