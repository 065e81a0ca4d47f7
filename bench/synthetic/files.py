"""The files the pipeline hands to dplit: the private rows as instructions, the prompts, the synthetic set."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CONTROL_PROMPTS = {"0": "Write a negative movie review:\n", "1": "Write a positive movie review:\n"}
"""The public control string of each SST-2 label: the LM's prompt in training and in generation."""


def read_sst2_rows(path: Path, start: int, count: int | None) -> list[tuple[str, str]]:
    """Rows ``start``..``start + count`` of an SST-2 TSV as (sentence, label), read with quoting off as dplit does."""
    rows = []
    with path.open(encoding="utf-8-sig") as file:
        next(file)  # header: sentence, label
        for index, line in enumerate(file):
            if index < start or not line.strip():
                continue
            if count is not None and len(rows) >= count:
                break
            sentence, label = line.rstrip("\n").rsplit("\t", 1)
            rows.append((sentence, label))
    return rows


def write_instructions(rows: Iterable[tuple[str, str]], path: Path) -> Path:
    """SST-2 rows as ``dplit lm`` instructions: the label's control prompt, and the review as the response."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": CONTROL_PROMPTS[label], "response": sentence}) for sentence, label in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_prompts(path: Path) -> Path:
    """The generation prompts file: each label's control prompt with its label."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "label": label}) + "\n" for label, p in CONTROL_PROMPTS.items()))
    return path


def write_synthetic_tsv(samples: list[dict[str, Any]], folder: Path, dev: Path) -> dict[str, int]:
    """The generated samples as an SST-2 ``train.tsv`` (one line each; empty ones dropped) beside a link to ``dev``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, dropped = [], 0
    for sample in samples:
        text = " ".join(sample["text"].replace("\t", " ").split())
        if not text:
            dropped += 1
            continue
        lines.append(f"{text}\t{sample['label']}\n")
    (folder / "train.tsv").write_text("sentence\tlabel\n" + "".join(lines), encoding="utf-8")
    link = folder / "dev.tsv"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(dev.resolve())
    return {"rows": len(lines), "dropped_empty": dropped,
            "positive": sum(line.endswith("\t1\n") for line in lines)}


def prepare_files(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, Any]:
    """The private instructions, the LM's validation rows and the prompts file, from the local SST-2 train.tsv."""
    if sources["data_dir"] is None:
        raise SystemExit("the synthetic-data pipeline reads SST-2's train.tsv: give --data-dir or --data-root")
    train = Path(sources.get("original_data_dir") or sources["data_dir"]) / "train.tsv"
    private = read_sst2_rows(train, 0, args.train_examples)
    held_out = read_sst2_rows(train, len(private), args.lm_val_examples)
    monitor = held_out or private[-args.lm_val_examples :]  # the whole split is private: a training-fit monitor
    folder = args.logs / "data"
    return {"train": write_instructions(private, folder / "private.jsonl"),
            "val": write_instructions(monitor, folder / "lm_val.jsonl"),
            "prompts": write_prompts(folder / "prompts.jsonl"), "private_texts": [text for text, _ in private],
            "held_out_texts": [text for text, _ in held_out] or None}
