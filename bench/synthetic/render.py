"""The pipeline's outputs: results.json with its summary, and ``table.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.study import sst2
from bench.study.record import machine_line, plus_minus, write_json
from bench.synthetic.commands import LM_CONFIG
from bench.synthetic.files import CONTROL_PROMPTS
from bench.synthetic.statistics import OVERLAP_N, summarize

ARM_LABELS = {"zero_shot": "zero-shot (no training)", "dp_classifier": "DP classifier on the private rows",
              "synthetic_pretrained": "classifier on synthetic rows of the pretrained LM (no private data)",
              "synthetic": "classifier on DP synthetic rows (DP LM)"}


def render_table(results: dict[str, Any]) -> str:
    """``table.md``: the settings in words, the machine, one row per arm and ε (accuracy, synthetic set), every run."""
    s, subset = results["settings"], results["training_subset"]
    lines = [
        "# DP synthetic data: SmolLM2-135M-Instruct on SST-2",
        "",
        (f"Profile `{s['profile']}`. Private set: {subset['rule']} (positive share "
         f"{subset.get('positive_share', float('nan')):.2f}); evaluation on {subset['dev_rule']} ({subset['dev_rows']} "
         f"rows). DP LM: `dplit lm fit --config {LM_CONFIG}`, prompt = the label's control prompt "
         f"{json.dumps(list(CONTROL_PROMPTS.values()))}, response = the review (loss on the response only), expected "
         f"batch {s['lm_batch_size']}, {s['lm_epochs']} epoch(s), AdamW lr {s['lm_lr']:g}, C = {s['lm_max_grad_norm']:g} "
         f"(summed token loss), max length {s['lm_max_length']}. Generation: {s['synthetic_per_label']} samples per "
         f"label, temperature {s['temperature']:g}, top-p {s['top_p']:g}, at most {s['max_new_tokens']} new tokens. "
         f"Classifier on the synthetic rows: no DP (post-processing), {s['synthetic_epochs']} epoch(s), batch "
         f"{s['synthetic_batch_size']}, AdamW lr {s['synthetic_lr']:g}, fixed in advance (not tuned on dev). DP "
         f"classifier on the private rows: the tying study's `dp_tied` arm, expected batch {s['batch_size']}, "
         f"{s['epochs']} epoch(s), lr {s['lr']:g}, C = {s['max_grad_norm']:g}. All DP runs: ghost clipping, σ "
         f"calibrated by `target_epsilon`, δ = N^-1.1, PRV accountant, tied embeddings (SmolLM2's own). Model: "
         f"{sst2.model_line(results['sources'])}. {s['precision']} on {s['accelerator']}, "
         f"{s['threads'] or 'default'} torch thread(s) per process, seeds {s['seeds']}."),
        "",
        machine_line(results) + f". Wall time: {results['wall_s'] / 60:.1f} min.",
        "",
        "| arm | ε | dev acc % | synthetic rows | words per row | distinct-1 / -2 / -3 | 8-grams found in the private "
        "rows % | rows copied whole % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in results["summary"]:
        eps = {"zero_shot": "0 (no training)", "synthetic_pretrained": "0 (no private data)"}.get(
            a["arm"], plus_minus(a["epsilon_spent"], digits=2))
        acc = plus_minus(a["val_acc"], 100) + (f" ({a['failed']} failed)" if a["failed"] else "")
        if a.get("rows"):
            distinct = " / ".join(plus_minus(a[f"distinct_{n}"], digits=2) for n in (1, 2, 3))
            extra = (f"{plus_minus(a['rows'], digits=0)} | {plus_minus(a['mean_words'], digits=1)} | {distinct} | "
                     f"{plus_minus(a[f'overlap_{OVERLAP_N}gram'], 100, digits=2)} | "
                     f"{plus_minus(a['copied_rows'], 100, digits=2)}")
        else:
            extra = "– | – | – | – | –"
        lines.append(f"| {ARM_LABELS[a['arm']]} | {eps} | {acc} | {extra} |")
    lines += [
        "",
        ("ε: the accountant's ε after training (for the DP synthetic rows, the LM's, from its exported card; the "
         "synthetic rows and the classifier trained on them inherit it). The pretrained LM's rows are the control: "
         "the same prompts and sampling without any fine-tuning. mean ± std over seeds. distinct-n: distinct "
         "word n-grams over all n-grams of the synthetic set (lower-cased words, punctuation and clitics apart, as "
         f"SST-2 is written). {OVERLAP_N}-grams found: the share of the synthetic set's word {OVERLAP_N}-grams that "
         f"occur verbatim in the private training rows{_chance(results)}. Rows copied whole: synthetic rows equal to a "
         "private row (same words). These two columns and the private set's positive share are computed from the "
         "private rows WITHOUT noise: they are diagnostics for this public data set, not covered by ε."),
        "",
        "Every run:",
        "",
        "| run | status | dev acc % | ε | LM steps | LM σ | synthetic rows (positive) | stage times s |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | failed: {str(r.get('message', ''))[:160]} | | | | | | |")
            continue
        eps = r.get("epsilon_spent")
        lm, syn = r.get("lm") or {}, r.get("synthetic")
        stages = [f"{stage} {r[f'{stage}_wall_s']:.0f}" for stage in ("lm_fit", "export", "generate")
                  if f"{stage}_wall_s" in r]
        stages.append(f"classifier {r['classifier']['process_wall_s']:.0f}" if "classifier" in r
                      else f"process {r['process_wall_s']:.0f}")
        rows = f"{syn['rows']} ({syn['positive']})" if syn else "–"
        lines.append(f"| {r['name']} | ok | {r['val_acc'] * 100:.1f} | {_number(eps, 3)} | {lm.get('steps', '–')} | "
                     f"{_number(lm.get('noise_multiplier'), 3)} | {rows} | {', '.join(stages)} |")
    lines += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def _chance(results: dict[str, Any]) -> str:
    """The overlap that real held-out SST-2 rows have with the private rows, for the table's note."""
    shares = [r["synthetic"].get(f"held_out_overlap_{OVERLAP_N}gram") for r in results["runs"] if r.get("synthetic")]
    shares = [share for share in shares if share is not None]
    if not shares:
        return ""
    return (f" (for scale: {shares[0] * 100:.2f}% of the {OVERLAP_N}-grams of {results['settings']['lm_val_examples']} "
            "real SST-2 train rows outside the private set are found there too)")


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """Summarise the runs and write results.json and table.md into ``out``."""
    results["summary"] = summarize(results["runs"])
    write_json(results, out / "results.json")
    (out / "table.md").write_text(render_table(results))
