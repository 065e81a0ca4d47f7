"""Example-level vs user-level DP-SGD on real SST-2 with SmolLM2-135M-Instruct (issue 36's "Show it" row).

Run (CPU, ~11 min on 2 shared cores; the GGUF checkpoint and SST-2 TSVs from ``$DPLIT_DATA_DIR`` or /work/shared/data)::

    python -m bench.user_level

The first ``--train-rows`` rows of SST-2 train.tsv go, with an extra ``user`` column, to a copy of train.tsv: rows are
given to seeded synthetic users of 1..``--most-rows`` consecutive rows (``synthetic_users(n, seed=0, most_rows=20)``).
The dev copy is bench.study's (the first ``--eval-examples`` dev rows sorted by length, otherwise unchanged). Two arms
train the untied SmolLM2 config (``configs/smollm2_sst2_untied.yaml``, with the tying study's CPU settings) at the
same target ε: example-level DP with an expected batch of ``--batch-size`` rows, and user-level DP with
``max_rows_per_user`` = ``--k`` and an expected number of users per batch chosen so the expected rows per step are
comparable (``--batch-size`` / mean over users of min(rows, k), rounded). One seed (seed 0, DPStrategy(seed=0)): the
time limit of the run that recorded it allowed no more, so the difference is one draw, not an estimate.
Results: ``--out``/results.json and table.md (default bench/results/user_level/), naming the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path
from typing import Any

from bench.study import sst2
from bench.study.arm import install_stop_handlers, run_all
from bench.study.record import git_info, machine_info, machine_line, write_json
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Prepare the model and the user-column copy of SST-2, run both arms, write results.json and table.md."""
    args = parse_args(argv)
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
        batch, extra = arms[run["name"]]
        arm_args = copy.copy(args)
        arm_args.batch_size = batch
        spec = {"arm": "dp_untied", "seed": 0, "dp_seed": 0, "epsilon": args.epsilon, "rows": None}
        return dplit_args(arm_args, sources, spec, log_dir) + extra

    runs = [{"name": name, "privacy_unit": name, "batch_size": arms[name][0]} for name in arms]
    if args.dry_run:
        for run in runs:
            print(" ".join(["dplit", *command(run, args.logs / run["name"])]))
        return {}
    results: dict[str, Any] = {
        "command": "python -m bench.user_level",
        "settings": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_info(args.threads),
        "git": git_info("dplit", "configs", "bench"),
        "model": sst2.model_line(sources),
        "train_rows": len(users),
        "dev_rows": args.eval_examples,
        "users": len(sizes),
        "largest_user_rows": max(sizes),
        "k": args.k,
        "mean_rows_per_sampled_user": rows_per_user,
        "expected_users_per_batch": users_per_batch,
        "seeds": [0],
        "runs": [],
    }
    out = args.out / "results.json"
    run_all(
        runs,
        results,
        command=command,
        logs=args.logs,
        threads=args.threads,
        timeout=args.timeout,
        write=lambda data: write_json(data, out),
        jobs=args.jobs,
    )
    for row in results["runs"]:
        ledger = Path(row.get("log_dir") or "/nonexistent") / "privacy_ledger.json"
        if ledger.is_file():
            facts = json.loads(ledger.read_text())
            row["ledger_unit"] = {
                key: facts.get(key)
                for key in ("privacy_unit", "users", "dataset_size", "max_rows_per_user", "largest_user_rows")
            }
    write_json(results, out)
    (args.out / "table.md").write_text(table(results))
    print(table(results))
    return results


def table(results: dict[str, Any]) -> str:
    """The study's markdown table, with the data, the users and the machine."""
    lines = [
        "| privacy unit | expected batch | dev acc | ε | σ | steps | step time (s) | rows per step | users | k | "
        "largest user |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["runs"]:
        user = row["name"] == "user"
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | failed: {row['message'][:120]} |" + " |" * 9)
            continue
        sizes = row["step_batch_sizes"]
        lines.append(
            f"| {row['name']} | {row['batch_size']} {'users' if user else 'rows'} | {row['val_acc'] * 100:.1f}% | "
            f"{row['epsilon_spent']:.2f} | {row['noise_multiplier']:.3f} | {row['steps']} | "
            f"{row['step_time_median_s']:.2f} | {statistics.fmean(sizes) if sizes else 0:.1f} | "
            f"{results['users'] if user else '–'} | {results['k'] if user else '–'} | "
            f"{results['largest_user_rows'] if user else '–'} |"
        )
    return "\n".join(
        [
            f"# Example-level vs user-level DP-SGD, SST-2, SmolLM2-135M-Instruct (`{results['command']}`)",
            "",
            f"Model: {results['model']}; untied embeddings, full fine-tuning, 1 epoch, float32 on the CPU, C = "
            f"{results['settings']['max_grad_norm']}, lr {results['settings']['lr']}, target ε = "
            f"{results['settings']['epsilon']}. Data: the first {results['train_rows']} SST-2 train rows, given to "
            f"{results['users']} seeded synthetic users of 1–{results['settings']['most_rows']} consecutive rows "
            f"(`synthetic_users(n, seed=0, most_rows={results['settings']['most_rows']})`, largest "
            f"{results['largest_user_rows']} rows); a sampled user brings min(rows, k) = "
            f"{results['mean_rows_per_sampled_user']:.2f} rows on average. Dev: the first {results['dev_rows']} dev rows. "
            "One seed (0, common noise seed 0): a single draw, not an estimate. Step time: median wall seconds, "
            "1 torch thread, both arms at once on a shared machine.",
            "",
            *lines,
            "",
            machine_line(results) + ".",
            "",
        ]
    )


if __name__ == "__main__":
    main()
