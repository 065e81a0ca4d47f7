"""Building the causal LM under a dplit model: any ``AutoModelForCausalLM``, pretrained (hub, folder, GGUF) or random."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dplit.backbone.quantization import announce_quantized_base, keep_weights_as_loaded
from dplit.numbers import is_finite_number

DROPOUT_SETTINGS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")
"""Config keys that hold a dropout probability in the causal LM families dplit trains (GPT-2, Llama, Qwen2, ...)."""

DEFAULT_MODEL_TYPE = "gpt2"
"""The family of a ``model.config`` that names no ``model_type`` (the configs written before other families)."""

COMMON_FAMILIES = ("gpt2", "llama", "qwen2", "mistral")
"""The families an unknown ``model_type`` message lists (the ones dplit's tests train)."""


def build_causal_lm(
    *,
    pretrained: str | None,
    gguf_file: str | None,
    config: dict[str, Any] | None,
    vocab_size: int | None,
    dropout: float | None,
    attn_implementation: str,
    quantization: BitsAndBytesConfig | None = None,
) -> PreTrainedModel:
    """A causal LM in float32, from a checkpoint or, for tests, from a config with random weights.

    Args:
        pretrained: hub name or local folder that ``AutoModelForCausalLM.from_pretrained`` loads.
        gguf_file: a GGUF file inside ``pretrained`` (a folder), loaded with transformers' GGUF support.
        config: keyword arguments of the family's config class, with ``model_type`` (default ``"gpt2"``).
        vocab_size: the tokenizer's size; sets a config-built vocabulary, is checked against a checkpoint's.
        dropout: overrides every dropout probability of the config (``None`` keeps the checkpoint's).
        attn_implementation: transformers attention kernel (``"eager"`` or ``"sdpa"``).
        quantization: bitsandbytes quantisation of a ``pretrained`` model's linear layers as they load (the rest
            stays float32).

    Raises:
        ValueError: naming ``model.pretrained`` / ``model.config`` / ``model.gguf_file`` when they do not load.
    """
    if (pretrained is None) == (config is None):
        raise ValueError("set exactly one of model.pretrained (hub name or folder) and model.config (a model config)")
    if dropout is not None:
        check_probability("model.dropout", dropout)
    if pretrained is None:
        if gguf_file is not None:
            raise ValueError("model.gguf_file needs model.pretrained: the folder holding the GGUF file")
        model = _random_model(dict(config or {}), vocab_size, dropout, attn_implementation)
        refuse_rewritten_rope(model, "model.config")
        return model
    model = _pretrained_model(pretrained, gguf_file, dropout, attn_implementation, quantization)
    refuse_rewritten_rope(model, f"model.pretrained={pretrained!r}")
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size is not None and vocab_size > rows:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens but model.pretrained={pretrained!r} has only {rows} embeddings"
        )
    return model


def downloaded_folder(name: str, *, cache_dir: str | Path | None = None, fetch: tuple[str, ...] = ()) -> Path | None:
    """The local snapshot folder a hub model's files were downloaded to (``None``: not a downloaded hub model).

    Args:
        name: the hub name ``from_pretrained`` loaded.
        cache_dir: the hub cache (default: Hugging Face's).
        fetch: further files of the repository to download beside the weights when it has them (offline or
            absent: skipped), e.g. dplit's ``dp_guarantee.json``.
    """
    config = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir)
    if not isinstance(config, str):
        return None
    for filename in fetch:
        try:
            hf_hub_download(name, filename, cache_dir=cache_dir)
        except Exception:  # noqa: BLE001  absent, offline, unreachable: without the file a marked export stays not private
            continue
    return Path(config).parent


REWRITTEN_ROPE_TYPES = ("longrope",)
"""Rotary settings whose embedding overwrites its ``inv_freq`` buffer in place in every forward (transformers'
``dynamic_rope_update``: longrope picks the short or long factors by the batch's length). ``dynamic`` rewrites
it only past ``max_position_embeddings``, which ``data.max_length`` may not exceed."""


