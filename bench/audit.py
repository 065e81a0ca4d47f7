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
BUG_CANARIES = 10_000
REPEATS = {("correct", 1.0): 10, ("correct", 4.0): 10, ("correct", 8.0): 5, ("noise std × 0.5", 1.0): 5,
           ("noise std × 0.5", 4.0): 5}  # fmt: skip
"""Table 3: (mechanism, claimed ε) → independent runs at m = 10,000 (the first also fills table 2's cell)."""
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
        {"table": 3, "setup": BUG_SETUP, "mode": "white_box", "claimed": claimed, "mechanism": name,
         "canaries": BUG_CANARIES, "repeat": repeat}
        for repeat in range(max(REPEATS.values())) for (name, claimed), count in REPEATS.items() if repeat < count
    ]  # fmt: skip
    runs += [
        {"table": 2, "setup": BUG_SETUP, "mode": "white_box", "claimed": claimed, "mechanism": name,
         "canaries": BUG_CANARIES}
        for claimed in (1.0, 4.0) for name in MECHANISMS if (name, claimed) not in REPEATS
    ]  # fmt: skip
    runs += [
        {"table": 1, "setup": setup, "mode": mode, "claimed": claimed, "mechanism": "correct", "canaries": 1000}
        for setup in SETUPS for claimed in (*EPSILONS, None) for mode in MODES
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


def cell(row: dict[str, Any] | None, analysis: str = "fdp") -> str:
    """ε̂ of a row under ``analysis``, marked when it exceeds the claim."""
    if row is None:
        return "–"
    if "error" in row:
        return "failed"
    report = row["report"]
    value = report[analysis]["epsilon"]
    claimed = report["claimed_epsilon"]
    flag = " **> claim**" if claimed is not None and value > claimed else ""
    return f"{value:.2f}{flag}"


def checks_cell(row: dict[str, Any] | None) -> str:
    """The white-box scale checks of a row: the measured signal and noise (× C, × σC), failed ones in bold."""
    if row is None or "report" not in row:
        return "–"
    parts = [f"{check['measured']:.2f}" if check["passed"] else f"**{check['measured']:.2f} ✗**"
             for check in row["report"]["checks"]]  # fmt: skip
    return " / ".join(parts) or "–"


def claimed_text(rows: list[dict[str, Any]], claimed: float | None) -> str:
    """The claimed-ε cell of a table row: the ε the audit's runs report, else the target (∞ without noise)."""
    if claimed is None:
        return "∞ (σ = 0)"
    done = [row["report"]["claimed_epsilon"] for row in rows if "report" in row]
    return f"{done[0]:.2f}" if done else f"{claimed:g}"


def plan_cell(row: dict[str, Any] | None, key: str) -> str:
    """The f-DP plan's ``expected_epsilon`` or ``ceiling_epsilon`` of a row."""
    return f"{row['report']['plan'][key]:.2f}" if row is not None and "report" in row else "–"


def grid_table(rows: list[dict[str, Any]], setup: str) -> list[str]:
    """Table 1 for one setup: both analyses, both modes, the expected and largest f-DP ε̂."""
    lines = [f"## {setup}", "",
             "| claimed ε | white-box f-DP | white-box (ε, δ) | f-DP expected if correct | f-DP at most (m = 1000) | "
             "black-box f-DP | black-box (ε, δ) |", "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for claimed in (*EPSILONS, None):
        pair = {row["mode"]: row for row in rows if row["claimed"] == claimed}
        if pair:
            white, black = pair.get("white_box"), pair.get("black_box")
            lines.append(
                f"| {claimed_text(list(pair.values()), claimed)} | {cell(white)} | {cell(white, 'eps_delta')} | "
                f"{plan_cell(white, 'expected_epsilon')} | {plan_cell(white, 'ceiling_epsilon')} | {cell(black)} | "
                f"{cell(black, 'eps_delta')} |"
            )
    return [*lines, "", *noise_off_line(rows), ""]


def noise_off_line(rows: list[dict[str, Any]]) -> list[str]:
    """How close the white-box noise-off run comes to the most m canaries can show (all m guesses right)."""
    import numpy as np

    from dplit.audit.fdp import gdp_epsilon, mu_lower_bound

    row = next((r for r in rows if r["claimed"] is None and r["mode"] == "white_box" and "report" in r), None)
    if row is None:
        return []
    report = row["report"]
    m = report["canaries"]
    level = 1 - report["confidence"]
    most = gdp_epsilon(float(mu_lower_bound(canaries=m, guesses=np.array(m), correct=np.array(m), level=level)),
                       report["delta"])  # fmt: skip
    got, ceiling = report["fdp"]["epsilon"], report["plan"]["ceiling_epsilon"]
    return [f"Without noise (white-box): f-DP ε̂ = {got:.2f}, {got / most:.0%} of the {most:.2f} that all m = {m:,} "
            f"guesses right would show, {got / ceiling:.0%} of what its planned {report['fdp']['k_plus']} + "
            f"{report['fdp']['k_minus']} guesses can show ({ceiling:.2f})."]


def repeat_table(rows: list[dict[str, Any]]) -> list[str]:
    """Table 3: each (mechanism, claimed ε)'s runs, how many exceed the claim, and their ε̂."""
    lines = ["## Repeated runs (full batches, m = 10,000, white-box)", "",
             "| mechanism | claimed ε | runs | claimed curve refuted (f-DP verdict) | f-DP ε̂ > claim | (ε, δ) ε̂ > claim | "
             "a check fails | f-DP ε̂ (each run) |", "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, claimed in REPEATS:
        done = [row for row in rows if row["mechanism"] == name and row["claimed"] == claimed and "report" in row]
        if not done:
            continue
        reports = [row["report"] for row in done]
        over = {key: sum(r[key]["epsilon"] > r["claimed_epsilon"] for r in reports) for key in ("fdp", "eps_delta")}
        failed = sum(any(not check["passed"] for check in r["checks"]) for r in reports)
        each = ", ".join(f"{r['fdp']['epsilon']:.2f}" for r in reports)
        refuted = sum(bool(r.get("claimed_curve_refuted")) for r in reports)
        lines.append(f"| {name} | {reports[0]['claimed_epsilon']:.2f} | {len(reports)} | {refuted} | {over['fdp']} | "
                     f"{over['eps_delta']} | {failed} | {each} |")  # fmt: skip
    return [*lines, ""]


def table(results: dict[str, Any]) -> str:
    """The three tables, as Markdown."""
    rows = results["runs"]
    lines = [
        "# dplit audit: ε̂ (95% confidence) against the claimed ε",
        "",
        machine_line(results) + f". Wall time: {results['wall_s'] / 60:.1f} min.",
        "",
    ]
    for setup in SETUPS:
        chosen = [row for row in rows if row["table"] == 1 and row["setup"] == setup]
        if chosen:
            lines += grid_table(chosen, setup)
    bugs = [row for row in rows if row["table"] == 2 or (row["table"] == 3 and row.get("repeat") == 0)]
    if bugs:
        lines += [f"## Broken mechanisms ({BUG_SETUP}, white-box, m = {BUG_CANARIES:,})", "",
                  "| mechanism | f-DP ε̂ at ε = 1 | (ε, δ) ε̂ at ε = 1 | checks at ε = 1 | f-DP ε̂ at ε = 4 | "
                  "(ε, δ) ε̂ at ε = 4 | checks at ε = 4 |", "|---|---:|---:|---|---:|---:|---|"]  # fmt: skip
        for name in MECHANISMS:
            pair = {row["claimed"]: row for row in bugs if row["mechanism"] == name}
            one, four = pair.get(1.0), pair.get(4.0)
            lines.append(f"| {name} | {cell(one)} | {cell(one, 'eps_delta')} | {checks_cell(one)} | {cell(four)} | "
                         f"{cell(four, 'eps_delta')} | {checks_cell(four)} |")  # fmt: skip
        lines.append("")
    repeats = [row for row in rows if row["table"] == 3]
    if repeats:
        lines += repeat_table(repeats)
    return "\n".join(lines)


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
    results: dict[str, Any] = {"machine": machine_info(), "git": git_info("dplit", "tests/helpers/audit_mechanisms.py"),
                               "profile": "smoke" if args.smoke else "default", "runs": [], "wall_s": 0.0}  # fmt: skip
    runs = plan(args.smoke)
    if args.resume:
        previous = json.loads((args.output / "results.json").read_text())
        kept = [row for row in previous["runs"] if "report" in row]
        done = [planned_part(row) for row in kept]
        runs = [run for run in runs if run not in done]
        results.update(runs=kept, wall_s=previous["wall_s"], resumed_from=previous["git"])
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
