"""``dplit lm generate``: DP synthetic text from a privately trained LM and PUBLIC control prompts."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any, BinaryIO

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dplit.data.batches import pad_token_rows
from dplit.data.files import read_records, records_to_rows
from dplit.flag_types import PositiveInteger, PositiveNumber, check, number_type
from dplit.privacy.composition import PER_UNIT
from dplit.release.checkpoint import check_checkpoint_file
from dplit.release.guarantee import GUARANTEE_FILE
from dplit.release.trained import load_trained


@dataclass(frozen=True)
class Prompt:
    """One public control prompt and, when the prompts file has one, the label it asks for."""

    text: str
    label: Any = None
    where: str | None = None
    """Where it is in the prompts file (``"line 3"``, or ``"item 3"`` of a JSON array), for messages."""


TopP = number_type("TopP", above=0, maximum=1)
"""Nucleus sampling's p: a finite number in (0, 1]."""


@dataclass(frozen=True)
class SamplingSettings:
    """How continuations are drawn, checked when the settings are made (one line naming the flag)."""

    num_samples: PositiveInteger = 1
    """Samples per prompt (at most :data:`MAX_SAMPLES` samples in all: prompts × ``--num_samples``)."""

    temperature: PositiveNumber = 1.0
    """Divides the logits before sampling: below 1 sharper, above 1 flatter."""

    top_p: TopP = 1.0
    """Nucleus sampling: draw from the fewest tokens whose probabilities sum to at least p (1: all tokens)."""

    max_new_tokens: PositiveInteger = 64
    """The most tokens a continuation gets (fewer where the model's positions run out)."""

    seed: int = 0
    """Seeds the sampling (the samples are public)."""

    batch_size: PositiveInteger = 16
    """Continuations drawn at once."""

    def __post_init__(self) -> None:
        ranges = (("num_samples", PositiveInteger), ("temperature", PositiveNumber), ("top_p", TopP),
                  ("max_new_tokens", PositiveInteger), ("batch_size", PositiveInteger))  # fmt: skip
        for field, kind in ranges:
            object.__setattr__(self, field, check(getattr(self, field), kind, flag=f"--{field}"))


def read_prompts(path: str | Path, *, prompt_column: str = "prompt", label_column: str = "label") -> list[Prompt]:
    """Prompts from a ``.txt`` (one per line), ``.jsonl``, ``.json`` or ``.csv`` file, read as training files are.

    The file is parsed by :func:`dplit.data.files.read_records` (the readers of ``data.train_file``): a CSV file
    has a header line, a JSON file holds an array of objects or JSON Lines, blank lines are skipped.

    Args:
        path: the prompts file (``--prompts_file``).
        prompt_column: the column of each prompt (``--prompt_column``; a ``.txt`` line is the prompt).
        label_column: the column of each prompt's label, kept in the output when present (``--label_column``).

    Raises:
        ValueError: naming ``--prompts_file`` (and the line or item) for a file that training would refuse (missing,
            not UTF-8, not JSON, a CSV quote left open, ...), a missing prompt column or an empty prompt.
    """
    file = Path(path).expanduser()
    columns = (prompt_column,)
    try:
        records = read_records(file, columns)
        texts = records_to_rows(file, records, columns, flag="--prompt_column").texts or []
    except ValueError as error:
        raise ValueError(f"--prompts_file {error}") from None
    prompts = []
    for record, text in zip(records, texts, strict=True):
        where = f"{record.unit} {record.number}"
        if not text.strip():
            raise ValueError(f"--prompts_file {file}, {where}: empty prompt (--prompt_column {prompt_column!r})")
        prompts.append(Prompt(text, record.columns.get(label_column), where))
    return prompts


def check_model_source(model: str | Path) -> None:
    """Refuse a ``--model`` that is neither a Hugging Face folder nor a checkpoint file (before any work)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: the folder has no config.json (not a Hugging Face model folder)")
    elif path.is_file():
        check_checkpoint_file(path, flag="--model")
    else:
        raise ValueError(f"--model {model}: no such file or folder")


def check_device(device: str | None) -> torch.device:
    """The device of ``--device`` (``None``: cuda when available, else cpu), refused when unknown or absent."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return chosen


