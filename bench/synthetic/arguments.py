"""The pipeline's command line: the profiles (``--smoke``, default, ``--full``) and :func:`parse_args`.

The help text (``python -m bench.synthetic --help``) is the package's docstring, :mod:`bench.synthetic`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import bench.synthetic
from bench.study import sst2
from bench.study.record import ROOT

PROFILES: dict[str, dict[str, Any]] = {
    # 2 shared CPU cores, 1 torch thread per process: 20 DP steps of each DP model per ε, 320 synthetic rows.
    "default": {
        "train_examples": 320, "lm_val_examples": 64, "epsilons": [3.0, 8.0], "seeds": [0],
        "epochs": 1, "batch_size": 16, "lr": 5e-4, "max_grad_norm": 0.1,
        "lm_epochs": 1, "lm_batch_size": 16, "lm_lr": 1e-4, "lm_max_grad_norm": 1.0, "lm_max_length": 96,
        "synthetic_per_label": 160, "max_new_tokens": 48, "temperature": 1.0, "top_p": 0.9, "generate_batch_size": 16,
        "synthetic_epochs": 1, "synthetic_batch_size": 16, "synthetic_lr": 5e-5,
        "max_length": 64, "eval_batch_size": 32, "physical_batch_size": 16, "eval_examples": None,
        "accelerator": "cpu", "precision": "32-true", "timeout": 1800.0, "threads": 1,
    },
    "smoke": {
        "train_examples": 32, "lm_val_examples": 16, "epsilons": [8.0], "seeds": [0],
        "epochs": 1, "batch_size": 8, "lr": 5e-4, "max_grad_norm": 0.1,
        "lm_epochs": 1, "lm_batch_size": 8, "lm_lr": 1e-4, "lm_max_grad_norm": 1.0, "lm_max_length": 96,
        "synthetic_per_label": 8, "max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "generate_batch_size": 8,
        "synthetic_epochs": 1, "synthetic_batch_size": 8, "synthetic_lr": 5e-5,
        "max_length": 64, "eval_batch_size": 32, "physical_batch_size": 8, "eval_examples": 64,
        "accelerator": "cpu", "precision": "32-true", "timeout": 900.0, "threads": 1,
    },
    # The whole train split; the LM with configs/smollm2_lm.yaml's batch and learning rate, 3 epochs. For a GPU.
    "full": {
        "train_examples": None, "lm_val_examples": 64, "epsilons": [3.0, 8.0], "seeds": [0, 1, 2],
        "epochs": 3, "batch_size": 1000, "lr": 5e-4, "max_grad_norm": 0.1,
        "lm_epochs": 3, "lm_batch_size": 256, "lm_lr": 2e-4, "lm_max_grad_norm": 1.0, "lm_max_length": 128,
        "synthetic_per_label": 5000, "max_new_tokens": 64, "temperature": 1.0, "top_p": 0.9,
        "generate_batch_size": 128, "synthetic_epochs": 3, "synthetic_batch_size": 32, "synthetic_lr": 5e-5,
        "max_length": 128, "eval_batch_size": 128, "physical_batch_size": 64, "eval_examples": None,
        "accelerator": "auto", "precision": "bf16-mixed", "timeout": 12 * 3600.0, "threads": 0,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The pipeline's arguments, with the profile's values (``--smoke``, default, ``--full``) where none is given."""
    parser = argparse.ArgumentParser(prog="python -m bench.synthetic", description=bench.synthetic.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--smoke", action="store_true", help="quick check: 32 private rows, ε=8, 64 dev rows")
    profile.add_argument("--full", action="store_true", help="the whole train split, for a GPU")
    parser.add_argument("--epsilons", nargs="+", type=float, help="target ε of the DP LM and DP classifier")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (training and sampling)")
    parser.add_argument("--train-examples", type=int, help="the private set: first N rows of SST-2 train (0: all)")
    parser.add_argument("--lm-val-examples", type=int, help="rows after the private set: the LM's validation file")
    group = parser.add_argument_group("the DP classifier trained on the private rows (the tying study's dp_tied arm)")
    group.add_argument("--epochs", type=int)
    group.add_argument("--batch-size", type=int, help="expected logical batch")
    group.add_argument("--lr", type=float)
    group.add_argument("--max-grad-norm", type=float, help="C")
    group = parser.add_argument_group("the DP language model (dplit lm fit, configs/smollm2_lm.yaml)")
    group.add_argument("--lm-epochs", type=int)
    group.add_argument("--lm-batch-size", type=int, help="expected logical batch")
    group.add_argument("--lm-lr", type=float)
    group.add_argument("--lm-max-grad-norm", type=float, help="C (the example's summed token loss)")
    group.add_argument("--lm-max-length", type=int, help="prompt + review tokens (longer rows are cut at the end)")
    group = parser.add_argument_group("generation (dplit lm generate)")
    group.add_argument("--synthetic-per-label", type=int, help="samples per control prompt")
    group.add_argument("--max-new-tokens", type=int)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--generate-batch-size", type=int)
    group = parser.add_argument_group("the non-private classifier trained on the synthetic rows")
    group.add_argument("--synthetic-epochs", type=int)
    group.add_argument("--synthetic-batch-size", type=int)
    group.add_argument("--synthetic-lr", type=float)
    group = parser.add_argument_group("shared")
    group.add_argument("--max-length", type=int, help="classifier prompt length in tokens")
    group.add_argument("--eval-batch-size", type=int)
    group.add_argument("--eval-examples", type=int, help="first N dev rows (default: all 872)")
    group.add_argument("--physical-batch-size", type=int, help="DPStrategy.max_physical_batch_size")
    group.add_argument("--accelerator")
    group.add_argument("--precision")
    group.add_argument("--timeout", type=float, help="seconds per process before it is killed")
    group.add_argument("--threads", type=int, help="torch threads per process (0: torch's default)")
    sst2.add_source_arguments(parser)
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/synthetic[/full])")
    parser.add_argument("--logs", type=Path, help="logs folder (default bench/out/synthetic/<profile>)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (arm, ε, seed) and exit")
    args = parser.parse_args(argv)
    args.profile = "smoke" if args.smoke else "full" if args.full else "default"
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.train_examples == 0:
        args.train_examples = None
    args.logs = args.logs or ROOT / "bench" / "out" / "synthetic" / args.profile
    args.out = args.out or {"default": ROOT / "bench" / "results" / "synthetic",
                            "full": ROOT / "bench" / "results" / "synthetic" / "full",
                            "smoke": args.logs / "results"}[args.profile]
    for key in ("epochs", "batch_size", "lm_epochs", "lm_batch_size", "lm_max_length", "synthetic_per_label",
                "max_new_tokens", "generate_batch_size", "synthetic_epochs", "synthetic_batch_size", "max_length",
                "eval_batch_size", "physical_batch_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be ≥ 1")
    return args
