"""Ratios, targets, the markdown table and the bar chart of a benchmark run (``results.json``).

Re-render an existing run with ``python -m bench.report bench/results``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
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
TARGET_SIZE = {"model": "gpt2", "batch": 16, "seq_len": 128}
"""The size the GPT-2 targets are stated for (GPT-2 size, B = 16, T = 128, label-word head)."""
SMOLLM2_TARGET_SIZE = {"model": "smollm2", "batch": 16, "seq_len": 64}
"""The size the SmolLM2 targets are stated for (SmolLM2-135M's shape, B = 16, T = 64, label-word head)."""
TARGET_SIZES = (TARGET_SIZE, SMOLLM2_TARGET_SIZE)
SIZE_NAMES = {"gpt2": "GPT-2 size", "smollm2": "SmolLM2-135M size", "distilgpt2": "DistilGPT-2 size", "tiny": "tiny",
              "smollm2_tiny": "SmolLM2 depth, width 96"}

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


def _find(rows: list[Row], method: str, policy: str, privatize: str = "strategy") -> Row | None:
    """The row of (method, policy); for dplit methods the one with noise step ``privatize``."""
    return next(
        (r for r in rows if r["method"] == method and r["policy"] == policy
         and (not method.startswith("dplit") or (r.get("privatize") or "strategy") == privatize)),
        None,
    )


def _ok(row: Row | None) -> bool:
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
            base = _find(group, baseline_method(row["method"]), row["policy"])
            usable = _ok(row) and _ok(base)
            row["step_time_ratio"] = row["step_time_s"] / base["step_time_s"] if usable else None
            row["peak_mem_ratio"] = row["peak_mem_mb"] / base["peak_mem_mb"] if usable else None
            cpu = usable and row.get("step_cpu_s") and base.get("step_cpu_s")
            row["step_cpu_ratio"] = row["step_cpu_s"] / base["step_cpu_s"] if cpu else None  # steadier when shared
            row["ratio_baseline"] = f"{baseline_method(row['method'])}/{row['policy']}"


def evaluate_targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated for every (model, batch, seq_len) group measured.

    The official checks (``official: true``) are the GPT-2 targets at GPT-2 size, B = 16, T = 128 and the SmolLM2
    targets (ghost tied and untied each ≤ 1.3× non-private step time and ≤ 1.15× peak memory) at SmolLM2-135M
    size, B = 16, T = 64; every other check and size is shown for orientation.
    """
    results: list[dict[str, Any]] = []
    for (model, batch, seq_len), group in groups(rows).items():
        variants = ["strategy"] + sorted({r["privatize"] for r in group if r["method"] == "dplit_ghost"
                                         and r.get("privatize") not in (None, "strategy")})
        for privatize in variants:
            results += _targets_of(group, model, batch, seq_len, privatize)
    return results


def _targets_of(group: list[Row], model: str, batch: int, seq_len: int, privatize: str) -> list[dict[str, Any]]:
    """The targets for one size, with the dplit rows of noise step ``privatize``."""
    results: list[dict[str, Any]] = []
    size = {"model": model, "batch": batch, "seq_len": seq_len}
    gpt2_official, smollm2_official = size == TARGET_SIZE, size == SMOLLM2_TARGET_SIZE
    variant = PRIVATIZE_NAMES.get(privatize)
    plain_u, plain_t = _find(group, "non_private", "untied"), _find(group, "non_private", "tied")
    ghost_u, ghost_t = _find(group, "dplit_ghost", "untied", privatize), _find(group, "dplit_ghost", "tied", privatize)
    materialised = _find(group, "dplit_per_example", "tied", privatize) or _find(group, "dplit_per_example", "tied")
    opacus_ghost = _find(group, "opacus_ghost", "untied")

    def check(
        name: str, needed: list[Row | None], value: Any, limit: float, text: str, smollm2: bool = False
    ) -> dict[str, Any] | None:
        """Append the target's result (``None``: none of its configurations ran) and return it."""
        official = gpt2_official or (smollm2 and smollm2_official)  # smollm2: also a SmolLM2 target
        name = name + (f" [dplit with {variant}]" if variant else "")
        if all(r is None for r in needed):  # none of its configurations was part of this run (e.g. --lora)
            return None
        if not all(_ok(r) for r in needed):
            results.append({"model": model, "batch": batch, "seq_len": seq_len, "official": official,
                            "target": name, "value": None, "limit": limit, "met": None,
                            "detail": "not measured (a configuration is missing, refused or failed)"})
            return results[-1]
        measured = value()
        results.append({"model": model, "batch": batch, "seq_len": seq_len, "official": official,
                        "target": name, "value": measured, "limit": limit, "met": bool(measured <= limit),
                        "detail": text.format(v=measured, limit=limit)})
        return results[-1]

    check("ghost untied step time <= 1.3x non-private", [ghost_u, plain_u],
          lambda: ghost_u["step_time_s"] / plain_u["step_time_s"], 1.3, "{v:.2f}x (limit {limit}x)", True)
    check("ghost untied peak memory <= 1.15x non-private", [ghost_u, plain_u],
          lambda: ghost_u["peak_mem_mb"] / plain_u["peak_mem_mb"], 1.15, "{v:.2f}x (limit {limit}x)", True)
    if model == "smollm2":  # the SmolLM2 targets hold the tied model to the same limits against non-private tied
        check("ghost tied step time <= 1.3x non-private", [ghost_t, plain_t],
              lambda: ghost_t["step_time_s"] / plain_t["step_time_s"], 1.3, "{v:.2f}x (limit {limit}x)", True)
        check("ghost tied peak memory <= 1.15x non-private", [ghost_t, plain_t],
              lambda: ghost_t["peak_mem_mb"] / plain_t["peak_mem_mb"], 1.15, "{v:.2f}x (limit {limit}x)", True)
    check("ghost tied step time <= 1.1x ghost untied", [ghost_t, ghost_u],
          lambda: ghost_t["step_time_s"] / ghost_u["step_time_s"], 1.1, "{v:.2f}x (limit {limit}x)")
    check("ghost tied peak memory <= 1.1x ghost untied", [ghost_t, ghost_u],
          lambda: ghost_t["peak_mem_mb"] / ghost_u["peak_mem_mb"], 1.1, "{v:.2f}x (limit {limit}x)")

    def overhead_fraction() -> float:
        ghost = ghost_t["peak_mem_mb"] - plain_t["peak_mem_mb"]
        baseline = materialised["peak_mem_mb"] - plain_t["peak_mem_mb"]
        return ghost / baseline if baseline > 0 else float("inf")

    overhead = check("tied DP memory overhead >= 60% smaller than per-example (materialising) tied", [ghost_t, plain_t,
          materialised], overhead_fraction, 0.4,
          "ghost overhead is {v:.0%} of the materialising overhead (limit 40%, i.e. at least 60% smaller)")
    if overhead is not None and overhead["met"] is not None:
        ghost, baseline = (r["peak_mem_mb"] - plain_t["peak_mem_mb"] for r in (ghost_t, materialised))
        overhead["detail"] = (f"peak − non-private tied peak: ghost {ghost:+.0f} MB, materialising {baseline:+.0f} MB "
                              f"(ghost's is {overhead['value']:.0%} of it; limit 40%)")
    faster = check("ghost untied faster than opacus ghost (untied)", [ghost_u, opacus_ghost],
          lambda: ghost_u["step_time_s"] / opacus_ghost["step_time_s"], 1.0,
          "dplit takes {v:.2f}x opacus ghost's step time (must be < 1)")
    if faster is not None and faster["met"] is not None:  # strictly faster
        faster["met"] = bool(faster["value"] < 1.0)
    results += _lora_targets(group, size, gpt2_official or smollm2_official, privatize)
    return results


def _lora_targets(group: list[Row], size: dict[str, Any], official: bool, privatize: str) -> list[dict[str, Any]]:
    """The LoRA targets, per embedding policy measured.

    Ghost LoRA ≤ 1.15× non-private LoRA step time and ≤ 1.1× its peak memory; at SmolLM2 size also ghost LoRA peak
    memory ≤ 0.6× ghost full fine-tuning.
    """
    results = []
    for policy in ("tied", "untied"):
        plain, ghost = _find(group, "non_private_lora", policy), _find(group, "dplit_ghost_lora", policy, privatize)
        full = _find(group, "dplit_ghost", policy, privatize)
        if ghost is None and plain is None:  # no LoRA row of this policy ran
            continue
        checks = [
            (f"ghost LoRA ({policy}) step time <= 1.15x non-private LoRA", plain, "step_time_s", 1.15),
            (f"ghost LoRA ({policy}) peak memory <= 1.1x non-private LoRA", plain, "peak_mem_mb", 1.1),
        ]
        if size["model"] == "smollm2":
            checks.append((f"ghost LoRA ({policy}) peak memory <= 0.6x ghost full fine-tuning", full, "peak_mem_mb", 0.6))
        for name, base, field, limit in checks:
            row = {**size, "official": official, "target": name, "limit": limit}
            if not (_ok(ghost) and _ok(base)):
                results.append({**row, "value": None, "met": None,
                                "detail": "not measured (a configuration is missing, refused or failed)"})
                continue
            value = ghost[field] / base[field]
            results.append({**row, "value": value, "met": bool(value <= limit),
                            "detail": f"{value:.2f}x (limit {limit}x)"})
    return results


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
