"""Tied vs untied embeddings under DP-SGD on a real pretrained LM and task: SmolLM2-135M-Instruct on GLUE SST-2.

    python -m benchmarks.tying --smoke        # tiny subset, 1 seed, 1 ε, 64 dev rows: a few minutes (a check)
    python -m benchmarks.tying                # default CPU profile (see PROFILES): under an hour on 2 CPU cores
    python -m benchmarks.tying --full         # the paper's recipe (all 67,349 rows, B=1000, 3 epochs): for a GPU
    python -m benchmarks.tying --hub          # weights, tokenizer and GLUE from the Hugging Face hub
    python -m benchmarks.tying --arms lora_tied lora_untied lora_frozen   # any subset of ARMS

Arms (:data:`ARMS`), all with the same hyperparameters (expected batch, epochs, max_length, label words, seeds) and,
for the DP arms, the same privacy budget; full fine-tuning at ``--lr``, LoRA at ``--lora-lr``:

* ``zero_shot``: the pretrained model, no training, validation only (``dplit validate``).
* ``non_private``: the same module trained without ``DPStrategy`` (``--trainer.strategy auto --non_private true``).
* ``dp_tied`` / ``dp_untied``: full fine-tuning with ``DPStrategy`` (ghost clipping, ``target_epsilon`` = ε) from
  ``configs/smollm2_sst2_tied.yaml`` (``TiedEmbeddings``, SmolLM2's own) and ``configs/smollm2_sst2_untied.yaml``
  (``UntiedEmbeddings(init="copy")``).
* ``lora_tied`` / ``lora_untied`` / ``lora_frozen``: ``configs/smollm2_sst2_lora.yaml`` (rank-8 LoRA on every
  projection) beside the trained tied embedding, beside a trained untied copy, or with the embedding frozen.

Each arm is ``dplit``'s own CLI (the shipped YAML plus overrides) in its own process (:mod:`benchmarks.study.arm`),
validated once after training on the whole GLUE dev split (872 rows unless ``--eval-examples``). ``results.json``
(every run, the summary, command, machine, commit), ``table.md`` and ``chart.png`` go to ``--out`` (default
``benchmarks/results/tying/``); Lightning logs and each arm's output to ``--logs`` (default ``benchmarks/out/tying/``,
git-ignored). The training subset is the FIRST ``--train-examples`` rows of SST-2's train.tsv.

Default CPU profile (see PROFILES): 160 rows, expected batch 8, 1 epoch (20 optimizer steps), max_length 64 (no dev
prompt is longer than 61 tokens), 2 seeds, ε ∈ {3, 8}, arms zero-shot, DP tied/untied and DP LoRA tied/untied (17
runs, about 150-200 s each on 2 shared cores; ``--seeds 0 1 2`` and ``--arms`` for more). At
this scale DP-SGD cannot be expected to move the model far from its starting point (the privacy noise scales with
1/(N·ε)); ``--full`` is the paper-sized study, for a GPU, with every arm.

Speed measures that change nothing in the maths: each arm runs with 1 torch thread (OMP_NUM_THREADS too); the GGUF
checkpoint is dequantised once into a float32 folder (``--no-cache`` to load the GGUF in every arm); dev.tsv is
validated from a length-sorted copy (``--no-sort-dev`` for the file's order), which halves padding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make this checkout's `benchmarks` win over opacus' top-level one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.study import sst2  # noqa: E402
from benchmarks.study.arm import install_stop_handlers, run_all  # noqa: E402
from benchmarks.study.record import (  # noqa: E402
    ROOT, git_info, machine_info, machine_line, mean_std, plus_minus, relative, write_json,
)

TIED, UNTIED, LORA = (f"configs/smollm2_sst2_{name}.yaml" for name in ("tied", "untied", "lora"))


@dataclass(frozen=True)
class Arm:
    """One arm of the study: a shipped config and the overrides that make it this arm."""

    label: str
    config: str
    private: bool = True
    trains: bool = True
    lora: bool = False
    overrides: tuple[str, ...] = ()


ARMS: dict[str, Arm] = {
    "zero_shot": Arm("zero-shot", TIED, private=False, trains=False),
    "non_private": Arm("non-private", TIED, private=False),
    "dp_tied": Arm("DP tied", TIED),
    "dp_untied": Arm("DP untied", UNTIED),
    "lora_tied": Arm("DP LoRA + tied emb.", LORA, lora=True),
    "lora_untied": Arm("DP LoRA + untied emb.", LORA, lora=True,
                       overrides=("--model.embeddings", "dplit.embeddings.UntiedEmbeddings")),
    "lora_frozen": Arm("DP LoRA, emb. frozen", LORA, lora=True, overrides=("--model.train_embeddings", "false")),
}
PAIRS = (("full fine-tuning", "dp_untied", "dp_tied"), ("LoRA + trained embedding", "lora_untied", "lora_tied"))
"""The untied − tied comparisons the table pairs by seed: (name, untied arm, tied arm)."""
COLORS = {"zero_shot": "#999999", "non_private": "#4c72b0", "dp_tied": "#dd8452", "dp_untied": "#55a868",
          "lora_tied": "#c44e52", "lora_untied": "#8172b3", "lora_frozen": "#937860"}

GIT_PATHS = ("dplit", "configs", "benchmarks/tying.py", "benchmarks/study")
"""What the study's numbers depend on: uncommitted changes there are recorded."""

