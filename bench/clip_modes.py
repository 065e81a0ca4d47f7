"""Fixed C vs private quantile clipping vs automatic clipping on real SST-2 with SmolLM2-135M-Instruct (issue 37).

Run (CPU, about 10 minutes per run and two runs at once on 2 cores; the GGUF checkpoint and SST-2 TSVs from
``$DPLIT_DATA_DIR`` or /work/shared/data)::

    python -m bench.clip_modes                 # 5 seeds x 5 arms; resumes: finished runs are kept
    python -m bench.clip_modes --seeds 0 1     # fewer seeds

Every arm trains the untied SmolLM2 config (``configs/smollm2_sst2_untied.yaml``, with the tying study's CPU
settings: full fine-tuning, float32, 1 epoch, AdamW at one learning rate) on the first ``--train-rows`` SST-2 train
rows at the same target ε, and validates on the first ``--eval-examples`` dev rows. The arms differ only in the
clipping: ``fixed`` at C in ``--fixed-bounds``, ``quantile`` (γ = 0.5 from C_0 = 1, η and σ_b at their defaults) and
``automatic`` (C = 1, γ_stability at its default). Runs are paired by seed: a seed fixes the initialisation, the data
order, the Poisson batches and the noise's seed for every arm. The paired statistics compare each adaptive mode with
each fixed C. With AdamW the update does not scale with the gradient's size, so one learning rate serves every arm.
Results: ``--out``/results.json and table.md (default bench/results/clip_modes/), naming the machine; each run's row
names the commit and machine it ran on (:func:`bench.study.record.run_stamp`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path
from typing import Any

from bench.study import sst2
from bench.study.arm import install_stop_handlers, run_all
from bench.study.paired import PAIRED_COLUMNS, accuracies, paired_row, paired_runs, unpaired_note
from bench.study.record import copy_ledger_facts, git_info, machine_info, machine_line, mean_std, run_stamp, write_json
from bench.study.resume import (
    add_seed_arguments,
    earlier_sitting,
    input_fingerprint,
    planned_runs,
    render,
    study_settings,
    unchanged_inputs,
)
from bench.tying.arms import dplit_args

STRATEGY = "--trainer.strategy.init_args."
ADAPTIVE = ("quantile", "automatic")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The study's arguments (defaults: the tying study's CPU settings, 1000 train rows, 256 dev rows, ε = 8)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.clip_modes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--fixed-bounds", type=float, nargs="+", default=[0.01, 0.1, 1.0], help="C of the fixed arms")
    sst2.add_study_arguments(parser, name="clip_modes", train_rows=1000, timeout=2400.0)
    add_seed_arguments(parser)
    sst2.add_source_arguments(parser)
    args = parser.parse_args(argv)
    args.accelerator, args.precision, args.lora_lr, args.max_grad_norm = "cpu", "32-true", args.lr, 1.0
    return args


def arm_flags(args: argparse.Namespace) -> dict[str, tuple[float, list[str]]]:
    """Each arm's name, its C (C_0 of quantile, the scale of automatic) and its clipping flags."""
    arms = {f"fixed_C{bound:g}": (bound, [STRATEGY + "clip_mode", "fixed"]) for bound in args.fixed_bounds}
    arms["quantile"] = (1.0, [STRATEGY + "clip_mode", "quantile", STRATEGY + "target_quantile", "0.5"])
    arms["automatic"] = (1.0, [STRATEGY + "clip_mode", "automatic"])
    return arms


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every (seed, arm) not yet in results.json, seed by seed; write results.json and table.md."""
    args = parse_args(argv)
    if args.render:
        return render(args.out, table)
    install_stop_handlers()
    sources = sst2.prepare(args)
    arms = arm_flags(args)

    def command(run: dict[str, Any], log_dir: Path) -> list[str]:
        bound, flags = arms[run["arm"]]
        arm_args = copy.copy(args)
        arm_args.max_grad_norm = bound
        spec = {
            "arm": "dp_untied",
            "seed": run["seed"],
            "dp_seed": run["seed"],
            "epsilon": args.epsilon,
            "rows": args.train_rows,
        }
        return dplit_args(arm_args, sources, spec, log_dir) + flags

    out = args.out / "results.json"
    settings = study_settings(args)
    previous, kept = earlier_sitting(args.out, settings)
    inputs = input_fingerprint(sst2.input_files(sources))
    kept = kept if args.dry_run else unchanged_inputs(kept, inputs)
    git, machine = git_info("dplit", "configs", "bench"), machine_info(args.threads)
    fields = {arm: {"max_grad_norm": bound} for arm, (bound, _) in arms.items()}
    runs = planned_runs(args.seeds, fields, {row["name"] for row in kept}, run_stamp(machine, git, inputs))
    if args.dry_run:
        for run in runs:
            print(" ".join(["dplit", *command(run, args.logs / run["name"])]))
        return {}
    results: dict[str, Any] = {
        "command": "python -m bench.clip_modes",
        "settings": settings,
        "machine": machine,
        "git": git,
        "model": sst2.model_line(sources),
        "runs": kept,
        "wall_s": previous.get("wall_s", 0.0),
    }
    run_all(
        runs,
        results,
        command=command,
        logs=args.logs,
        threads=args.threads,
        timeout=args.timeout,
        write=lambda data: write_json(add_ledger_facts(data), out),
        jobs=args.jobs,
    )
    write_json(add_ledger_facts(results), out)
    (args.out / "table.md").write_text(table(results))
    print(table(results))
    return results


def add_ledger_facts(results: dict[str, Any]) -> dict[str, Any]:
    """Copy each run's clipping facts (mode, final C_t, σ_eff) from its privacy ledger into its row."""
    fields = ("clip_mode", "clip_bound", "gradient_noise_multiplier", "count_noise_multiplier", "automatic_stability")
    return copy_ledger_facts(results, "clip", fields)