def load_generator(model: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any] | None]:
    """The causal LM, its tokenizer and its guarantee, from an exported folder or a dplit checkpoint."""
    check_model_source(model)
    path = Path(model).expanduser()
    if path.is_dir():
        try:
            backbone = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as error:  # no weights, an unknown model type, no tokenizer files
            raise ValueError(
                f"--model {model}: transformers cannot load this folder as a causal LM with its tokenizer "
                f"({type(error).__name__}); give a folder written by dplit export or save_pretrained"
            ) from None
        card = path / GUARANTEE_FILE
        guarantee = json.loads(card.read_text()) if card.is_file() else None
    else:
        trained = load_trained(path, flag="--model")
        backbone, tokenizer, guarantee = trained.module.backbone, trained.tokenizer, trained.guarantee
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return backbone.eval(), tokenizer, guarantee


MAX_SAMPLES = 10_000_000
"""The most samples (prompts × ``--num_samples``) one ``dplit lm generate`` run draws: a typo such as
``--num_samples 1000000000`` is refused up front instead of running for weeks. Split a bigger job over several
``--seed`` values and output files."""


def check_sample_count(prompts: int, num_samples: int) -> int:
    """The samples a run draws (``prompts × num_samples``), refused above :data:`MAX_SAMPLES`.

    Raises:
        ValueError: naming ``--num_samples`` when the total exceeds :data:`MAX_SAMPLES`.
    """
    total = prompts * num_samples
    if total > MAX_SAMPLES:
        raise ValueError(
            f"--num_samples={num_samples}: {prompts} prompt(s) × {num_samples} = {total:,} samples, above the limit "
            f"of {MAX_SAMPLES:,} per run; draw fewer, or split the work over several --seed values and output files"
        )
    return total


def generate_batches(
    backbone: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    settings: SamplingSettings,
    *,
    progress: bool = True,
) -> Iterator[list[dict[str, Any]]]:
    """``settings.num_samples`` sampled continuations of every prompt, one batch of rows at a time.

    Batched with the KV cache and seeded per batch; the work is bounded (:func:`check_sample_count`) and checked
    (:func:`check_token_budget`) before the first batch, and never held in memory whole. Each batch's
    continuations are capped at what the model's positions leave after its longest prompt.

    Yields:
        The rows of one batch: ``prompt``, ``label`` (when the prompt has one), ``sample`` and ``text``.
    """
    total = check_sample_count(len(prompts), settings.num_samples)
    check_token_budget(backbone, tokenizer, prompts, settings.max_new_tokens)
    jobs = ((prompt, index) for prompt in prompts for index in range(settings.num_samples))
    with tqdm(total=total, desc="generating", unit="sample", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, total, settings.batch_size):
            batch = list(islice(jobs, settings.batch_size))
            texts = _sample(backbone, tokenizer, [prompt.text for prompt, _ in batch], settings, start)
            yield [_sample_row(prompt, index, text) for (prompt, index), text in zip(batch, texts, strict=True)]
            bar.update(len(batch))


def _sample_row(prompt: Prompt, index: int, text: str) -> dict[str, Any]:
    label = {} if prompt.label is None else {"label": prompt.label}
    return {"prompt": prompt.text, **label, "sample": index, "text": text}


def check_token_budget(
    backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], max_new_tokens: int
) -> None:
    """Warn once when ``--max_new_tokens`` will be capped by the model's positions; refuse a prompt that fills them.

    Raises:
        ValueError: naming ``--prompts_file`` and the line of the first prompt with as many tokens as the model
            has positions (no room for one new token).
    """
    limit = position_limit(backbone)
    if limit is None or not prompts:
        return
    lengths = [len(tokenizer.encode(prompt.text)) for prompt in prompts]
    for prompt, length in zip(prompts, lengths, strict=True):
        if length >= limit:
            raise ValueError(
                f"--prompts_file {prompt.where}: the prompt has {length} tokens, which leaves no room for "
                f"--max_new_tokens within the model's limit of {limit} positions (max_position_embeddings): shorten it"
            )
    if max(lengths) + max_new_tokens > limit:
        warnings.warn(
            f"--max_new_tokens={max_new_tokens} does not fit the model's limit of {limit} positions after the longest "
            f"prompt ({max(lengths)} tokens): each batch's continuations stop at {limit} tokens, prompt included",
            stacklevel=2,
        )


def position_limit(backbone: PreTrainedModel) -> int | None:
    """The most tokens (prompt and continuation) the model has positions for (``None``: no limit known)."""
    return getattr(backbone.config, "max_position_embeddings", None)


