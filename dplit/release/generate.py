"""``dplit lm generate``: DP synthetic text from a privately trained LM and PUBLIC control prompts."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dplit.release.guarantee import GUARANTEE_FILE
from dplit.release.trained import check_checkpoint_file, load_trained


@dataclass(frozen=True)
class Prompt:
    """One public control prompt and, when the prompts file has one, the label it asks for."""

    text: str
    label: Any = None
    line: int | None = None


@dataclass(frozen=True)
class SamplingSettings:
    """How continuations are drawn (checked on construction, naming the flag)."""

    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    batch_size: int = 16

    def __post_init__(self) -> None:
        for flag, value in (("num_samples", self.num_samples), ("max_new_tokens", self.max_new_tokens),
                            ("batch_size", self.batch_size)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{flag}={value!r}: must be an integer ≥ 1")
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0
        ):
            raise ValueError(f"--temperature={self.temperature!r}: must be a finite number > 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"--top_p={self.top_p!r}: must be in (0, 1]")


def read_prompts(path: str | Path, *, prompt_column: str = "prompt", label_column: str = "label") -> list[Prompt]:
    """Prompts from a ``.jsonl`` file (``prompt_column``, optional ``label_column``) or a text file (one per line).

    Raises:
        ValueError: naming ``--prompts_file`` (and the row) for a missing or empty file, a row that is not a JSON
            object, or a row without ``prompt_column``.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--prompts_file {path}: no such file")
    lines = [(number, line) for number, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"--prompts_file {path}: no prompts (the file is empty)")
    if file.suffix.lower() != ".jsonl":
        return [Prompt(line.strip(), line=number) for number, line in lines]
    prompts = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"--prompts_file {path} line {number}: not a JSON object") from None
        if not isinstance(row, dict):
            raise ValueError(f"--prompts_file {path} line {number}: not a JSON object")
        if not isinstance(row.get(prompt_column), str) or not row[prompt_column]:
            raise ValueError(
                f"--prompts_file {path} line {number}: no non-empty text column {prompt_column!r} (--prompt_column)"
            )
        prompts.append(Prompt(row[prompt_column], row.get(label_column), number))
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


def generate_rows(
    backbone: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    settings: SamplingSettings,
    *,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """``settings.num_samples`` sampled continuations of every prompt, batched with the KV cache, seeded per batch.

    Each batch's continuations are capped at what the model's positions leave after its longest prompt (see
    :func:`check_token_budget`).
    """
    check_token_budget(backbone, tokenizer, prompts, settings.max_new_tokens)
    jobs = [(prompt, index) for prompt in prompts for index in range(settings.num_samples)]
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(jobs), desc="generating", unit="sample", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, len(jobs), settings.batch_size):
            batch = jobs[start : start + settings.batch_size]
            texts = _sample(backbone, tokenizer, [prompt.text for prompt, _ in batch], settings, start)
            for (prompt, index), text in zip(batch, texts):
                label = {} if prompt.label is None else {"label": prompt.label}
                rows.append({"prompt": prompt.text, **label, "sample": index, "text": text})
            bar.update(len(batch))
    return rows


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
    for prompt, length in zip(prompts, lengths):
        if length >= limit:
            raise ValueError(
                f"--prompts_file line {prompt.line}: the prompt has {length} tokens, which leaves no room for "
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
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])  # [B, T]
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])  # [B, T]
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


def write_jsonl(rows: list[dict[str, Any]], output_file: str | Path) -> Path:
    """Write ``rows`` as JSON lines, atomically (a partial file never replaces a finished one)."""
    path = Path(output_file).expanduser()
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    os.replace(temporary, path)
    return path


def check_output_file(output_file: str | Path, *, overwrite: bool) -> None:
    """Refuse an output file that exists (unless ``overwrite``) or whose folder does not."""
    path = Path(output_file).expanduser()
    if path.is_dir():
        raise ValueError(f"--output_file {output_file}: is a folder")
    if path.exists() and not overwrite:
        raise ValueError(f"--output_file {output_file}: exists (pass --overwrite to replace it)")
    if not path.parent.is_dir():
        raise ValueError(f"--output_file {output_file}: its folder does not exist")


def privacy_line(guarantee: dict[str, Any] | None, count: int) -> str:
    """What the command prints: the samples are exactly as private as the model (post-processing)."""
    if guarantee is None:
        return f"the {count} samples' privacy is UNKNOWN: the model folder has no {GUARANTEE_FILE}"
    if not guarantee.get("differentially_private"):
        return f"the {count} samples are NOT differentially private: the model is not ({guarantee.get('reason')})"
    return (
        f"the {count} samples are (ε = {guarantee['epsilon']:.4g}, δ = {guarantee['delta']:.3g})-differentially "
        "private per training example, as the model is (post-processing of its weights and public prompts only)"
    )
