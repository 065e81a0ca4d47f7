"""``dplit export`` and ``dplit lm generate`` on the command line: their flags, parsed as every dplit command's are.

The work is in :mod:`dplit.release.export` and :mod:`dplit.release.generate`; this module is their front end, as
:mod:`dplit.cli.lightning_cli` is ``dplit fit``'s. The parsers are jsonargparse's (the family LightningCLI uses), so a
flag's range is its type's (:mod:`dplit.flag_types`) and a parse error is one line naming the flag
(:func:`dplit.cli.messages.essential_error`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser
from lightning.pytorch.utilities import rank_zero_info

from dplit.cli.messages import OneLineErrors
from dplit.flag_types import PositiveInteger, PositiveNumber
from dplit.release.export import export_checkpoint, export_summary
from dplit.release.generate import (
    MAX_SAMPLES,
    SamplingSettings,
    TopP,
    check_device,
    check_model_source,
    check_output_file,
    check_sample_count,
    generate_batches,
    load_generator,
    partial_file,
    privacy_line,
    read_prompts,
    write_samples,
)
from dplit.release.guarantee import GUARANTEE_FILE


class OneLineArgumentParser(OneLineErrors, ArgumentParser):
    """A jsonargparse parser whose errors are one ``dplit: error:`` line naming the ``--flag`` (no usage block)."""

    flag_prefix = "--"


def export_main(argv: list[str]) -> None:
    """``dplit export --ckpt_path CKPT --output_dir DIR [--config CFG] [--adapter_only] [--overwrite] [...]``."""
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
        "--data_description",
        default=None,
        help="the training data as the card names it (default: the file's base name)",
    )
    parser.add_argument(
        "--publish_private_diagnostics",
        action="store_true",
        help="state in the card and dp_guarantee.json the values computed from the private data without noise "
        "(the largest user's row count), each marked as not covered by ε (default: none is released)",
    )
    args = parser.parse_args(argv)
    announcement = f"exporting {args.ckpt_path}: rebuilding the model, merging adapters, writing weights and card ..."
    with one_line_interrupt(f"nothing was exported (--output_dir {args.output_dir} is as it was)"):
        folder = export_checkpoint(
            args.ckpt_path, args.output_dir, config=args.config, adapter_only=args.adapter_only,
            overwrite=args.overwrite, data_description=args.data_description,
            publish_private_diagnostics=args.publish_private_diagnostics,
            on_checked=lambda: rank_zero_info(announcement),
        )  # fmt: skip
    rank_zero_info(export_summary(folder, _guarantee(folder)))


def generate_main(argv: list[str]) -> None:
    """``dplit lm generate --model DIR_or_CKPT --prompts_file P --num_samples K --output_file OUT.jsonl``."""
    args = _generate_parser().parse_args(argv)
    settings = SamplingSettings(
        num_samples=args.num_samples, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
    )  # fmt: skip
    check_model_source(args.model)
    check_output_file(args.output_file, overwrite=args.overwrite)
    with one_line_interrupt(f"no samples were written (--output_file {args.output_file})"):
        prompts = read_prompts(args.prompts_file, prompt_column=args.prompt_column, label_column=args.label_column)
        total = check_sample_count(len(prompts), settings.num_samples)
        device = check_device(args.device)
        backbone, tokenizer, guarantee = load_generator(args.model)
        backbone.to(device)
        rank_zero_info(f"drawing {total} samples into {partial_file(args.output_file)} (renamed when done)")
        batches = generate_batches(backbone, tokenizer, prompts, settings, progress=not args.no_progress)
        path, count = write_samples(batches, args.output_file)
    rank_zero_info(f"wrote {count} samples to {path}")
    rank_zero_info(privacy_line(guarantee, count))


def _generate_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(
        prog="dplit lm generate", description="Sample DP synthetic text from a private LM and PUBLIC control prompts."
    )
    defaults = SamplingSettings()
    parser.add_argument("--model", required=True, help="an exported folder (dplit export) or a dplit checkpoint")
    parser.add_argument(
        "--prompts_file", required=True,
        help="public prompts, read as training files are: .jsonl, .json or .csv with a prompt column (and a label), "
        "or .txt with one prompt per line",
    )  # fmt: skip
    parser.add_argument(
        "--num_samples", type=PositiveInteger, required=True,
        help=f"samples per prompt (at most {MAX_SAMPLES:,} samples in all: prompts × --num_samples)",
    )  # fmt: skip
    parser.add_argument(
        "--output_file", required=True,
        help="the .jsonl to write (prompt, label, sample, text); rows stream to OUTPUT_FILE.partial as they are "
        "drawn, renamed when done (kept on Ctrl-C)",
    )  # fmt: skip
    parser.add_argument("--prompt_column", default="prompt", help="prompt column of a .jsonl/.json/.csv prompts file")
    parser.add_argument(
        "--label_column", default="label", help="label column of a .jsonl/.json/.csv prompts file (kept if present)"
    )
    parser.add_argument("--temperature", type=PositiveNumber, default=defaults.temperature)
    parser.add_argument("--top_p", type=TopP, default=defaults.top_p)
    parser.add_argument("--max_new_tokens", type=PositiveInteger, default=defaults.max_new_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed, help="sampling seed (the samples are public)")
    parser.add_argument("--batch_size", type=PositiveInteger, default=defaults.batch_size)
    parser.add_argument(
        "--device", default=None, help="torch device to sample on (default: cuda when available, else cpu)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --output_file")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    return parser


@contextmanager
def one_line_interrupt(nothing_kept: str) -> Iterator[None]:
    """Ctrl-C (SIGINT) as one ``dplit: interrupted:`` line and exit code 130 (128 + SIGINT), not a traceback.

    Args:
        nothing_kept: what the line says when the interrupt does not say what was kept itself.
    """
    try:
        yield
    except KeyboardInterrupt as interrupt:
        print(f"dplit: interrupted: {str(interrupt) or nothing_kept}", file=sys.stderr)
        raise SystemExit(130) from None


def _guarantee(folder: Path) -> dict[str, Any]:
    return json.loads((folder / GUARANTEE_FILE).read_text())
