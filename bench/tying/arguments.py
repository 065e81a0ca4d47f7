"""The study's command line: the profiles (``--smoke``, default, ``--full``) and :func:`parse_args`.

The help text (``python -m bench.tying --help``) is the package's docstring, :mod:`bench.tying`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import bench.tying
from bench.study import sst2
from bench.study.record import ROOT
from bench.tying.arms import ARMS

PROFILES: dict[str, dict[str, Any]] = {
    # 2 shared CPU cores, 1 torch thread, measured per arm: ~10 s start-up, ~1 s to load the dequantised checkpoint,
    # ~72 s to validate the 872 dev rows (sorted by length, batches of 32), ~3.3 s per DP step at B = 8 (~2.8 s
    # non-private; the first DP step adds ~10 s for DPStrategy's ghost-clipping self-check); LoRA arms ~3 s per step.
    "default": {
        "train_examples": [160, 1000], "epochs": 1, "batch_size": 8, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 64,
        "eval_batch_size": 32, "max_grad_norm": 0.1, "physical_batch_size": 16, "epsilons": [3.0, 8.0],
        "seeds": list(range(10)), "eval_examples": None, "accelerator": "cpu", "precision": "32-true",
        "timeout": 3600.0, "threads": 1, "jobs": 2, "sweep_lrs": [1e-5, 3e-5, 1e-4, 3e-4], "holdout_rows": 500,
        "reference_seeds": 3,
        "arms": ["zero_shot", "non_private", "dp_tied", "dp_untied", "lora_tied", "lora_untied"],
    },
    "smoke": {
        "train_examples": [32], "epochs": 1, "batch_size": 8, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 64,
        "eval_batch_size": 32, "max_grad_norm": 0.1, "physical_batch_size": 8, "epsilons": [8.0], "seeds": [0],
        "eval_examples": 64, "accelerator": "cpu", "precision": "32-true", "timeout": 600.0, "threads": 1,
        "jobs": 1, "sweep_lrs": [1e-4, 3e-4], "holdout_rows": 64, "reference_seeds": 1, "arms": list(ARMS),
    },
    # Li et al. 2021's SST-2 recipe (the shipped configs' values): meant for a GPU.
    "full": {
        "train_examples": [None], "epochs": 3, "batch_size": 1000, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 128,
        "eval_batch_size": 128, "max_grad_norm": 0.1, "physical_batch_size": 64, "epsilons": [3.0, 8.0],
        "seeds": [0, 1, 2], "eval_examples": None, "accelerator": "auto", "precision": "bf16-mixed",
        "timeout": 6 * 3600.0, "threads": 0, "jobs": 1, "sweep_lrs": [1e-5, 3e-5, 1e-4, 3e-4],
        "holdout_rows": 1000, "reference_seeds": 3, "arms": list(ARMS),
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The study's arguments, with the profile's values (``--smoke``, default, ``--full``) where none is given."""
    parser = argparse.ArgumentParser(prog="python -m bench.tying", description=bench.tying.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--smoke", action="store_true", help="quick check: 32 train rows, 1 seed, ε=8, 64 dev rows")
    profile.add_argument("--full", action="store_true",
                         help="the paper's recipe: whole train set, B=1000, 3 epochs, lr 5e-4, C=0.1, max_length 128, "
                              "bf16-mixed on the best accelerator (a GPU)")
    parser.add_argument("--epsilons", nargs="+", type=float, help="target ε of the DP arms (default 3 8)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (seed_everything; default: the profile's, 0-9 by "
                                                             "default, 0 1 2 with --full)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="arms to run (default: the profile's)")
    parser.add_argument("--train-examples", nargs="+", type=int,
                        help="data scales: the first N rows of SST-2 train, one scale per N (0: all 67,349)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="expected logical batch (Poisson rate q = B/N under DP)")
    parser.add_argument("--lr", type=float, help="AdamW peak learning rate of DP full fine-tuning (linear decay to 0)")
    parser.add_argument("--lora-lr", type=float, help="AdamW peak learning rate of the LoRA arms (default 2e-3)")
    parser.add_argument("--sweep-lrs", nargs="*", type=float,
                        help="the non-private arm's candidate learning rates (none: it trains at --lr)")
    parser.add_argument("--holdout-rows", type=int,
                        help="the sweep validates on the last N rows of SST-2 train (held out; default 500)")
    parser.add_argument("--reference-seeds", type=int, help="the non-private arm runs on the first N seeds (default 3)")
    parser.add_argument("--noise", choices=("common", "independent"), default="common",
                        help="common (default): every DP arm of seed s runs with DPStrategy(seed=s), so the arms of a "
                             "pair draw the same Poisson batches and the same noise on the parameters they share "
                             "(common random numbers: a sharper paired difference; predictable noise, so the trained "
                             "models are measurements, not private releases); independent: OS-entropy noise per arm")
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
    parser.add_argument("--jobs", type=int, help="arms running at once (default 2 on CPU, 1 with --full)")
    parser.add_argument("--fresh", action="store_true", help="ignore the arms already in --out's results.json")
    sst2.add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results/tying, .../tying/full with --full, "
                             "bench/out/tying/smoke/results with --smoke)")
    parser.add_argument("--logs", type=Path, default=None, help="logs folder (default bench/out/tying, ignored)")
    parser.add_argument("--dry-run", action="store_true", help="print each arm's dplit command and exit")
    args = parser.parse_args(argv)
    name = "smoke" if args.smoke else "full" if args.full else "default"
    args.profile = name
    for key, value in PROFILES[name].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.train_examples = [n or None for n in dict.fromkeys(args.train_examples)]  # 0: all rows
    args.logs = args.logs or ROOT / "bench" / "out" / "tying" / name  # git-ignored
    default_out = {"default": ROOT / "bench" / "results" / "tying", "full": ROOT / "bench" / "results" / "tying" /
                   "full", "smoke": args.logs / "results"}[name]  # a smoke check's results stay out of git
    args.out = args.out or default_out
    for key in ("epochs", "batch_size", "max_length", "eval_batch_size", "physical_batch_size", "jobs",
                "reference_seeds"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be ≥ 1")
    for rows in args.train_examples:
        if rows is not None and (rows < 0 or args.batch_size > rows):
            parser.error(f"--batch-size {args.batch_size} exceeds --train-examples {rows}")
    return args
