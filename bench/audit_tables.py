"""The audit benchmark's tables, as Markdown, from its ``results.json`` (see :mod:`bench.audit`)."""

from __future__ import annotations

from typing import Any

from bench.audit_grid import BUG_CANARIES, BUG_SETUP, EPSILONS, MECHANISMS, REPEATS, SETUPS
from bench.study.record import machine_line


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
    """How close the white-box noise-off run comes to the most m canaries can show.

    Three references: the planned guesses on simulated noise-off runs of the same sampling (under Poisson
    sampling an included canary that is never sampled is released exactly as an excluded one), the plan's guesses
    all right, and all m guesses right.
    """
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
    got, ceiling, observer = (report["fdp"]["epsilon"], report["plan"]["ceiling_epsilon"],
                              report["plan"]["expected_epsilon"])  # fmt: skip
    return [f"Without noise (white-box): f-DP ε̂ = {got:.2f}: {got / observer:.0%} of the {observer:.2f} that its "
            f"guesses show on simulated noise-off runs of this sampling (no data; same m, q and steps), "
            f"{got / ceiling:.0%} of what its planned {report['fdp']['k_plus']} + {report['fdp']['k_minus']} guesses "
            f"can show ({ceiling:.2f}), {got / most:.0%} of the {most:.2f} that all m = {m:,} guesses right would "
            "show."]


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


def sittings_lines(sittings: list[dict[str, Any]]) -> list[str]:
    """The sittings of a resumed grid, one a line (commit, date, machine); none for a grid run in one sitting."""
    if len(sittings) < 2:
        return []
    lines = [
        f"- `{s['describe']}`, {s['date'] or 'date not recorded'}, {s['machine'] or 'machine not recorded'}"
        for s in sittings
    ]
    heading = "Sittings, first to last (the machine and commit above are results.json's own, which a resume keeps):"
    return [heading, "", *lines, ""]


def table(results: dict[str, Any]) -> str:
    """The three tables, as Markdown."""
    rows = results["runs"]
    lines = [
        "# dplit audit: ε̂ (95% confidence) against the claimed ε",
        "",
        machine_line(results) + f". Wall time: {results['wall_s'] / 60:.1f} min.",
        "",
        *sittings_lines(results.get("sittings", [])),
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
