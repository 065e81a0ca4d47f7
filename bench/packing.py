"""Packed against padded DP-SGD steps: real tokens per second on the same documents (issue 54's benchmark).

Run (repository root; CPU smoke ~1 min, a GPU row with ``--device cuda --model gpt2``)::

    python -m bench.packing --model tiny --row 128 --documents 64          # CPU smoke
    python -m bench.packing --device cuda --model gpt2 smollm2 --row 512 1024 --documents 256   # issue 54's rows

Both arms clip with the shipped ghost engine (:class:`dplit.privacy.clipping.ghost.GhostEngine`) on the same
documents, one logical batch, cut into micro-batches of ``--micro`` rows: padded, one document per row padded to the
longest of its micro-batch (dplit's ``TextCollator``, in sampled order); packed, the documents packed first-fit
decreasing into rows of ``--row`` tokens (:func:`dplit.data.packing.pack_documents`), each its own unit. A third row
times the packed batch's non-private step (forward and backward of the summed loss). Two length mixes: ``sst2``
(real SST-2 train sentences, GPT-2 tokenizer, from ``$DPLIT_DATA_DIR``) and ``lognormal`` (16 to ``--row`` tokens,
median 128). Tokens/s counts real tokens; the table gives packed/padded and DP/non-private ratios side by side.
Every ``--model`` is measured at every ``--row`` length; results.json and table.md are rewritten after each row of the
table, so a run stopped by a time budget keeps what it measured. Results: ``--out``/results.json and table.md
(default bench/results/packing/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.machine import machine_info
from bench.models import MODELS, VOCAB_SIZES, family
from dplit.data.packing import pack_documents
from dplit.data.text import TextCollator
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.units import split_batch
from dplit.tasks.language_model import CausalLanguageModel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["tiny"], choices=sorted(MODELS), help="model shapes")
    parser.add_argument("--row", nargs="+", type=int, default=[128], help="row lengths (data.max_length)")
    parser.add_argument("--documents", type=int, default=64, help="documents in the logical batch")
    parser.add_argument("--micro", type=int, default=16, help="rows per micro-batch (max_physical_batch_size)")
    parser.add_argument("--mixes", nargs="+", default=["sst2", "lognormal"], choices=["sst2", "lognormal"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/packing"))
    return parser.parse_args(argv)


def document_lengths(mix: str, count: int, row: int, seed: int = 0) -> list[int]:
    """``count`` document lengths of ``mix`` (each at most ``row``)."""
    if mix == "lognormal":
        generator = torch.Generator().manual_seed(seed)
        drawn = torch.exp(math.log(128) + torch.randn(count, generator=generator))  # median 128
        return [int(min(max(16, length), row)) for length in drawn.tolist()]
    from dplit.data.tokenizer import load_tokenizer

    root = Path(os.environ.get("DPLIT_DATA_DIR", "/work/shared/data"))
    tokenizer = load_tokenizer(str(root / "gpt2-tokenizer"))
    lines = (root / "glue" / "sst2" / "train.tsv").read_text().splitlines()[1 : count + 1]
    return [min(len(tokenizer.encode(line.split("\t")[0])) + 1, row) for line in lines]


def documents(lengths: list[int], vocab: int) -> list[dict[str, list[int]]]:
    """Random-token documents of ``lengths`` (every token trained)."""
    generator = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(0, vocab, (n,), generator=generator).tolist(), "loss_mask": [1] * n}
        for n in lengths
    ]


def timed(step: Callable[[], None], repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` runs of ``step`` (after one warm-up), in seconds."""
    best = math.inf
    for attempt in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def dp_step(model: CausalLanguageModel, batch: dict[str, torch.Tensor], micro: int) -> Callable[[], None]:
    """One logical batch clipped by the ghost engine, ``micro`` rows at a time (gradients then dropped)."""
    engine = GhostEngine(model, max_grad_norm=1.0)

    def step() -> None:
        for part in split_batch(batch, micro):
            engine.accumulate(model.per_example_loss, part)
        model.zero_grad(set_to_none=True)

    return step


def plain_step(model: CausalLanguageModel, batch: dict[str, torch.Tensor], micro: int) -> Callable[[], None]:
    """The same micro-batches, non-private: forward and backward of the summed loss."""

    def step() -> None:
        for part in split_batch(batch, micro):
            model.per_example_loss({k: v for k, v in part.items() if k != "privacy_unit"}).sum().backward()
        model.zero_grad(set_to_none=True)

    return step


def measure(args: argparse.Namespace, name: str, length: int, mix: str) -> dict[str, Any]:
    """Tokens/s of the padded and packed DP steps and of the packed non-private step on one mix.

    The model is ``name``'s shape, the rows ``length`` tokens long.
    """
    device = torch.device(args.device)
    torch.manual_seed(0)
    limit = "n_positions" if family(name) == "gpt2" else "max_position_embeddings"  # each family's own key
    config = {**MODELS[name], limit: length}
    model = CausalLanguageModel(config=config, vocab_size=VOCAB_SIZES[family(name)], attn_implementation="sdpa")
    model = model.to(device).train()
    lengths = document_lengths(mix, args.documents, length)
    docs = documents(lengths, VOCAB_SIZES[family(name)])
    padded = {k: v.to(device) for k, v in TextCollator(pad_token_id=0)(docs).items()}  # type: ignore[arg-type]
    packed_rows = pack_documents(docs, max_length=length, pad_token_id=0)
    packed = {k: v.to(device) for k, v in packed_rows.batch.items()}
    tokens = sum(lengths)
    row: dict[str, Any] = {"model": name, "mix": mix, "documents": len(docs), "tokens": tokens, "row": length}
    for name, step in {
        "padded_dp": dp_step(model, padded, args.micro),
        "packed_dp": dp_step(model, packed, args.micro),
        "packed_non_private": plain_step(model, packed, args.micro),
    }.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(step, args.repeats, device)
        row[f"{name}_tokens_per_s"] = tokens / seconds
        if device.type == "cuda":
            row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["padded_rows"], row["packed_rows"] = padded["input_ids"].shape[0], packed_rows.capacity // length
    row["packed_fill"] = packed_rows.fill
    row["packed_over_padded"] = row["packed_dp_tokens_per_s"] / row["padded_dp_tokens_per_s"]
    row["dp_over_non_private"] = row["packed_non_private_tokens_per_s"] / row["packed_dp_tokens_per_s"]
    return row


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of ``rows``."""
    lines = [
        f"Packed vs padded DP-SGD (ghost), {args.documents} documents, micro-batches of {args.micro} rows, "
        f"{args.device}; tokens/s of real tokens, best of {args.repeats}.",
        "",
        "| model | row | mix | tokens | padded DP tok/s | packed DP tok/s | packed / padded | packed non-private tok/s "
        "| DP step / non-private step | packed fill |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['row']} | {r['mix']} | {r['tokens']} | {r['padded_dp_tokens_per_s']:.0f} | {r['packed_dp_tokens_per_s']:.0f} "
            f"| {r['packed_over_padded']:.2f}× | {r['packed_non_private_tokens_per_s']:.0f} "
            f"| {r['dp_over_non_private']:.2f}× | {r['packed_fill']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure every mix and write results.json and table.md."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    machine = machine_info(device=args.device)
    rows: list[dict[str, Any]] = []
    for name in args.model:
        for length in args.row:
            for mix in args.mixes:
                rows.append(measure(args, name, length, mix))
                record = {"settings": settings, "machine": machine, "rows": rows}
                (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")  # what is measured so far
                (args.out / "table.md").write_text(table(rows, args))
    print(table(rows, args))


if __name__ == "__main__":
    main()
