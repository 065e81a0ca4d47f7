"""Ratios, targets, the markdown table and the bar chart of a benchmark run (``results.json``).

Re-render an existing run with ``python -m bench.report bench/results``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.rows import Row, add_ratios, display_name, groups
from bench.step_targets import TARGET_SIZE, TARGET_SIZES, evaluate_targets

SIZE_NAMES = {"gpt2": "GPT-2 size", "smollm2": "SmolLM2-135M size", "distilgpt2": "DistilGPT-2 size", "tiny": "tiny",
              "smollm2_tiny": "SmolLM2 depth, width 96"}


def _fmt(value: Any, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def machine_line(machine: dict[str, Any]) -> str:
    """One sentence describing where the run happened."""
    where = machine.get("cuda_device") or f"{machine['cpu_model']} CPU"
    return (
        f"{where}; {machine['logical_cpus']} logical CPUs available, torch threads {machine['torch_threads']}, "
        f"{machine['memory_gib']:.0f} GiB RAM; torch {machine['torch']}, transformers {machine['transformers']}, "
        f"opacus {machine['opacus']}, Python {machine['python']}"
    )


def _run_lines(results: dict[str, Any]) -> list[str]:
    """'Run: <when>, dplit at <commit>. Command: `...`.' for each run whose rows the file holds."""
    lines = []
    for run in results.get("runs") or [results]:
        git = run["git"]
        changed = f" (changed to {git['changed_during_run']} during the run)" if git.get("changed_during_run") else ""
        lines.append(f"Run: {run['created']}, dplit at {git['describe']}{changed}. Command: `{run['command']}`.")
    return [" ".join(lines)] if len(lines) == 1 else ["Runs (rows merged with `--append`):", ""] + [
        f"* {line}" for line in lines]


def _step_counts(rows: list[Row], settings: dict[str, Any]) -> str:
    """'3 timed steps after 2 warm-up', or each combination used when rows were measured differently."""
    counts = sorted({(r.get("steps", settings["steps"]), r.get("warmup", settings["warmup"])) for r in rows})
    return " or ".join(f"{steps} timed steps after {warmup} warm-up" for steps, warmup in counts) + (
        " (see each row's `steps` in results.json)" if len(counts) > 1 else "")


def markdown(results: dict[str, Any]) -> str:
    """The markdown report: machine, settings, one table per size, the targets."""
    machine, settings, rows = results["machine"], results["settings"], results["rows"]
    memory = "CUDA max allocated" if machine.get("cuda_device") else "peak RSS of the process"
    lines = [
        "# dplit benchmark",
        "",
        f"Machine: {machine_line(machine)}.",
        *_run_lines(results),
        "",
        f"One optimizer step (forward, backward, clipping, noise σ={settings['sigma']}, C={settings['max_grad_norm']}, "
        f"AdamW; precision {settings.get('precision', '32-true')}) on a random-init label-word CausalLMClassifier "
        f"({_families(rows)}), random tokens (all real, no "
        f"padding), each configuration in its own process. Step time: median of {_step_counts(rows, settings)} "
        f"(wall clock; `CPU s` is process CPU time, all threads, and `CPU ×` its ratio to non-private: with 1 torch "
        f"thread the steadier measure when other processes share the machine). Memory: {memory} "
        "(`after model`: once the model and the batch exist, before the method's optimizer, engine or opacus "
        "wrapper; `peak − model` is what the method's training step adds). Ratios are to "
        "non-private training of the same model (same size and embedding policy; for LoRA rows, non-private LoRA: "
        "rank 8 on every projection, base weights frozen) in the same run.",
        "",
    ]
    if results.get("complete") is False:  # results.json of a suite that was stopped (bench.run writes it per row)
        lines += [f"**Incomplete**: the suite stopped after {len(rows)} configuration(s); the rest were not measured.", ""]
    if any((r.get("others_share") or 0) > 0.15 for r in rows):
        lines += [
            "Note: other processes used the machine's CPUs during some configurations (column `others`: their "
            "share of all CPUs during the timed steps); the wall times of those are inflated (on 2 cores with 2 torch "
            "threads, many-fold: OpenMP barriers wait for a descheduled thread).",
            "",
        ]
    for (model, batch, seq_len), group in groups(rows).items():
        sizes = {r["policy"]: r["parameters"] for r in group if r.get("parameters")}
        counts = ", ".join(f"{sizes[p] / 1e6:.1f}M parameters {p}" for p in ("untied", "tied") if p in sizes)
        lines += [f"## {model}, B = {batch}, T = {seq_len}" + (f" ({counts})" if counts else ""), ""]
        lines += [
            "| method | embeddings | status | step time (s) | × non-private | CPU s | CPU × | peak mem (MB) "
            "| × non-private | after model (MB) | peak − model (MB) | others | note |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in group:
            overhead = row["peak_mem_mb"] - row["baseline_mem_mb"] if row.get("peak_mem_mb") else None
            note = row.get("message", "") if row["status"] != "ok" else ""
            if row["status"] == "refused":
                note = "method refused: " + note
            lines.append(
                f"| {display_name(row)} | {row['policy']} | {row['status']} | "
                f"{_fmt(row.get('step_time_s'), '.3f')} | {_fmt(row.get('step_time_ratio'), '.2f')} | "
                f"{_fmt(row.get('step_cpu_s'), '.2f')} | {_fmt(row.get('step_cpu_ratio'), '.2f')} | "
                f"{_fmt(row.get('peak_mem_mb'), '.0f')} | "
                f"{_fmt(row.get('peak_mem_ratio'), '.2f')} | {_fmt(row.get('baseline_mem_mb'), '.0f')} | "
                f"{_fmt(overhead, '.0f')} | {_fmt(row.get('others_share'), '.0%')} | "
                f"{note.replace('|', '/').splitlines()[0][:160] if note else ''} |"
            )
        lines.append("")
    targets = results["targets"]
    official = [t for t in targets if t["official"]]
    sizes = [size for size in TARGET_SIZES if any(t["model"] == size["model"] for t in targets)] or [TARGET_SIZE]
    lines += ["## Targets (" + "; ".join(f"{SIZE_NAMES[z['model']]}, B = {z['batch']}, T = {z['seq_len']}"
                                         for z in sizes) + "; label-word head)", ""]
    if official:
        lines += _target_table(official)
    else:
        lines += ["Not measured in this run.", ""]
    others = [t for t in targets if not t["official"]]
    if others:
        lines += ["### Other checks and sizes (orientation only)", ""] + _target_table(others)
    return "\n".join(lines)


def _families(rows: list[Row]) -> str:
    """'GPT-2 size' / 'SmolLM2-135M shape: Llama, 30 layers, width 576' for the model sizes in ``rows``."""
    names = {"gpt2": "GPT-2 size", "distilgpt2": "DistilGPT-2 size", "tiny": "tiny GPT-2 (full vocabulary)",
             "smollm2": "Llama of SmolLM2-135M's shape: 30 layers, width 576, 9/3 heads, 49152 vocabulary",
             "smollm2_tiny": "Llama of SmolLM2's depth at width 96 (30 layers, 3/1 heads, 49152 vocabulary)"}
    return "; ".join(names.get(m, m) for m in dict.fromkeys(r["model"] for r in rows))


def _target_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| size | target | result | measured |", "|---|---|---|---|"]
    for t in targets:
        verdict = {True: "**met**", False: "**missed**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['model']} B={t['batch']} T={t['seq_len']} | {t['target']} | {verdict} | {t['detail']} |")
    return lines + [""]


def chart(results: dict[str, Any], path: Path) -> None:
    """Bar chart: step time and peak memory of each configuration as a multiple of non-private, per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_size = groups(results["rows"])
    fig, axes = plt.subplots(len(by_size), 2, figsize=(14, 4.0 * len(by_size)), squeeze=False)
    for (model, batch, seq_len), axis_pair in zip(by_size, axes, strict=True):
        group = by_size[(model, batch, seq_len)]
        labels = [display_name(r).replace(" [", "\n[").replace(" ", "\n", 1) + f"\n{r['policy']}" for r in group]
        for axis, field, title, limit in (
            (axis_pair[0], "step_time_ratio", "step time / non-private", 1.3),
            (axis_pair[1], "peak_mem_ratio", "peak memory / non-private", 1.15),
        ):
            values = [r.get(field) or 0.0 for r in group]
            colors = ["#888888" if r["method"].startswith("non_private") else "#1f77b4" if r["method"].startswith("dplit")
                      else "#ff7f0e" for r in group]
            bars = axis.bar(range(len(group)), values, color=colors)
            for bar, row in zip(bars, group, strict=True):
                text = f"{row[field]:.2f}" if row.get(field) else row["status"]
                axis.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                              va="bottom", fontsize=8)
            axis.axhline(1.0, color="black", linewidth=0.6)
            axis.axhline(limit, color="green", linestyle="--", linewidth=0.8, label=f"ghost untied target {limit}x")
            axis.set_xticks(range(len(group)), labels, fontsize=7)
            axis.set_title(f"{model}, B={batch}, T={seq_len}: {title}", fontsize=10)
            axis.legend(fontsize=7, loc="upper left")
    machine = results["machine"]
    fig.suptitle(f"dplit benchmark — {machine.get('cuda_device') or machine['cpu_model']} "
                 f"(torch {machine['torch']})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


MODEL_ORDER = ("gpt2", "smollm2", "distilgpt2", "smollm2_tiny", "tiny")


def size_order(row: Row) -> tuple[bool, int, int, int]:
    """The target size first, then by model (GPT-2, DistilGPT-2, tiny), batch and length (stable within a size)."""
    official = {"model": row["model"], "batch": row["batch"], "seq_len": row["seq_len"]} in TARGET_SIZES
    model = MODEL_ORDER.index(row["model"]) if row["model"] in MODEL_ORDER else len(MODEL_ORDER)
    return (not official, model, -row["batch"], row["seq_len"])


def can_chart() -> bool:
    """Whether matplotlib (the ``bench`` extra) is installed, so that ``write`` also draws chart.png."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write(results: dict[str, Any], out_dir: Path) -> str:
    """Recompute ratios and targets, then write results.json, table.md and (with matplotlib) chart.png."""
    results["rows"].sort(key=size_order)
    add_ratios(results["rows"])
    results["targets"] = evaluate_targets(results["rows"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (out_dir / "table.md").write_text(table)
    if can_chart():  # a GPU machine may lack the bench extra: the numbers matter more than the picture
        chart(results, out_dir / "chart.png")
    return table


def main(argv: list[str] | None = None) -> None:
    """Re-render table.md and chart.png of the results folder named in ``argv`` and print the table."""
    parser = argparse.ArgumentParser(description="Re-render table.md and chart.png from a results.json folder")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    results = json.loads((args.folder / "results.json").read_text())
    print(write(results, args.folder))


if __name__ == "__main__":
    main()