def refuse_rewritten_rope(model: PreTrainedModel, flag: str) -> None:
    """Refuse, at construction, a rotary embedding that :data:`REWRITTEN_ROPE_TYPES` names (before any DP step).

    Raises:
        ValueError: naming ``flag``, the rope type and the module.
    """
    for name, module in model.named_modules():
        rope_type = getattr(module, "rope_type", None)
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]  # per layer type (Gemma-style)
        found = next((kind for kind in types if kind in REWRITTEN_ROPE_TYPES), None)
        if found is not None:
            raise ValueError(
                f"{flag}: rope type {found!r} (backbone.{name}) rewrites its rotary frequencies (inv_freq) in place "
                "in every forward, chosen by the batch's length, so private data would change the model's state with "
                "no noise and DP-SGD cannot train it; use a model without this rope_scaling"
            )


def _random_model(
    settings: dict[str, Any], vocab_size: int | None, dropout: float | None, attn_implementation: str
) -> PreTrainedModel:
    config = _random_config(settings, vocab_size)
    _set_dropout(config, dropout)
    config._attn_implementation = attn_implementation
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    except ValueError as error:  # e.g. a width the number of heads does not divide
        raise ValueError(f"model.config: {' '.join(str(error).split())}") from error


def _random_config(settings: dict[str, Any], vocab_size: int | None) -> PretrainedConfig:
    """The family's config built from ``model.config``, whose every key and dropout probability is checked."""
    model_type = settings.pop("model_type", DEFAULT_MODEL_TYPE)
    defaults = _default_config(model_type)
    given = dict(settings)
    if vocab_size is not None:
        settings["vocab_size"] = vocab_size
    settings.update(_special_token_ids(defaults, settings))
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except (StrictDataclassError, ValueError, TypeError) as error:
        raise ValueError(_config_error(error, given)) from error
    _check_known_keys(set(given), config, defaults)
    for key in DROPOUT_SETTINGS:
        if key in given:
            check_probability(f"model.config.{key}", given[key])
    return config