PROFILES: dict[str, dict[str, Any]] = {
    # 2 shared CPU cores, 1 torch thread, measured per arm: ~10 s start-up, ~1 s to load the dequantised checkpoint,
    # ~72 s to validate the 872 dev rows (sorted by length, batches of 32), ~3.3 s per DP step at B = 8 (~2.8 s
    # non-private; the first DP step adds ~10 s for DPStrategy's ghost-clipping self-check); LoRA arms ~3 s per step.
    "default": {
        "train_examples": 160, "epochs": 1, "batch_size": 8, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 64,
        "eval_batch_size": 32, "max_grad_norm": 0.1, "physical_batch_size": 16, "epsilons": [3.0, 8.0],
        "seeds": [0, 1], "eval_examples": None, "accelerator": "cpu", "precision": "32-true", "timeout": 1200.0,
        "threads": 1, "arms": ["zero_shot", "dp_tied", "dp_untied", "lora_tied", "lora_untied"],
    },
    "smoke": {
        "train_examples": 32, "epochs": 1, "batch_size": 8, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 64,
        "eval_batch_size": 32, "max_grad_norm": 0.1, "physical_batch_size": 8, "epsilons": [8.0], "seeds": [0],
        "eval_examples": 64, "accelerator": "cpu", "precision": "32-true", "timeout": 600.0, "threads": 1,
        "arms": list(ARMS),
    },
    # Li et al. 2021's SST-2 recipe (the shipped configs' values): meant for a GPU.
    "full": {
        "train_examples": None, "epochs": 3, "batch_size": 1000, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 128,
        "eval_batch_size": 128, "max_grad_norm": 0.1, "physical_batch_size": 64, "epsilons": [3.0, 8.0],
        "seeds": [0, 1, 2], "eval_examples": None, "accelerator": "auto", "precision": "bf16-mixed",
        "timeout": 6 * 3600.0, "threads": 0, "arms": list(ARMS),
    },
}


