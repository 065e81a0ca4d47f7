"""How tight is dplit's DP guarantee in practice, and can the audit see a bug? ``dplit audit`` over a grid.

Table 1: claimed ε ∈ {1, 2, 4, 8} and the non-private row (σ = 0) against the one-run lower bound ε̂, white-box
(gradient canaries) and black-box (random-token canaries), for the quickstart model (Poisson batches at q = 0.05, and 64 rows in
full batches, where a one-run audit has most power) and a tiny Llama LM (full batches).
Table 2: the quickstart model in full batches with deliberately broken mechanisms (``tests/helpers/audit_mechanisms.py``):
noise std halved, division by the realised batch size, a canary's clipping skipped, no clipping at all.

Run:  python -m bench.audit            (50 runs, about 11 minutes on 2 CPU cores)
      python -m bench.audit --smoke    (two tiny runs, seconds: checks the pipeline)
Writes bench/results/audit/{results.json,table.md}; each run's output goes to bench/out/audit/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.study.arm import install_stop_handlers, run_process
from bench.study.record import ROOT, git_info, machine_info, machine_line, relative, write_json

OUTPUT = ROOT / "bench" / "results" / "audit"
LOGS = ROOT / "bench" / "out" / "audit"
"""Each run's output (git-ignored), beside the committed results."""
EPSILONS = (1.0, 2.0, 4.0, 8.0)
MODES = ("white_box", "black_box")
TINY_LLAMA = json.dumps(
    {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
)  # fmt: skip
FULL_BATCH = ["--trainer.max_epochs", "20", "--trainer.strategy.init_args.target_delta", "1e-7"]
SETUPS: dict[str, tuple[str, list[str]]] = {
    "quickstart GPT-2, Poisson batches (2,000 rows, q = 0.05, 60 steps, δ = 1e-7)": (
        "audit",
        ["--config", "configs/quickstart.yaml", "--data.synthetic_train_size", "2000", "--data.batch_size", "100",
         "--trainer.strategy.init_args.target_delta", "1e-7"],
    ),
    "quickstart GPT-2, full batches (64 rows, q = 1, 20 steps, δ = 1e-7)": (
        "audit", ["--config", "configs/quickstart.yaml", "--data.synthetic_train_size", "64",
                  "--data.batch_size", "64", *FULL_BATCH],
    ),
    "tiny Llama LM (2×64), full batches (64 rows, q = 1, 20 steps, δ = 1e-7)": (
        "lm audit", ["--config", "configs/lm_quickstart.yaml", "--model.config", TINY_LLAMA,
                     "--data.builtin_train_size", "64", "--data.batch_size", "64", *FULL_BATCH],
    ),
}  # fmt: skip
BUG_SETUP = "quickstart GPT-2, full batches (64 rows, q = 1, 20 steps, δ = 1e-7)"
MECHANISMS = {
    "correct": None,
    "noise std × 0.5": "HalfNoise",
    "÷ realised batch size": "RealisedBatchDivisor",
    "a canary's clipping skipped (10·C)": "UnclippedCanaries",
    "no clipping (canaries at 100·C)": "NoClipping",
}


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


SMOKE_EPOCHS = 2
"""Steps of each ``--smoke`` run (the setup's own 20 would check nothing more about the pipeline)."""


def plan(smoke: bool) -> list[dict[str, Any]]:
    """Every run: its table, setup, mode, claimed ε, mechanism and canaries."""
    if smoke:
        return [{"table": 1, "setup": BUG_SETUP, "mode": mode, "claimed": 4.0, "mechanism": "correct", "canaries": 100,
                 "epochs": SMOKE_EPOCHS} for mode in MODES]  # fmt: skip
    runs = [
        {"table": 1, "setup": setup, "mode": mode, "claimed": claimed, "mechanism": "correct", "canaries": 1000}
        for setup in SETUPS for claimed in (*EPSILONS, None) for mode in MODES
    ]  # fmt: skip
    runs += [
        {"table": 2, "setup": BUG_SETUP, "mode": "white_box", "claimed": claimed, "mechanism": name, "canaries": m}
        for m in (1000, 100_000) for claimed in (1.0, 4.0) for name in MECHANISMS
    ]  # fmt: skip
    return runs


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


def cell(row: dict[str, Any] | None) -> str:
    """ε̂ of a row, marked when it exceeds the claim."""
    if row is None:
        return "–"
    if "error" in row:
        return "failed"
    report = row["report"]
    flag = " **> claim**" if report["violation"] else ""
    return f"{report['epsilon_lower_bound']:.2f}{flag}"


def claimed_text(rows: list[dict[str, Any]], claimed: float | None) -> str:
    """The claimed-ε cell of a table row: the ε the audit's runs report, else the target (∞ without noise)."""
    if claimed is None:
        return "∞ (σ = 0)"
    done = [row["report"]["claimed_epsilon"] for row in rows if "report" in row]
    return f"{done[0]:.2f}" if done else f"{claimed:g}"


def table(results: dict[str, Any]) -> str:
    """Both tables, as Markdown."""
    rows = results["runs"]
    lines = [
        "# dplit audit: ε̂ (95% confidence) against the claimed ε",
        "",
        machine_line(results) + f". Wall time: {results['wall_s'] / 60:.1f} min.",
        "",
    ]
    for setup in SETUPS:
        chosen = [row for row in rows if row["table"] == 1 and row["setup"] == setup]
        if not chosen:
            continue
        lines += [f"## {setup}", "", "| claimed ε | ε̂ white-box | ε̂ black-box |", "|---:|---:|---:|"]
        for claimed in (*EPSILONS, None):
            pair = {row["mode"]: row for row in chosen if row["claimed"] == claimed}
            if pair:
                lines.append(
                    f"| {claimed_text(list(pair.values()), claimed)} | {cell(pair.get('white_box'))} | {cell(pair.get('black_box'))} |"
                )
        lines.append("")
    bugs = [row for row in rows if row["table"] == 2]
    if bugs:
        lines += [f"## Broken mechanisms ({BUG_SETUP}, white-box)", "",
                  "| mechanism | m | ε̂ at claimed ε = 1 | ε̂ at claimed ε = 4 |", "|---|---:|---:|---:|"]  # fmt: skip
        for m in (1000, 100_000):
            for name in MECHANISMS:
                pair = {row["claimed"]: row for row in bugs if row["mechanism"] == name and row["canaries"] == m}
                if pair:
                    lines.append(f"| {name} | {m:,} | {cell(pair.get(1.0))} | {cell(pair.get(4.0))} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the grid (or ``--smoke``), writing results.json and table.md after every run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="two tiny runs (checks the pipeline)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args(argv)
    install_stop_handlers()
    args.output.mkdir(parents=True, exist_ok=True)
    logs = LOGS if args.output == OUTPUT else args.output / "runs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine_info(), "git": git_info("dplit", "tests/helpers/audit_mechanisms.py"),
                               "profile": "smoke" if args.smoke else "default", "runs": [], "wall_s": 0.0}  # fmt: skip
    started = time.monotonic()
    for index, run in enumerate(plan(args.smoke)):
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