def _default_config(model_type: str) -> PretrainedConfig:
    """A default instance of the family's config class, refusing a ``model_type`` with no causal LM."""
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CONFIG_MAPPING[model_type]()
    common = f"common families: {', '.join(COMMON_FAMILIES)}"
    if model_type in CONFIG_MAPPING:
        raise ValueError(f"model.config: model_type {model_type!r} has no causal LM in transformers ({common})")
    close = difflib.get_close_matches(str(model_type).lower(), list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
    hint = f"did you mean {_one_of(close)}? " if close else ""
    raise ValueError(f"model.config: unknown model_type {model_type!r} ({hint}{common})")


def _config_error(error: Exception, given: dict[str, Any]) -> str:
    """Transformers' (multi-line) validation error of a config as one line naming the ``model.config`` key."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = re.sub(r"^\w+Error: ", "", lines[-1]).split(" Errors:")[0].rstrip(".")
    detail = re.sub(r"<class '(\w+)'>", r"\1", detail)
    field = re.search(r"field '([^']+)'", lines[0])
    if field is None or field[1] not in given:
        return f"model.config: {detail}"
    key = field[1]
    detail = re.sub(rf"^Field '{re.escape(key)}' (with value .*? )?", "", detail)
    return f"model.config.{key}={given[key]!r}: {detail}"


def _one_of(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _special_token_ids(defaults: PretrainedConfig, settings: dict[str, Any]) -> dict[str, Any]:
    """The family's BOS/EOS ids moved inside a (tiny) vocabulary, for the ids ``settings`` leaves unset.

    They go into the config's keyword arguments, so that transformers never sees an id outside the vocabulary
    (it warns on construction).
    """
    last_token = settings.get("vocab_size", defaults.vocab_size) - 1
    ids = {}
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(defaults, key, None)
        if key not in settings and hasattr(defaults, key) and (value is None or isinstance(value, int)):
            ids[key] = min(value or last_token, last_token)
    return ids


def _check_known_keys(given: set[str], config: PretrainedConfig, defaults: PretrainedConfig) -> None:
    """Refuse the keys of ``model.config`` that transformers merely stored as attributes its family never reads.

    A config class accepts any keyword: a key that is neither one of its fields, an ``attribute_map`` alias
    (``num_hidden_layers`` for GPT-2's ``n_layer``) nor a keyword it consumes (``rope_theta``, ``num_labels``)
    ends up as a new attribute, which is how a typo such as ``n_layers`` would silently train the default depth.
    """
    stored = set(config.to_dict()) - set(defaults.to_dict())
    unknown = sorted(given & stored)
    if not unknown:
        return
    known = [key for key in (*defaults.to_dict(), *type(defaults).attribute_map) if not key.startswith("_")]
    family = f"model_type {defaults.model_type!r}"
    if len(unknown) == 1:
        raise ValueError(f"model.config: unknown key {unknown[0]!r} for {family}{_did_you_mean(unknown[0], known)}")
    parts = [f"{key!r}{_did_you_mean(key, known)}" for key in unknown]
    raise ValueError(f"model.config: unknown keys for {family}: {', '.join(parts)}")


def _did_you_mean(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if key in DROPOUT_SETTINGS:
        return " (did you mean model.dropout, which sets every dropout probability?)"
    return ""


def check_probability(flag: str, value: object) -> None:
    """Refuse a dropout probability outside [0, 1] (or not a number), naming ``flag``."""
    if not is_finite_number(value, minimum=0, maximum=1):
        raise ValueError(f"{flag}={value!r}: must be a probability in [0, 1]")


def _pretrained_model(
    pretrained: str,
    gguf_file: str | None,
    dropout: float | None,
    attn_implementation: str,
    quantization: BitsAndBytesConfig | None,
) -> PreTrainedModel:
    source = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if gguf_file is not None:
        check_gguf_file(pretrained, gguf_file, "model")
    folder = Path(pretrained).expanduser()
    if gguf_file is None and folder.is_dir() and not (folder / "config.json").is_file():
        raise ValueError(
            f"model.pretrained={pretrained!r}: the folder is not a model folder (no config.json); give a folder "
            "saved with save_pretrained (or a dplit export), or a GGUF file in it with model.gguf_file"
        )
    try:
        config = AutoConfig.from_pretrained(pretrained, **source)
    except OSError as error:
        raise ValueError(unloadable_message(pretrained, "model.pretrained", error)) from error
    _set_dropout(config, dropout)
    if quantization is not None:  # loaded where it will train: a quantised model is moved, never re-quantised
        source.update(quantization_config=quantization, device_map=_quantized_device())
    model = AutoModelForCausalLM.from_pretrained(
        pretrained, config=config, attn_implementation=attn_implementation, dtype=torch.float32, **source
    )
    keep_weights_as_loaded(model)
    if quantization is not None:
        announce_quantized_base(quantization, pretrained)
    return model.train()  # from_pretrained returns eval mode; Lightning switches modes from here


def _quantized_device() -> dict[str, Any]:
    """The ``device_map`` of a quantised base: this process's GPU (``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return {"": "cpu"}


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


def unloadable_message(name: str, flag: str, error: Exception, what: str = "model") -> str:
    """The message for a checkpoint (``what``: or a dataset) that neither exists as a folder nor loads from the hub.

    A file given where the folder is expected is named as a file (a GGUF file: with the flags that load it).
    """
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            side = flag.split(".")[0]
            return (
                f"{flag}={name!r}: is a GGUF file, expected its folder; set {flag}={str(path.parent)!r} and "
                f"{side}.gguf_file={path.name!r} (data.tokenizer and data.gguf_file the same)"
            )
        return f"{flag}={name!r}: is a file, expected a {what} folder"
    if path.exists() or name.startswith((".", "/", "~")):
        folder = "is not a model folder (no config.json)" if what == "model" else f"is not a {what} folder"
        where = folder if Path(name).is_dir() else "does not exist"
        return f"{flag}={name!r}: the folder {where}"
    return f"{flag}={name!r} could not be loaded from the Hugging Face hub (offline, or no such {what}): {error}"