# --------------------------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tying", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--smoke", action="store_true", help="quick check: 32 train rows, 1 seed, ε=8, 64 dev rows")
    profile.add_argument("--full", action="store_true",
                         help="the paper's recipe: whole train set, B=1000, 3 epochs, lr 5e-4, C=0.1, max_length 128, "
                              "bf16-mixed on the best accelerator (a GPU)")
    parser.add_argument("--epsilons", nargs="+", type=float, help="target ε of the DP arms (default 3 8)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (seed_everything; default: the profile's, 0 1 by default, 0 1 2 with --full)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="arms to run (default: the profile's)")
    parser.add_argument("--train-examples", type=int, help="first N rows of SST-2 train (0: all 67,349)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="expected logical batch (Poisson rate q = B/N under DP)")
    parser.add_argument("--lr", type=float, help="AdamW peak learning rate of full fine-tuning (linear decay to 0)")
    parser.add_argument("--lora-lr", type=float, help="AdamW peak learning rate of the LoRA arms (default 2e-3)")
    parser.add_argument("--max-length", type=int, help="longest prompt in tokens (SST-2 dev: 61 with SmolLM2's tokenizer)")
    parser.add_argument("--eval-batch-size", type=int)
    parser.add_argument("--eval-examples", type=int, help="first N dev rows (default: all 872)")
    parser.add_argument("--max-grad-norm", type=float, help="DP clipping bound C")
    parser.add_argument("--physical-batch-size", type=int, help="DPStrategy.max_physical_batch_size")
    parser.add_argument("--accelerator", help="trainer.accelerator (default cpu; auto with --full)")
    parser.add_argument("--precision", help="trainer.precision (default 32-true; bf16-mixed with --full)")
    parser.add_argument("--timeout", type=float, help="seconds per arm before it is killed and reported as failed")
    parser.add_argument("--threads", type=int,
                        help="torch threads per arm (default 1 on CPU: steadier on a shared 2-core machine, where a "
                             "2-thread process stalls whenever another process holds a core; 0: torch's default)")
    sst2.add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default benchmarks/results/tying, .../tying/full with --full, "
                             "benchmarks/out/tying/smoke/results with --smoke)")
    parser.add_argument("--logs", type=Path, default=None, help="logs folder (default benchmarks/out/tying, ignored)")
    parser.add_argument("--dry-run", action="store_true", help="print each arm's dplit command and exit")
    args = parser.parse_args(argv)
    name = "smoke" if args.smoke else "full" if args.full else "default"
    args.profile = name
    for key, value in PROFILES[name].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.train_examples == 0:
        args.train_examples = None
    args.logs = args.logs or ROOT / "benchmarks" / "out" / "tying" / name  # git-ignored
    default_out = {"default": ROOT / "benchmarks" / "results" / "tying", "full": ROOT / "benchmarks" / "results" / "tying" /
                   "full", "smoke": args.logs / "results"}[name]  # a smoke check's results stay out of git
    args.out = args.out or default_out
    for key in ("epochs", "batch_size", "max_length", "eval_batch_size", "physical_batch_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be ≥ 1")
    if args.train_examples is not None and args.batch_size > args.train_examples:
        parser.error(f"--batch-size {args.batch_size} exceeds --train-examples {args.train_examples}")
    return args




# --------------------------------------------------------------------------------------------------------------------
# The arms


def arm_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (arm, ε, seed) to run, zero-shot first (it does not depend on the seed: run once)."""
    runs: list[dict[str, Any]] = []
    if "zero_shot" in args.arms:
        runs.append({"arm": "zero_shot", "epsilon": None, "seed": args.seeds[0]})
    for seed in args.seeds:
        if "non_private" in args.arms:
            runs.append({"arm": "non_private", "epsilon": None, "seed": seed})
        for epsilon in args.epsilons:
            runs += [{"arm": arm, "epsilon": epsilon, "seed": seed} for arm in ARMS if ARMS[arm].private
                     and arm in args.arms]
    return [{**run, "name": run_name(run)} for run in runs]


def run_name(run: dict[str, Any]) -> str:
    eps = f"-eps{run['epsilon']:g}" if run["epsilon"] is not None else ""
    return f"{run['arm']}{eps}-seed{run['seed']}" if run["arm"] != "zero_shot" else "zero_shot"


def dplit_args(args: argparse.Namespace, sources: dict[str, Any], run: dict[str, Any], log_dir: Path) -> list[str]:
    """The ``dplit`` command line of one arm: its shipped SmolLM2 SST-2 config plus the study's overrides."""
    arm = ARMS[run["arm"]]
    command = ["fit" if arm.trains else "validate", "--config", arm.config, *sst2.source_overrides(sources)]
    callbacks = [{"class_path": "dplit.callbacks.ResourceMonitor"}, {"class_path": "benchmarks.study.arm.StepTimer"}]
    command += [
        "--seed_everything", str(run["seed"]),
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.precision", args.precision,
        "--trainer.max_epochs", str(args.epochs),
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
        # validation once, after training (the child calls trainer.validate), so the fit time is training only
        "--trainer.val_check_interval", "1.0", "--trainer.check_val_every_n_epoch", str(10**6),
        "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(log_dir),
        "--trainer.callbacks", json.dumps(callbacks),
        "--model.lr", repr(args.lora_lr if arm.lora else args.lr),
        "--data.batch_size", str(args.batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
        "--data.max_length", str(args.max_length), "--data.label_words", json.dumps(sst2.LABEL_WORDS),
        "--data.template", sst2.TEMPLATE, *arm.overrides,
    ]
    if args.train_examples is not None:
        command += ["--data.max_train_examples", str(args.train_examples)]
    if not arm.private:
        return command + ["--trainer.strategy", "auto", "--non_private", "true"]
    prefix = "--trainer.strategy.init_args."
    return command + [
        prefix + "target_epsilon", repr(float(run["epsilon"])), prefix + "max_grad_norm", repr(args.max_grad_norm),
        prefix + "clipping", "ghost", prefix + "max_physical_batch_size", str(args.physical_batch_size),
    ]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (arm, ε): accuracy mean ± std over seeds, ε spent, memory, step time; untied − tied paired by seed."""
    ok = [r for r in rows if r.get("status") == "ok"]
    arms: list[dict[str, Any]] = []
    keys = []
    for r in rows:
        key = (r["arm"], r["epsilon"])
        if key not in keys:
            keys.append(key)
    for arm, epsilon in keys:
        group = [r for r in ok if r["arm"] == arm and r["epsilon"] == epsilon]
        failed = [r for r in rows if r["arm"] == arm and r["epsilon"] == epsilon and r.get("status") != "ok"]
        arms.append({
            "arm": arm, "target_epsilon": epsilon, "seeds": [r["seed"] for r in group], "failed": len(failed),
            "val_acc": mean_std([r["val_acc"] for r in group]),
            "epsilon_spent": mean_std([r.get("epsilon_spent") for r in group]),
            "steps": mean_std([r.get("steps") for r in group]),
            "peak_rss_mb": mean_std([r.get("peak_rss_mb") for r in group]),
            "train_peak_mb": mean_std([r.get("train_peak_mb") for r in group]),
            "step_time_s": mean_std([r.get("step_time_s") for r in group]),
            "noise_multiplier": mean_std([r.get("noise_multiplier") for r in group]),
        })
    return {"arms": arms, "untied_minus_tied": [difference for pair in PAIRS for difference in paired(ok, *pair)]}


def paired(ok: list[dict[str, Any]], name: str, untied_arm: str, tied_arm: str) -> list[dict[str, Any]]:
    """Per ε: untied − tied validation accuracy of the seeds both arms finished."""
    differences = []
    for epsilon in sorted({r["epsilon"] for r in ok if r["arm"] in (untied_arm, tied_arm)}):
        tied = {r["seed"]: r for r in ok if r["arm"] == tied_arm and r["epsilon"] == epsilon}
        untied = {r["seed"]: r for r in ok if r["arm"] == untied_arm and r["epsilon"] == epsilon}
        seeds = sorted(set(tied) & set(untied))
        if not seeds:
            continue
        diffs = [untied[s]["val_acc"] - tied[s]["val_acc"] for s in seeds]
        differences.append({"comparison": name, "target_epsilon": epsilon, "seeds": seeds,
                            "untied_minus_tied": mean_std(diffs), "per_seed": dict(zip(map(str, seeds), diffs))})
    return differences


# --------------------------------------------------------------------------------------------------------------------
# Table and chart


def _arm_label(arm: str, epsilon: float | None) -> str:
    return ARMS[arm].label + (f", ε = {epsilon:g}" if epsilon is not None else "")


def render_table(results: dict[str, Any]) -> str:
    s, subset = results["settings"], results["training_subset"]
    lines = [
        "# Tied vs untied embeddings under DP-SGD: SmolLM2-135M-Instruct on SST-2",
        "",
        (f"Profile `{s['profile']}`: {subset['rule']} (positive share {subset.get('positive_share', float('nan')):.2f}), "
        f"validation on {subset['dev_rule']} ({subset['dev_rows']} rows); expected batch {s['batch_size']}, "
        f"{s['epochs']} epoch(s), AdamW lr {s['lr']:g} (LoRA arms {s.get('lora_lr', 2e-3):g}) with linear decay, max_length {s['max_length']}, "
        f"label words {json.dumps(list(sst2.LABEL_WORDS.values()))}, seeds {s['seeds']}; DP: ghost clipping, "
        f"C = {s['max_grad_norm']:g}, σ calibrated by `target_epsilon` over the planned steps, δ = N^-1.1, PRV "
        f"accountant; {s['precision']} on {s['accelerator']}, {s['threads'] or 'default'} torch thread(s) per arm. "
        f"Model: {sst2.model_line(results['sources'])}. Validation order: {subset.get('dev_order')}."),
        "",
        machine_line(results) + f". Wall time of the whole study: {results['wall_s'] / 60:.1f} min.",
        "",
        "| arm | ε spent | val acc % (mean ± std) | seeds | steps | σ | step time s | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in results["summary"]["arms"]:
        eps = a["epsilon_spent"]
        if a["arm"] == "non_private":
            eps_text = "∞"
        elif a["arm"] == "zero_shot":
            eps_text = "0 (no training)"
        else:
            eps_text = plus_minus(eps, digits=2)
        lines.append(
            f"| {_arm_label(a['arm'], a['target_epsilon'])} | {eps_text} | {plus_minus(a['val_acc'], 100)} | "
            f"{a['val_acc']['n']}" + (f" (+{a['failed']} failed)" if a["failed"] else "") + " | "
            f"{plus_minus(a['steps'], digits=0)} | {plus_minus(a['noise_multiplier'], digits=3)} | {plus_minus(a['step_time_s'], digits=2)} | "
            f"{plus_minus(a['peak_rss_mb'], digits=0)} |"
        )
    lines += ["", "Untied − tied validation accuracy, paired by seed (percentage points):", "",
              "| comparison | target ε | untied − tied (mean ± std) | per seed |", "|---|---:|---:|---|"]
    for d in results["summary"]["untied_minus_tied"]:
        per_seed = ", ".join(f"seed {k}: {v * 100:+.1f}" for k, v in d["per_seed"].items())
        lines.append(f"| {d.get('comparison', 'full fine-tuning')} | {d['target_epsilon']:g} | "
                     f"{plus_minus(d['untied_minus_tied'], 100)} (n = {d['untied_minus_tied']['n']}) | {per_seed} |")
    lines += [
        "",
        ("Step time: mean wall time of one optimizer step (batch start to batch end, DP clipping, noise and AdamW "
        "included), from a timing callback. Peak RSS: the arm's whole process (model loading, training and "
        "validation), `resource.getrusage`. ε spent: the DPStrategy accountant's `epsilon()` after training. "
        "std: sample standard deviation over seeds. Each arm ran in its own process; the machine may have been "
        "shared with other work (see `load_avg_*` in results.json), so times are indicative."),
        "",
        "Every run:",
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
    lines += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def render_chart(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')", flush=True)
        return False
    arms = [a for a in results["summary"]["arms"] if a["val_acc"]["mean"] is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(arms) + 2), 4.5))
    for i, a in enumerate(arms):
        stats = a["val_acc"]
        ax.bar(i, stats["mean"] * 100, yerr=(stats["std"] or 0) * 100, capsize=4, color=COLORS[a["arm"]],
               edgecolor="black", linewidth=0.5)
        ax.scatter([i] * len(stats["values"]), [v * 100 for v in stats["values"]], color="black", s=10, zorder=3)
        ax.text(i, stats["mean"] * 100 + (stats["std"] or 0) * 100 + 0.8, f"{stats['mean'] * 100:.1f}",
                ha="center", fontsize=8)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels([_arm_label(a["arm"], a["target_epsilon"]).replace(", ", "\n") for a in arms], fontsize=8)
    ax.axhline(50, color="grey", linestyle=":", linewidth=0.8)
    values = [v * 100 for a in arms for v in a["val_acc"]["values"]]
    ax.set_ylim(max(0, min(values + [50]) - 10), min(100, max(values) + 8))
    s = results["settings"]
    subset = results["training_subset"]
    ax.set_ylabel(f"SST-2 dev accuracy % ({subset['dev_rows']} rows)")
    ax.set_title(f"SmolLM2-135M-Instruct, SST-2: {subset['rows'] or 'all'} train rows, B={s['batch_size']}, "
                 f"{s['epochs']} ep, lr {s['lr']:g}\nmean ± std over seeds {s['seeds']} (dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(results: dict[str, Any], out: Path) -> None:
    results["summary"] = summarize(results["runs"])
    write_json(results, out / "results.json")
    (out / "table.md").write_text(render_table(results))
    render_chart(results, out / "chart.png")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    install_stop_handlers()
    sources = sst2.prepare(args)
    runs = arm_runs(args)
    if args.dry_run:
        print("# (dry run: without the dequantised checkpoint folder and the sorted dev copy a real run prepares)")
        for run in runs:
            print(f"# {run['name']}\ndplit {shlex.join(dplit_args(args, sources, run, args.logs / run['name']))}")
        return
    results: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.tying " + shlex.join(argv),
        "machine": machine_info(),
        "git": git_info(*GIT_PATHS),
        "sources": {k: (str(v) if isinstance(v, Path) else v) for k, v in sources.items()},
        "settings": {k: getattr(args, k) for k in (
            "profile", "arms", "epsilons", "seeds", "train_examples", "epochs", "batch_size", "lr", "lora_lr", "max_length",
            "eval_batch_size", "eval_examples", "max_grad_norm", "physical_batch_size", "accelerator", "precision",
            "timeout", "threads", "no_cache", "no_sort_dev")} | {"label_words": sst2.LABEL_WORDS,
                                                    "configs": {name: arm.config for name, arm in ARMS.items()}},
        "training_subset": sst2.subset_description(args, sources),
        "runs": [],
        "wall_s": 0.0,
        "complete": False,
    }
    print(f"{len(runs)} runs; profile {args.profile}; {results['training_subset']['rule']}; out {relative(args.out)}",
          flush=True)
    run_all(runs, results, command=lambda run, folder: dplit_args(args, sources, run, folder), logs=args.logs,
            threads=args.threads, timeout=args.timeout, write=lambda done: write_outputs(done, args.out),
            git_paths=GIT_PATHS)
    print((args.out / "table.md").read_text())
    print(f"wrote {relative(args.out / 'results.json')}, table.md, chart.png in {results['wall_s'] / 60:.1f} min",
          flush=True)


if __name__ == "__main__":
    main()