@torch.no_grad()
def _sample(
    backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], settings: SamplingSettings,
    offset: int,
) -> list[str]:  # fmt: skip
    """One batch, left-padded; the seed depends on ``settings.seed`` and the batch's offset only."""
    encoded = [tokenizer.encode(text) for text in texts]  # as training encoded a prompt
    pad = tokenizer.pad_token_id
    input_ids, attention_mask = pad_token_rows(encoded, pad, "left")  # [B, T] each
    width = input_ids.shape[1]
    limit = position_limit(backbone)
    max_new_tokens = settings.max_new_tokens if limit is None else min(settings.max_new_tokens, limit - width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed * 1_000_003 + offset)
        out = backbone.generate(
            input_ids=input_ids.to(backbone.device),
            attention_mask=attention_mask.to(backbone.device),
            do_sample=True,
            temperature=float(settings.temperature),
            top_p=float(settings.top_p),
            top_k=0,
            max_new_tokens=max_new_tokens,
            use_cache=True,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )  # [B, T + new]
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while samples were being written; its message says what was kept (the line the command prints)."""


def partial_file(output_file: str | Path) -> Path:
    """Where samples go while they are drawn: ``OUT.partial``, renamed to ``OUT`` when the last one is written."""
    path = Path(output_file).expanduser()
    return path.with_name(f"{path.name}.partial")


def write_samples(batches: Iterable[list[dict[str, Any]]], output_file: str | Path) -> tuple[Path, int]:
    """Stream ``batches`` of rows as JSON lines to ``OUT.partial``, each batch written through, then rename it ``OUT``.

    The first batch is drawn before the file is opened, so a refusal writes nothing. ``OUT.partial`` holds only
    whole rows at every batch's end, and is kept (cut back to its last whole row) when drawing stops early.

    Returns:
        The output file and the number of rows written.

    Raises:
        Interrupted: on Ctrl-C after the first batch, naming ``OUT.partial`` and the rows it keeps.
    """
    path, partial = Path(output_file).expanduser(), partial_file(output_file)
    batches = iter(batches)
    first = next(batches, [])
    with partial.open("wb", buffering=0) as file:  # unbuffered: every batch reaches the file as it is written
        count = _append_rows(file, chain([first], batches), partial, path)
    os.replace(partial, path)
    return path, count


def _append_rows(file: BinaryIO, batches: Iterator[list[dict[str, Any]]], partial: Path, path: Path) -> int:
    """Write the rows of ``batches`` to ``file``; on any exception, cut it back to its last whole row and say so."""
    count = written = 0
    try:
        for rows in batches:
            data = memoryview("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode())
            while data:
                data = data[file.write(data) :]
            written, count = file.tell(), count + len(rows)
    except BaseException as error:
        file.truncate(written)
        kept = f"kept the {count} samples drawn so far in {partial} (JSON lines; {path} was not written)"
        if isinstance(error, KeyboardInterrupt):
            raise Interrupted(kept) from None
        warnings.warn(f"generation stopped: {kept}", stacklevel=2)
        raise
    return count


def check_output_file(output_file: str | Path, *, overwrite: bool) -> None:
    """Refuse an output file (or its ``.partial`` file) that exists, unless ``overwrite``, or whose folder does not."""
    path = Path(output_file).expanduser()
    if path.is_dir():
        raise ValueError(f"--output_file {output_file}: is a folder")
    if path.exists() and not overwrite:
        raise ValueError(f"--output_file {output_file}: exists (pass --overwrite to replace it)")
    if partial_file(path).exists() and not overwrite:
        raise ValueError(
            f"--output_file {output_file}: {partial_file(path)} exists (the samples an interrupted run kept): "
            "move it away, or pass --overwrite to replace it"
        )
    if not path.parent.is_dir():
        raise ValueError(f"--output_file {output_file}: its folder does not exist")


def privacy_line(guarantee: dict[str, Any] | None, count: int) -> str:
    """What the command prints: the samples are exactly as private as the model (post-processing)."""
    if guarantee is None:
        return f"the {count} samples' privacy is UNKNOWN: the model folder has no {GUARANTEE_FILE}"
    if not guarantee.get("differentially_private"):
        return f"the {count} samples are NOT differentially private: the model is not ({guarantee.get('reason')})"
    unit = guarantee.get("protected_unit", "user" if "users" in guarantee else "example")
    return (
        f"the {count} samples are (ε = {guarantee['epsilon']:.4g}, δ = {guarantee['delta']:.3g})-differentially "
        f"private {PER_UNIT.get(unit, PER_UNIT['example'])}, as the model is (post-processing of its "
        "weights and public prompts only)"
    )
