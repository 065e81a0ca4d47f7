"""The study's outputs: results.json with its summary, ``table.md`` and ``chart.png``.

The table says the settings in words, the machine and time, the paired untied − tied differences, every arm and run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.study import sst2
from bench.study.record import machine_line, plus_minus, write_json
from bench.tying.arms import ARMS, PAIRS
from bench.tying.plan import rows_text
from bench.tying.statistics import summarize

COLORS = {"zero_shot": "#999999", "non_private": "#4c72b0", "dp_tied": "#dd8452", "dp_untied": "#55a868",
          "lora_tied": "#c44e52", "lora_untied": "#8172b3", "lora_frozen": "#937860"}
NOISE_TEXT = {
    "common": ("common random numbers: both arms of a seed s run DPStrategy(seed=s), so they draw the same Poisson "
               "batches and the same noise on every parameter they share (an untied head's noise comes after), "
               "which sharpens the paired difference; that noise is predictable, so these models are utility "
               "measurements, not private releases"),
    "independent": "noise and Poisson batches from OS entropy in every arm (a seed pairs nothing but the start)",
}
"""How the DP arms draw their batches and noise (``--noise``), as the table says it."""


def _arm_label(arm: str, epsilon: float | None) -> str:
    return ARMS[arm].label + (f", ε = {epsilon:g}" if epsilon is not None else "")


def _points(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.2f}"


def sittings_line(results: dict[str, Any]) -> str:
    """How long the study took, sitting by sitting, and on what."""
    parts = []
    for s in results.get("sittings", []):
        m = s["machine"]
        where = f"{m['cpu_model']}, {m['logical_cpus']} logical CPUs" + (f", GPU {m['gpu']}" if m.get("gpu") else "")
        parts.append(f"{s['started'][:16]}: {s['wall_s'] / 60:.0f} min, {s['arms_run']} arm(s), {s['jobs']} at a time "
                     f"with {s['threads'] or 'default'} torch thread(s) each, on {where}")
    total = sum(s["wall_s"] for s in results.get("sittings", []))
    arm_hours = sum(r.get("process_wall_s", 0.0) for r in results["runs"]) / 3600
    return (f"{len(parts)} sitting(s), {total / 3600:.1f} h of wall time, {arm_hours:.1f} arm-hours: "
            + "; ".join(parts) + ".")


def render_table(results: dict[str, Any]) -> str:
    """``table.md``: the settings in words, machine and time, paired untied − tied differences, every arm and run."""
    s, subsets = results["settings"], results["training_subsets"]
    scales = ", ".join(f"{sub['rule']} (positive share {sub.get('positive_share', float('nan')):.2f})"
                       for sub in subsets)
    dev = subsets[0]
    lines = [
        "# Tied vs untied embeddings under DP-SGD: SmolLM2-135M-Instruct on SST-2",
        "",
        (f"Profile `{s['profile']}`: data scales {scales}; validation on {dev['dev_rule']} ({dev['dev_rows']} rows); "
         f"expected batch {s['batch_size']}, {s['epochs']} epoch(s), AdamW lr {s['lr']:g} (LoRA arms "
         f"{s['lora_lr']:g}) with linear decay, max_length {s['max_length']}, label words "
         f"{json.dumps(list(sst2.LABEL_WORDS.values()))}, seeds {s['seeds']}; DP: ghost clipping, C = "
         f"{s['max_grad_norm']:g}, σ calibrated by `target_epsilon` over the planned steps, δ = N^-1.1, PRV accountant, "
         f"{NOISE_TEXT[s.get('noise', 'independent')]}; "
         f"non-private reference at the learning rate its sweep chose (below), seeds {s['seeds'][:s['reference_seeds']]}; "
         f"{s['precision']} on {s['accelerator']}. Model: {sst2.model_line(results['sources'])}. Validation order: "
         f"{dev.get('dev_order')}."),
        "",
        machine_line(results) + ".",
        "",
        "Time: " + sittings_line(results),
        "",
        (f"## Untied − tied, paired by seed (dev accuracy, percentage points; {int(100 * 0.95)}% level)"),
        "",
        ("| comparison | train rows | target ε | seeds | mean | 95% CI (paired t) | sign test +/−/0, p | "
         "seeds for ±0.5 | verdict |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in results["summary"]["untied_minus_tied"]:
        ci = "–" if d["ci"] is None else f"[{_points(d['ci'][0])}, {_points(d['ci'][1])}]"
        sign = d["sign_test"]
        needed = d["seeds_for_half_width"]["seeds"]
        lines.append(f"| {d['comparison']} | {rows_text(d['rows'])} | {d['target_epsilon']:g} | {d['n']} | "
                     f"{_points(d['mean'])} | {ci} | {sign['positive']}/{sign['negative']}/{sign['ties']}, "
                     f"{sign['p']:.3f} | {needed or '–'} | {d['verdict']} |")
    lines += [
        "",
        ("Verdict: a direction only when the paired-t 95% interval excludes 0 and the exact two-sided sign test "
         "(ties dropped) has p < 0.05 on the same side; each cell is tested on its own (no correction across cells). "
         "Seeds for ±0.5: the seeds a paired-t 95% interval needs to have a half-width of 0.5 points at the measured "
         "paired standard deviation."),
        "",
        "Per seed (untied − tied, points):",
        "",
    ]
    for d in results["summary"]["untied_minus_tied"]:
        per_seed = ", ".join(f"{k}: {v * 100:+.1f}" for k, v in d["per_seed"].items())
        lines.append(f"* {d['comparison']}, {rows_text(d['rows'])} rows, ε = {d['target_epsilon']:g}: {per_seed}")
    lines += ["", "## Every arm", "",
              "| arm | train rows | ε spent | val acc % (mean ± std) | seeds | steps | σ | step time s | peak RSS MB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a in results["summary"]["arms"]:
        if a["arm"] == "non_private":
            eps_text = "∞" + (f" (lr {', '.join(f'{lr:g}' for lr in a['lr'])})" if a.get("lr") else "")
        elif a["arm"] == "zero_shot":
            eps_text = "0 (no training)"
        else:
            eps_text = plus_minus(a["epsilon_spent"], digits=2)
        lines.append(
            f"| {_arm_label(a['arm'], a['target_epsilon'])} | {rows_text(a['rows']) if a['arm'] != 'zero_shot' else '0'}"
            f" | {eps_text} | {plus_minus(a['val_acc'], 100)} | {a['val_acc']['n']}"
            + (f" (+{a['failed']} failed)" if a["failed"] else "") + " | "
            f"{plus_minus(a['steps'], digits=0)} | {plus_minus(a['noise_multiplier'], digits=3)} | "
            f"{plus_minus(a['step_time_s'], digits=2)} | {plus_minus(a['peak_rss_mb'], digits=0)} |"
        )
    lines += ["", "## The non-private reference's learning rate", ""]
    for sweep in results["summary"]["sweep"]:
        accs = ", ".join(f"lr {lr}: {acc * 100:.1f}%" for lr, acc in sweep["held_out_acc"].items())
        chosen = "–" if sweep["chosen_lr"] is None else f"{sweep['chosen_lr']:g}"
        lines.append(f"* {rows_text(sweep['rows'])} rows: trained on the first {sweep['train_rows']:,} rows, "
                     f"seed {s['seeds'][0]}, validated on {sweep['held_out_rows']} held-out TRAINING rows (the last "
                     f"rows of train.tsv, never dev): {accs}; chosen {chosen}.")
    if not results["summary"]["sweep"]:
        lines.append("No sweep ran (the non-private arm trains at --lr).")
    lines += [
        "",
        ("Step time: mean wall time of one optimizer step (batch start to batch end, DP clipping, noise and AdamW "
         "included), from a timing callback. Peak RSS: the arm's whole process (model loading, training and "
         "validation), `resource.getrusage`. ε spent: the DPStrategy accountant's `epsilon()` after training. "
         "std: sample standard deviation over seeds. Arms ran in their own processes, several at a time; times are "
         "indicative."),
        "",
        "## Every run",
        "",
        "| run | status | val acc % | ε spent | steps | step time s | train s | val s | process s | CPU s | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | failed: {r.get('message', '')[:120]} | | | | | | | | | |")
            continue

        def num(key: str, digits: int = 1, scale: float = 1.0, r: dict[str, Any] = r) -> str:
            value = r.get(key)
            return "–" if value is None else f"{value * scale:.{digits}f}"

        lines.append(f"| {r['name']} | ok | {num('val_acc', 1, 100)} | {num('epsilon_spent', 3)} | {r['steps']} | "
                     f"{num('step_time_s', 2)} | {num('train_wall_s', 0)} | {num('val_wall_s', 0)} | "
                     f"{num('process_wall_s', 0)} | {num('cpu_s', 0)} | {num('peak_rss_mb', 0)} |")
    lines += ["", "Commands: " + "; ".join(f"`{x['command']}`" for x in results.get("sittings", [])), ""]
    return "\n".join(lines)


def render_chart(results: dict[str, Any], path: Path) -> bool:
    """Untied − tied per seed and its 95% interval, per comparison, scale and ε (the study's answer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')", flush=True)
        return False
    cells = results["summary"]["untied_minus_tied"]
    if not cells:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cells) + 2), 4.5))
    for i, d in enumerate(cells):
        values = [v * 100 for v in d["per_seed"].values()]
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
        if d["ci"] is not None:
            low, high = d["ci"][0] * 100, d["ci"][1] * 100
            ax.errorbar(i, d["mean"] * 100, yerr=[[d["mean"] * 100 - low], [high - d["mean"] * 100]], fmt="o",
                        color=COLORS[PAIRS[0][1] if d["comparison"] == PAIRS[0][0] else PAIRS[1][1]], capsize=5)
    ax.axhline(0, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([d["comparison"].replace(" + ", "+\n") + f"\n{rows_text(d['rows'])} rows, "
                        f"ε={d['target_epsilon']:g}" for d in cells], fontsize=7)
    ax.set_ylabel("untied − tied, SST-2 dev accuracy points")
    ax.set_title("SmolLM2-135M-Instruct under DP-SGD: untied − tied per seed (dots), mean and paired-t 95% CI",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """Summarise the runs and write results.json, table.md and chart.png into ``out``."""
    results["summary"] = summarize(results["runs"])
    write_json(results, out / "results.json")
    (out / "table.md").write_text(render_table(results))
    render_chart(results, out / "chart.png")
