"""One sitting of the study (``python -m bench.tying``): every planned arm not yet recorded, then the table.

Earlier rows recorded with other settings or code are dropped, rows of an older format migrated
(:mod:`bench.tying.resume`); the results are written after every arm (:mod:`bench.tying.render`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.machine import git_info, machine_info
from bench.study import sst2
from bench.study.arm import install_stop_handlers, run_all
from bench.study.record import relative
from bench.study.version import study_code_version
from bench.tying.arguments import parse_args
from bench.tying.arms import ARMS, Study
from bench.tying.plan import chosen_lr, plan, rows_text
from bench.tying.render import write_outputs
from bench.tying.resume import migrate_record, recorded_rows, settings_key

GIT_PATHS = ("dplit", "configs", "bench/tying", "bench/study")
"""What the study's numbers depend on: uncommitted changes there are recorded."""


def new_results(args: argparse.Namespace, argv: list[str], sources: dict[str, Any], key: dict[str, Any],
                kept: list[dict[str, Any]], earlier: dict[str, Any] | None,
                holdout: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study's record: earlier sittings' rows (same settings key) and this sitting's settings."""
    sitting = {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               "command": "python -m bench.tying " + shlex.join(argv), "machine": machine_info(),
               "git": git_info(*GIT_PATHS), "jobs": args.jobs, "threads": args.threads, "wall_s": 0.0, "arms_run": 0}
    sittings = (earlier or {}).get("sittings", []) if kept else []
    return {
        "created": sittings[0]["started"] if sittings else sitting["started"],
        "command": sitting["command"], "machine": sitting["machine"], "git": sitting["git"],
        "settings_key": key,
        "sources": {k: (str(v) if isinstance(v, Path) else v) for k, v in sources.items()},
        "holdout": {"train_rows_total": holdout["train_rows_total"]} if holdout else None,
        "settings": {k: getattr(args, k) for k in (
            "profile", "arms", "epsilons", "seeds", "train_examples", "epochs", "batch_size", "lr", "lora_lr",
            "sweep_lrs", "holdout_rows", "reference_seeds", "noise", "max_length", "eval_batch_size", "eval_examples",
            "max_grad_norm", "physical_batch_size", "accelerator", "precision", "timeout", "threads", "jobs",
            "no_cache", "no_sort_dev")} | {"label_words": sst2.LABEL_WORDS,
                                           "configs": {name: arm.config for name, arm in ARMS.items()}},
        "training_subsets": [sst2.subset_description(args, sources, rows) for rows in args.train_examples],
        "runs": kept,
        "sittings": [*sittings, sitting],
        "wall_s": sum(s["wall_s"] for s in sittings),
        "complete": False,
    }


def run_study(args: argparse.Namespace, study: Study, results: dict[str, Any]) -> bool:
    """Run every arm not yet recorded, in priority order; whether the whole grid is recorded at the end."""
    sitting = results["sittings"][-1]
    wall_before = results["wall_s"]

    def write(done: dict[str, Any]) -> None:
        sitting["wall_s"] = done["wall_s"] - wall_before
        sitting["arms_run"] = sum(r.get("sitting") == sitting["started"] for r in done["runs"])
        write_outputs(done, args.out)

    def reference_lr(rows: int | None) -> float | None:
        return chosen_lr(results["runs"], rows, args.sweep_lrs) if args.sweep_lrs else args.lr

    def recorded() -> set[str]:
        return {r["fingerprint"] for r in results["runs"] if r.get("status") == "ok"}

    planned: list[str] = []
    for chunk in plan(args, reference_lr):
        runs = [{**run, "fingerprint": study.fingerprint(run), "sitting": sitting["started"]} for run in chunk]
        planned += [run["fingerprint"] for run in runs]
        todo = [run for run in runs if run["fingerprint"] not in recorded()]
        if len(todo) < len(runs):
            print(f"{len(runs) - len(todo)} of {len(runs)} runs already recorded with the same settings and code: "
                  "skipped", flush=True)
        run_all(todo, results, command=study.command, logs=args.logs, threads=args.threads, timeout=args.timeout,
                write=write, jobs=args.jobs)
    references = "non_private" not in args.arms or all(reference_lr(rows) is not None for rows in args.train_examples)
    return references and set(planned) <= recorded()


def dry_run(args: argparse.Namespace, study: Study) -> None:
    """Print every arm's dplit command (the non-private reference at --lr: the sweep chooses its rate)."""
    print("# (dry run: without the dequantised checkpoint folder and the sorted dev copy a real run prepares)")
    for chunk in plan(args, lambda rows: args.lr):
        for run in chunk:
            print(f"# {run['name']}\ndplit {shlex.join(study.command(run, args.logs / run['name']))}")


def main(argv: list[str] | None = None) -> None:
    """Run one sitting of the study: every planned arm not already recorded with the same fingerprint.

    Earlier rows recorded with other settings or code are dropped (saying how many); ``--dry-run`` only prints the
    plan. The results are written after every arm, then the table is printed.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    install_stop_handlers()
    sources = sst2.prepare(args)
    holdout = sst2.prepare_holdout(args, sources) if "non_private" in args.arms and args.sweep_lrs else None
    code = study_code_version()
    study = Study(args, sources, holdout, code)
    if args.dry_run:
        dry_run(args, study)
        return
    key = settings_key(args, sources, code)
    path = args.out / "results.json"
    earlier = json.loads(path.read_text()) if path.is_file() and not args.fresh else None
    if earlier:
        earlier, migrated = migrate_record(earlier)
        if migrated:
            print(f"{relative(path)}: {migrated} fingerprint(s) of an older format read as format 2", flush=True)
    kept, dropped = recorded_rows(earlier, key) if earlier else ([], 0)
    if dropped:
        print(f"{relative(path)}: {dropped} earlier row(s) dropped (failed, or other settings or code: "
              f"{'same' if earlier and earlier.get('settings_key') == key else 'different'} settings key; this "
              f"code: {code})", flush=True)
    results = new_results(args, argv, sources, key, kept, earlier, holdout)
    print(f"profile {args.profile}; scales {[rows_text(r) for r in args.train_examples]}; {len(kept)} arms already "
          f"recorded; {args.jobs} at a time; out {relative(args.out)}", flush=True)
    results["complete"] = run_study(args, study, results)
    if git_info(*GIT_PATHS) != results["git"]:
        results["git"]["changed_during_run"] = git_info(*GIT_PATHS)
    write_outputs(results, args.out)
    print((args.out / "table.md").read_text())
    print(f"wrote {relative(args.out / 'results.json')}, table.md, chart.png; this sitting "
          f"{results['sittings'][-1]['wall_s'] / 60:.1f} min; grid {'complete' if results['complete'] else 'NOT complete'}",
          flush=True)