def arm_order(arm: str) -> tuple[int, float]:
    """Fixed arms by their C, then quantile, then automatic."""
    if arm.startswith("fixed_C"):
        return 0, float(arm.removeprefix("fixed_C"))
    return 1 + ADAPTIVE.index(arm), 0.0


def table(results: dict[str, Any]) -> str:
    """The study's markdown: one row per arm, then each adaptive mode paired against each fixed C.

    Every number is taken over the seeds every arm finished (:func:`bench.study.paired.paired_runs`); the table names
    the finished runs it leaves out.
    """
    rows, unpaired = paired_runs(results["runs"])
    by_arm = accuracies(rows)
    lines = [
        "| arm | seeds | dev acc (mean ± sd) | ε | σ (σ_eff) | final C_t | steps | step time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, accs in sorted(by_arm.items(), key=lambda item: arm_order(item[0])):
        mine = [r for r in rows if r["arm"] == arm]
        clip = [r.get("clip") or {} for r in mine]
        sigma = f"{statistics.fmean(r['noise_multiplier'] for r in mine):.3f}"
        if clip[0].get("gradient_noise_multiplier"):
            sigma += f" ({statistics.fmean(c['gradient_noise_multiplier'] for c in clip):.3f})"
        bounds = [c["clip_bound"] for c in clip if c.get("clip_bound") is not None]
        lines.append(
            f"| {arm} | {len(accs)} | {mean_std(list(accs.values()))['mean']:.1f} ± "
            f"{mean_std(list(accs.values()))['std'] or 0:.1f}% | "
            f"{statistics.fmean(r['epsilon_spent'] for r in mine):.2f} | {sigma} | "
            f"{f'{min(bounds):.3g}–{max(bounds):.3g}' if bounds else '–'} | "
            f"{statistics.fmean(r['steps'] for r in mine):.0f} | "
            f"{statistics.fmean(r['step_time_median_s'] for r in mine):.2f} |"
        )
    pairs = [
        "| adaptive − fixed " + PAIRED_COLUMNS,
        "|---|---|---|---|---|",
    ]
    for mode in (m for m in ADAPTIVE if m in by_arm):
        for fixed in sorted((a for a in by_arm if a.startswith("fixed")), key=arm_order):
            pairs.append(paired_row(f"{mode} − {fixed}", by_arm[mode], by_arm[fixed]))
    s = results["settings"]
    return "\n".join(
        [
            f"# Clipping modes on SST-2, SmolLM2-135M-Instruct (`{results['command']}`)",
            "",
            f"Model: {results['model']}; untied embeddings, full fine-tuning, {s['epochs']} epoch, float32 on the CPU, "
            f"AdamW lr {s['lr']}, expected batch {s['batch_size']} (Poisson), target ε = {s['epsilon']}. Data: the first "
            f"{s['train_rows']} SST-2 train rows; dev: the first {s['eval_examples']} dev rows. Quantile: γ = 0.5 from "
            "C_0 = 1, η = 0.2, σ_b = expected batch / 20 (defaults); automatic: C = 1, stability 0.01 (default). A seed "
            "fixes initialisation, data order, batches and noise seed for every arm. Step time: median wall seconds, "
            "1 torch thread, two runs at once.",
            "",
            *lines,
            "",
            *pairs,
            "",
            *unpaired_note(unpaired),
            machine_line(results) + ".",
            "",
        ]
    )


if __name__ == "__main__":
    main()
