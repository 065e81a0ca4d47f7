"""Example-level vs user-level DP-SGD on real SST-2 with SmolLM2-135M-Instruct (issue 36's "Show it" row).

Run (CPU, ~10 min a seed on 2 shared cores; the GGUF and SST-2 TSVs from ``$DPLIT_DATA_DIR`` or /work/shared/data)::

    python -m bench.user_level                 # 5 seeds x 2 arms; resumes: finished runs are kept
    python -m bench.user_level --seeds 0 1 2   # fewer seeds; --render: only re-render table.md

The first ``--train-rows`` rows of SST-2 train.tsv go, with an extra ``user`` column, to a copy of train.tsv: rows are
given to seeded synthetic users of 1..``--most-rows`` consecutive rows (``synthetic_users(n, seed=0, most_rows=20)``).
The dev copy is bench.study's (the first ``--eval-examples`` dev rows sorted by length, otherwise unchanged). Two arms
train the untied SmolLM2 config (``configs/smollm2_sst2_untied.yaml``, with the tying study's CPU settings) at the
same target ε: example-level DP with an expected batch of ``--batch-size`` rows, and user-level DP with
``max_rows_per_user`` = ``--k`` and an expected number of users per batch chosen so the expected rows per step are
comparable (``--batch-size`` / mean over users of min(rows, k), rounded). Runs are paired by seed: a seed fixes the
initialisation, the data order, the Poisson batches and the noise's seed (``DPStrategy(seed=...)``) of both arms (the
synthetic users are the same for every seed). The table gives each arm's mean ± sd over seeds and the paired
difference user − example (mean, paired-t 95% interval, sign test: :mod:`bench.study.paired`). A rerun with the same
settings keeps the finished runs in results.json (:mod:`bench.study.resume`); the first sitting's two runs (seed 0,
named ``example``/``user``) are read as ``example_seed0``/``user_seed0``.
Results: ``--out``/results.json and table.md (default bench/results/user_level/); each run's row names its commit
and machine (:func:`bench.study.record.run_stamp`), and the table lists every commit and machine of its runs.
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
from bench.study.record import (
    copy_ledger_facts,
    git_info,
    machine_info,
    machine_line,
    mean_std,
    plus_minus,
    run_stamp,
    write_json,
)
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
from dplit.data.users import synthetic_users


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The study's arguments (defaults: the tying study's CPU settings, 1024 train rows, 256 dev rows, ε = 8)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.user_level", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    sst2.add_study_arguments(parser, name="user_level", train_rows=1024, timeout=1800.0)
    add("--most-rows", type=int, default=20, help="synthetic users own 1..N consecutive rows")
    add("--k", type=int, default=4, help="data.max_rows_per_user of the user-level arm")
    add("--max-grad-norm", type=float, default=0.1)
    add_seed_arguments(parser)
    sst2.add_source_arguments(parser)
    args = parser.parse_args(argv)
    args.accelerator, args.precision, args.lora_lr = "cpu", "32-true", args.lr
    return args


def write_user_tsv(source: Path, target: Path, rows: int, *, most_rows: int, seed: int = 0) -> list[str]:
    """Copy the first ``rows`` rows of ``source`` (a GLUE TSV) to ``target`` with a ``user`` column; the users."""
    lines = source.read_text(encoding="utf-8-sig").splitlines()
    body = [line for line in lines[1:] if line.strip()][:rows]
    users = synthetic_users(len(body), seed=seed, most_rows=most_rows)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{line}\t{user}\n" for line, user in zip([lines[0], *body], ["user", *users], strict=True))
    target.write_text(text, encoding="utf-8")
    return users


def user_batch(users: list[str], rows_per_batch: int, k: int) -> tuple[int, float]:
    """Expected users per batch giving about ``rows_per_batch`` rows per step, and the mean rows a sampled user brings."""
    sizes = [users.count(user) for user in dict.fromkeys(users)]
    per_user = statistics.fmean(min(size, k) for size in sizes)
    return max(1, round(rows_per_batch / per_user)), per_user


def migrate(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with the first sitting's runs (one seed, named by arm alone) named and keyed by arm and seed."""
    runs = []
    for row in results.get("runs", []):
        if "seed" not in row:
            (seed,) = results["seeds"]
            row = {**row, "name": f"{row['name']}_seed{seed}", "arm": row["name"], "seed": seed}
        row.setdefault("git", results["git"]["describe"])
        runs.append(row)
    return {**results, "runs": runs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Prepare the model and the user-column copy of SST-2, run every (seed, arm) not yet recorded, write the results."""
    args = parse_args(argv)
    if args.render:
        return render(args.out, table)
    settings = study_settings(args)
    previous, kept = earlier_sitting(args.out, settings, migrate)
    install_stop_handlers()
    sources = sst2.prepare(args)
    if sources["data_dir"] is None:
        raise SystemExit("user-level DP needs SST-2 as local TSV files: set $DPLIT_DATA_DIR, --data-root or --data-dir")
    folder = args.logs / "data" / "sst2-users"
    original = Path(sources.get("original_data_dir") or sources["data_dir"])
    users = write_user_tsv(original / "train.tsv", folder / "train.tsv", args.train_rows, most_rows=args.most_rows)
    (folder / "dev.tsv").write_text((Path(sources["data_dir"]) / "dev.tsv").read_text(encoding="utf-8"), "utf-8")
    sources = {**sources, "data_dir": str(folder.resolve())}
    users_per_batch, rows_per_user = user_batch(users, args.batch_size, args.k)
    sizes = [users.count(user) for user in dict.fromkeys(users)]
    user_flags = ["--data.privacy_unit", "user", "--data.user_column", "user", "--data.max_rows_per_user", str(args.k)]
    arms = {"example": (args.batch_size, []), "user": (users_per_batch, user_flags)}

    def command(run: dict[str, Any], log_dir: Path) -> list[str]:
        batch, extra = arms[run["arm"]]
        arm_args = copy.copy(args)
        arm_args.batch_size = batch
        spec = {"arm": "dp_untied", "seed": run["seed"], "dp_seed": run["seed"], "epsilon": args.epsilon, "rows": None}
        return dplit_args(arm_args, sources, spec, log_dir) + extra

    inputs = input_fingerprint(sst2.input_files(sources))
    kept = kept if args.dry_run else unchanged_inputs(kept, inputs)
    git, machine = git_info("dplit", "configs", "bench"), machine_info(args.threads)
    fields = {name: {"privacy_unit": name, "batch_size": batch} for name, (batch, _) in arms.items()}
    runs = planned_runs(args.seeds, fields, {r["name"] for r in kept}, run_stamp(machine, git, inputs))
    if args.dry_run:
        for run in runs:
            print(" ".join(["dplit", *command(run, args.logs / run["name"])]))
        return {}
    results: dict[str, Any] = {
        "command": "python -m bench.user_level",
        "settings": settings,
        "machine": machine,
        "git": git,
        "model": sst2.model_line(sources),
        "train_rows": len(users),
        "dev_rows": args.eval_examples,
        "users": len(sizes),
        "largest_user_rows": max(sizes),
        "k": args.k,
        "mean_rows_per_sampled_user": rows_per_user,
        "expected_users_per_batch": users_per_batch,
        "runs": kept,
        "wall_s": previous.get("wall_s", 0.0),
    }
    out = args.out / "results.json"
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
    """Copy each run's privacy unit facts from its privacy ledger into its row; the seeds of the finished runs."""
    fields = ("privacy_unit", "users", "dataset_size", "max_rows_per_user", "largest_user_rows")
    copy_ledger_facts(results, "ledger_unit", fields)
    results["seeds"] = sorted({row["seed"] for row in results["runs"] if row.get("status") == "ok"})
    return results


NOT_RECORDED = "machine not recorded"
"""What the table says for the machine of a run recorded before rows named their machine."""


def seeds_by(rows: list[dict[str, Any]], key: str, missing: str) -> dict[str, list[int]]:
    """The seeds of ``rows`` by their value of ``key`` (``missing`` where a row has none), in the rows' order."""
    groups: dict[str, set[int]] = {}
    for row in rows:
        groups.setdefault(row.get(key) or missing, set()).add(row["seed"])
    return {value: sorted(seeds) for value, seeds in groups.items()}


def table(results: dict[str, Any]) -> str:
    """The study's markdown: one row per arm (mean ± sd over seeds), the paired difference, the commits and machines.

    Every number is taken over the seeds both arms finished (:func:`bench.study.paired.paired_runs`); the table names
    the finished runs it leaves out. The footer names every commit and machine of the runs it tabulates
    (:data:`NOT_RECORDED` for rows recorded before rows named their machine), and the last sitting's.
    """
    results = migrate(results)
    ok, unpaired = paired_runs(results["runs"])
    by_arm = accuracies(ok)
    lines = [
        "| privacy unit | seeds | expected batch | dev acc (mean ± sd) | ε (δ) | σ | steps | step time (s) | "
        "rows per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in (a for a in ("example", "user") if a in by_arm):
        mine = [row for row in ok if row["arm"] == arm]
        deltas = sorted({f"{row['delta']:.1e}" for row in mine})
        lines.append(
            f"| {arm} | {len(mine)} | {mine[0]['batch_size']} {'users' if arm == 'user' else 'rows'} | "
            f"{plus_minus(mean_std(list(by_arm[arm].values())))}% | "
            f"{statistics.fmean(r['epsilon_spent'] for r in mine):.2f} ({', '.join(deltas)}) | "
            f"{statistics.fmean(r['noise_multiplier'] for r in mine):.3f} | "
            f"{statistics.fmean(r['steps'] for r in mine):.0f} | "
            f"{statistics.median(r['step_time_median_s'] for r in mine):.2f} | "
            f"{statistics.fmean(statistics.fmean(r['step_batch_sizes'] or [0]) for r in mine):.1f} |"
        )
    pairs = ["| paired difference " + PAIRED_COLUMNS, "|---|---|---|---|---|"]
    if {"user", "example"} <= set(by_arm):
        pairs.append(paired_row("user − example", by_arm["user"], by_arm["example"]))
    failed = [f"{row['name']} ({row.get('message', '')[:120]})" for row in results["runs"] if row.get("status") != "ok"]
    commits = "; ".join(f"seeds {seeds} at `{git}`" for git, seeds in seeds_by(ok, "git", "").items())
    machines = [f"- seeds {seeds}: {machine}" for machine, seeds in seeds_by(ok, "machine", NOT_RECORDED).items()]
    s = results["settings"]
    return "\n".join(
        [
            f"# Example-level vs user-level DP-SGD, SST-2, SmolLM2-135M-Instruct (`{results['command']}`)",
            "",
            f"Model: {results['model']}; untied embeddings, full fine-tuning, 1 epoch, float32 on the CPU, C = "
            f"{s['max_grad_norm']}, lr {s['lr']}, target ε = {s['epsilon']}. Data: the first {results['train_rows']} "
            f"SST-2 train rows, given to {results['users']} seeded synthetic users of 1–{s['most_rows']} consecutive "
            f"rows (`synthetic_users(n, seed=0, most_rows={s['most_rows']})`, largest {results['largest_user_rows']} "
            f"rows); a sampled user brings min(rows, k = {results['k']}) = {results['mean_rows_per_sampled_user']:.2f} "
            f"rows on average. Dev: the first {results['dev_rows']} dev rows. Seeds {results['seeds']}: a seed fixes "
            "initialisation, data order, Poisson batches and noise seed of both arms (the users are the same for "
            "every seed). Step time: the median over seeds of each run's median wall seconds per step, 1 torch "
            "thread, both arms of a seed at once on a shared machine; rows per step: the mean realised batch.",
            "",
            *lines,
            "",
            *pairs,
            "",
            *unpaired_note(unpaired),
            *([f"Failed: {', '.join(failed)}.", ""] if failed else []),
            f"Runs by commit: {commits}.",
            "",
            "Runs by machine (step times compare only within one):",
            "",
            *machines,
            "",
            f"Last sitting. {machine_line(results)}.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
