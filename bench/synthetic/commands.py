"""The dplit command lines of the pipeline: the DP LM's fit, generation, and the classifiers (the tying study's)."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from bench.tying.arms import dplit_args

LM_CONFIG = "configs/smollm2_lm.yaml"


def lm_fit_args(args: argparse.Namespace, sources: dict[str, Any], files: dict[str, Path], epsilon: float, seed: int,
                folder: Path) -> list[str]:
    """``dplit lm fit`` of the DP language model on the private instructions."""
    model = ["--model.pretrained", sources["pretrained"], "--data.tokenizer", sources["pretrained"]]
    if sources["gguf_file"]:
        model += ["--model.gguf_file", sources["gguf_file"], "--data.gguf_file", sources["gguf_file"]]
    callbacks = [{"class_path": "dplit.callbacks.ResourceMonitor"},
                 {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}]
    prefix = "--trainer.strategy.init_args."
    return [
        "lm", "fit", "--config", LM_CONFIG, *model,
        "--data.train_file", str(files["train"]), "--data.val_file", str(files["val"]),
        "--data.prompt_column", "prompt", "--data.response_column", "response",
        "--data.batch_size", str(args.lm_batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
        "--data.max_length", str(args.lm_max_length),
        "--seed_everything", str(seed), "--model.lr", repr(args.lm_lr), "--model.sample_prompts", "[]",
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.precision", args.precision,
        "--trainer.max_epochs", str(args.lm_epochs), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(folder),
        "--trainer.callbacks", json.dumps(callbacks),
        prefix + "target_epsilon", repr(float(epsilon)), prefix + "max_grad_norm", repr(args.lm_max_grad_norm),
        prefix + "clipping", "ghost", prefix + "max_physical_batch_size", str(args.physical_batch_size),
    ]


def generate_args(args: argparse.Namespace, model: Path, prompts: Path, output: Path, seed: int) -> list[str]:
    """``dplit lm generate``: ``--synthetic-per-label`` samples of each control prompt."""
    return ["lm", "generate", "--model", str(model), "--prompts_file", str(prompts),
            "--num_samples", str(args.synthetic_per_label), "--output_file", str(output), "--overwrite",
            "--temperature", repr(args.temperature), "--top_p", repr(args.top_p),
            "--max_new_tokens", str(args.max_new_tokens), "--seed", str(seed),
            "--batch_size", str(args.generate_batch_size), "--device", generation_device(args), "--no_progress"]


def generation_device(args: argparse.Namespace) -> str:
    """Where ``dplit lm generate`` samples: the CPU when the study trains there, else CUDA when there is one."""
    if args.accelerator == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def classifier_args(args: argparse.Namespace, sources: dict[str, Any], arm: str, epsilon: float | None, seed: int,
                    folder: Path, *, synthetic: Path | None = None) -> list[str]:
    """A classifier arm as the tying study runs it; ``synthetic``: trained without DP on that folder's train.tsv."""
    if synthetic is None:
        run = {"arm": arm, "epsilon": epsilon, "seed": seed, "rows": args.train_examples}  # noise from OS entropy
        return dplit_args(args, sources, run, folder)
    on_synthetic = copy.copy(args)
    on_synthetic.train_examples, on_synthetic.epochs = None, args.synthetic_epochs
    on_synthetic.batch_size, on_synthetic.lr = args.synthetic_batch_size, args.synthetic_lr
    rows = {**sources, "data_dir": str(synthetic)}
    return dplit_args(on_synthetic, rows, {"arm": "non_private", "epsilon": None, "seed": seed, "rows": None},
                            folder)


def dplit_command(argv: list[str]) -> list[str]:
    """The dplit executable of this interpreter (``python -m dplit``) with ``argv``."""
    return [sys.executable, "-m", "dplit", *argv]
