"""One run of the pipeline (``python -m bench.synthetic``): the plan, each arm in turn, then the table."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import git_info, machine_info
from bench.study import sst2
from bench.study.arm import install_stop_handlers
from bench.study.record import relative
from bench.synthetic.arguments import PROFILES, parse_args
from bench.synthetic.files import CONTROL_PROMPTS, prepare_files
from bench.synthetic.pipeline import run_classifier, run_pipeline
from bench.synthetic.render import write_outputs

GIT_PATHS = ("dplit", "configs", "bench/synthetic", "bench/tying", "bench/study")


def plan(args: argparse.Namespace, *, control: bool = True) -> list[tuple[str, float | None, int]]:
    """(arm, ε, seed) in running order.

    Zero-shot once; per seed the pretrained control (``control``), then per ε the DP classifier and the pipeline.
    """
    runs: list[tuple[str, float | None, int]] = [("zero_shot", None, args.seeds[0])]
    for seed in args.seeds:
        if control:
            runs.append(("synthetic", None, seed))  # synthetic rows of the pretrained model itself
        for epsilon in args.epsilons:
            runs += [("dp_tied", epsilon, seed), ("synthetic", epsilon, seed)]
    return runs


def main(argv: list[str] | None = None) -> None:
    """Run the planned arms one by one, writing the results after each, then print the table.

    ``--dry-run`` only prints the plan.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    install_stop_handlers()
    sources = sst2.prepare(args)
    folder = Path(sources["pretrained"])
    control = (folder / "config.json").is_file() and not sources["gguf_file"]
    if not control:
        print(f"no pretrained control: `dplit lm generate` needs a local model folder, and {folder} is not one "
              "(the hub, or a GGUF with --no-cache)", flush=True)
    runs = plan(args, control=control)
    if args.dry_run:
        for arm, epsilon, seed in runs:
            print(f"# {arm} ε={epsilon} seed={seed}")
        return
    files = prepare_files(args, sources)
    results: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.synthetic", *map(shlex.quote, argv)]),
        "machine": machine_info(), "git": git_info(*GIT_PATHS),
        "sources": {k: (str(v) if isinstance(v, Path) else v) for k, v in sources.items()},
        "settings": {k: getattr(args, k) for k in PROFILES["default"]} | {"profile": args.profile,
                                                                        "control_prompts": CONTROL_PROMPTS},
        "training_subset": sst2.subset_description(args, sources, args.train_examples),
        "runs": [], "wall_s": 0.0, "complete": False,
    }
    print(f"{len(runs)} runs; profile {args.profile}; {results['training_subset']['rule']}; out {relative(args.out)}",
          flush=True)
    start = time.perf_counter()
    for index, (arm, epsilon, seed) in enumerate(runs, 1):
        print(f"[{time.perf_counter() - start:6.0f} s] {index}/{len(runs)} {arm} ε={epsilon} seed={seed} ...", end=" ",
              flush=True)
        if arm == "synthetic":
            row = run_pipeline(args, sources, files, epsilon, seed)
        else:
            row = run_classifier(args, sources, arm, epsilon, seed)
        results["runs"].append(row)
        results["wall_s"] = time.perf_counter() - start
        write_outputs(results, args.out)
        print(f"acc {row['val_acc'] * 100:.1f}%" if row.get("status") == "ok" else f"FAILED: {row.get('message')}",
              flush=True)
    results["complete"] = True
    if git_info(*GIT_PATHS) != results["git"]:
        results["git"]["changed_during_run"] = git_info(*GIT_PATHS)
    write_outputs(results, args.out)
    print((args.out / "table.md").read_text())
