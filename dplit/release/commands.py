"""The ``dplit export`` and ``dplit lm generate`` commands (argument parsing; the work is in their modules)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from dplit.release.export import export_checkpoint, export_summary
from dplit.release.generate import (
    SamplingSettings,
    check_device,
    check_model_source,
    check_output_file,
    generate_rows,
    load_generator,
    privacy_line,
    read_prompts,
    write_jsonl,
)
from dplit.release.guarantee import GUARANTEE_FILE


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``dplit: error:`` line (no usage block)."""

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dplit: error: {self.prog}: {message}\n")


def export_main(argv: list[str]) -> None:
    """``dplit export --ckpt_path CKPT --output_dir DIR [--config CFG] [--adapter_only] [--overwrite]``."""
    parser = OneLineArgumentParser(
        prog="dplit export",
        description="Write a trained dplit checkpoint as a Hugging Face folder with its model card.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint of dplit fit or dplit lm fit")
    parser.add_argument("--output_dir", required=True, help="folder to write (new or empty)")
    parser.add_argument(
        "--config", default=None, help="the run's YAML config (only for a checkpoint without dplit's record)"
    )
    parser.add_argument("--adapter_only", action="store_true", help="write peft's adapter folder instead of merging")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier dplit export in --output_dir")
    parser.add_argument(
        "--data_description", default=None, help="the training data as the card names it (default: the file's base name)"
    )
    args = parser.parse_args(argv)
    folder = export_checkpoint(
        args.ckpt_path, args.output_dir, config=args.config, adapter_only=args.adapter_only,
        overwrite=args.overwrite, data_description=args.data_description,
    )  # fmt: skip
    rank_zero_info(export_summary(folder, _guarantee(folder)))


def generate_main(argv: list[str]) -> None:
    """``dplit lm generate --model DIR_or_CKPT --prompts_file P --num_samples K --output_file OUT.jsonl``."""
    parser = OneLineArgumentParser(
        prog="dplit lm generate", description="Sample DP synthetic text from a private LM and PUBLIC control prompts."
    )
    defaults = SamplingSettings()
    parser.add_argument("--model", required=True, help="an exported folder (dplit export) or a dplit checkpoint")
    parser.add_argument("--prompts_file", required=True, help=".jsonl with a prompt column (and a label), or .txt")
    parser.add_argument("--num_samples", type=int, required=True, help="samples per prompt")
    parser.add_argument("--output_file", required=True, help="the .jsonl to write (prompt, label, sample, text)")
    parser.add_argument("--prompt_column", default="prompt", help="prompt column of a .jsonl prompts file")
    parser.add_argument(
        "--label_column", default="label", help="label column of a .jsonl prompts file (kept if present)"
    )
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--top_p", type=float, default=defaults.top_p)
    parser.add_argument("--max_new_tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed, help="sampling seed (the samples are public)")
    parser.add_argument("--batch_size", type=int, default=defaults.batch_size)
    parser.add_argument("--device", default=None, help="torch device to sample on (default: cuda when available, else cpu)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output_file")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    settings = SamplingSettings(
        num_samples=args.num_samples, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
    )  # fmt: skip
    check_model_source(args.model)
    check_output_file(args.output_file, overwrite=args.overwrite)
    prompts = read_prompts(args.prompts_file, prompt_column=args.prompt_column, label_column=args.label_column)
    device = check_device(args.device)
    backbone, tokenizer, guarantee = load_generator(args.model)
    backbone.to(device)
    rows = generate_rows(backbone, tokenizer, prompts, settings, progress=not args.no_progress)
    path = write_jsonl(rows, args.output_file)
    rank_zero_info(f"wrote {len(rows)} samples to {path}")
    rank_zero_info(privacy_line(guarantee, len(rows)))


def _guarantee(folder: Path) -> dict[str, Any]:
    return json.loads((folder / GUARANTEE_FILE).read_text())
