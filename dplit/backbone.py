"""Building the causal LM under a dplit model: any ``AutoModelForCausalLM``, pretrained (hub, folder, GGUF) or random."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

DROPOUT_SETTINGS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")
"""Config keys that hold a dropout probability in the causal LM families dplit trains (GPT-2, Llama, Qwen2, ...)."""

DEFAULT_MODEL_TYPE = "gpt2"
"""The family of a ``model.config`` that names no ``model_type`` (the configs written before other families)."""


def build_causal_lm(
    *,
    pretrained: str | None,
    gguf_file: str | None,
    config: dict[str, Any] | None,
    vocab_size: int | None,
    dropout: float | None,
    attn_implementation: str,
) -> PreTrainedModel:
    """A causal LM in float32, from a checkpoint or, for tests, from a config with random weights.

    Args:
        pretrained: hub name or local folder that ``AutoModelForCausalLM.from_pretrained`` loads.
        gguf_file: a GGUF file inside ``pretrained`` (a folder), loaded with transformers' GGUF support.
        config: keyword arguments of the family's config class, with ``model_type`` (default ``"gpt2"``).
        vocab_size: the tokenizer's size; sets a config-built vocabulary, is checked against a checkpoint's.
        dropout: overrides every dropout probability of the config (``None`` keeps the checkpoint's).
        attn_implementation: transformers attention kernel (``"eager"`` or ``"sdpa"``).

    Raises:
        ValueError: naming ``model.pretrained`` / ``model.config`` / ``model.gguf_file`` when they do not load.
    """
    if (pretrained is None) == (config is None):
        raise ValueError("set exactly one of model.pretrained (hub name or folder) and model.config (a model config)")
    if pretrained is None:
        if gguf_file is not None:
            raise ValueError("model.gguf_file needs model.pretrained: the folder holding the GGUF file")
        return _random_model(dict(config or {}), vocab_size, dropout, attn_implementation)
    model = _pretrained_model(pretrained, gguf_file, dropout, attn_implementation)
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size is not None and vocab_size > rows:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but model.pretrained={pretrained!r} has only {rows} embeddings")
    return model


def _random_model(
    settings: dict[str, Any], vocab_size: int | None, dropout: float | None, attn_implementation: str
) -> PreTrainedModel:
    model_type = settings.pop("model_type", DEFAULT_MODEL_TYPE)
    if vocab_size is not None:
        settings["vocab_size"] = vocab_size
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except ValueError as error:
        raise ValueError(f"model.config: unknown model_type {model_type!r} ({error})") from error
    last_token = config.vocab_size - 1  # keep special ids inside a tiny vocabulary
    for key in ("bos_token_id", "eos_token_id"):
        if key not in settings:
            setattr(config, key, min(getattr(config, key, None) or last_token, last_token))
    _set_dropout(config, dropout)
    config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


def _pretrained_model(
    pretrained: str, gguf_file: str | None, dropout: float | None, attn_implementation: str
) -> PreTrainedModel:
    source = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if gguf_file is not None:
        check_gguf_file(pretrained, gguf_file, "model")
    try:
        config = AutoConfig.from_pretrained(pretrained, **source)
    except OSError as error:
        raise ValueError(unloadable_message(pretrained, "model.pretrained", error)) from error
    _set_dropout(config, dropout)
    model = AutoModelForCausalLM.from_pretrained(
        pretrained, config=config, attn_implementation=attn_implementation, dtype=torch.float32, **source
    )
    return model.train()  # from_pretrained returns eval mode; Lightning switches modes from here


def _set_dropout(config: PretrainedConfig, dropout: float | None) -> None:
    if dropout is None:
        return
    for key in DROPOUT_SETTINGS:
        if hasattr(config, key):
            setattr(config, key, dropout)


def check_gguf_file(folder: str, gguf_file: str, flag_prefix: str) -> None:
    """Refuse a GGUF file that is missing, or the missing ``gguf`` package, naming the flag or the package."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(
            f"{flag_prefix}.gguf_file={gguf_file!r} needs the 'gguf' package: pip install 'dplit[gguf]' (or gguf)"
        )
    path = Path(folder) / gguf_file
    if not path.is_file():
        raise ValueError(f"{flag_prefix}.gguf_file: {path} is not a file")


def unloadable_message(name: str, flag: str, error: Exception) -> str:
    """The message for a checkpoint that neither exists as a folder nor loads from the hub."""
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        where = "is not a model folder (no config.json)" if Path(name).is_dir() else "does not exist"
        return f"{flag}={name!r}: the folder {where}"
    return f"{flag}={name!r} could not be loaded from the Hugging Face hub (offline, or no such model): {error}"
