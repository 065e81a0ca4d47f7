"""A quantised frozen base (QLoRA): bitsandbytes 4-bit (NF4/FP4) or 8-bit linear layers under peft adapters.

``model.quantization`` is a transformers ``BitsAndBytesConfig`` as a dict, applied when ``model.pretrained`` is
loaded. bitsandbytes quantises the ``nn.Linear`` layers of the transformer blocks; the input embedding and the
LM head stay in float, so a tied or trained embedding is exact. A quantised layer is frozen: only adapters (and,
with ``model.train_embeddings``, the embedding) train, and its integer weights never change.

The quantised weights are the base model's: checkpoints leave them out (they are reloaded, bit for bit, from
``model.pretrained`` on resume and export), which also keeps a checkpoint the size of what was trained.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from transformers import BitsAndBytesConfig

FLAG = "model.quantization"
QUANTIZED_PARAMETER_TYPES = ("Params4bit", "Int8Params")
"""bitsandbytes' parameter classes of a quantised weight (named, so bitsandbytes is imported only when used)."""
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
QUANT_TYPES = ("nf4", "fp4")


def quantization_config(settings: dict[str, Any]) -> BitsAndBytesConfig:
    """The ``BitsAndBytesConfig`` that ``model.quantization`` describes, checked key by key.

    Raises:
        ValueError: in one line naming ``model.quantization`` (and the key) for a missing bitsandbytes, an unknown
            key, neither or both of ``load_in_4bit`` / ``load_in_8bit``, or a value bitsandbytes does not know.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"{FLAG} needs the 'bitsandbytes' package: pip install 'dplit[qlora]' (or bitsandbytes)")
    known = [
        name for name in inspect.signature(BitsAndBytesConfig.__init__).parameters if name not in ("self", "kwargs")
    ]
    for key in settings:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{FLAG}: unknown key {key!r}{hint}; known keys: {', '.join(known)}")
    if bool(settings.get("load_in_4bit")) == bool(settings.get("load_in_8bit")):
        raise ValueError(f"{FLAG}: set exactly one of load_in_4bit: true (NF4/FP4) and load_in_8bit: true")
    _check_choice(settings, "bnb_4bit_quant_type", QUANT_TYPES)
    _check_choice(settings, "bnb_4bit_compute_dtype", COMPUTE_DTYPES)
    return BitsAndBytesConfig(**settings)


PER_CALL_LOGGERS = ("bitsandbytes.autograd._functions", "bitsandbytes.nn.modules")
"""bitsandbytes' loggers that repeat a warning on every quantised layer's every call (the 8-bit input cast: 16 lines
in 2 steps of a tiny model); each of their messages is shown once per process."""


class FirstOfEachMessage(logging.Filter):
    """Let through the first record of each message template, and drop its repeats."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is the first of its template (``record.msg``, before its arguments)."""
        template = str(record.msg)
        if template in self._seen:
            return False
        self._seen.add(template)
        return True


def announce_quantized_base(config: BitsAndBytesConfig, pretrained: str) -> None:
    """Say that ``model.pretrained`` is loaded quantised (frozen); show bitsandbytes' per-call warnings once."""
    if config.load_in_8bit:
        kind = "8-bit (LLM.int8)"
    else:
        compute = str(config.bnb_4bit_compute_dtype).removeprefix("torch.")
        kind = f"4-bit {config.bnb_4bit_quant_type}, compute {compute}"
    rank_zero_info(f"{FLAG}: model.pretrained={pretrained!r} is loaded as a bitsandbytes {kind} base, frozen")
    for name in PER_CALL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, FirstOfEachMessage) for existing in logger.filters):
            logger.addFilter(FirstOfEachMessage())


def _check_choice(settings: dict[str, Any], key: str, choices: tuple[str, ...]) -> None:
    if key in settings and settings[key] not in choices:
        raise ValueError(f"{FLAG}.{key} must be one of {', '.join(choices)}, got {settings[key]!r}")


def check_quantization_source(*, pretrained: str | None, gguf_file: str | None, peft: object | None) -> None:
    """Refuse a quantised base that is not loaded from ``model.pretrained``, or one with nothing but itself to train.

    Raises:
        ValueError: in one line naming ``model.quantization`` and the flag it needs or excludes.
    """
    if pretrained is None:
        raise ValueError(
            f"{FLAG} needs model.pretrained (a hub name or a folder): bitsandbytes quantises weights as they load"
        )
    if gguf_file is not None:
        raise ValueError(f"{FLAG} cannot quantise a GGUF file (model.gguf_file): give a float model folder or hub name")
    if peft is None:
        raise ValueError(
            f"{FLAG} needs model.peft (e.g. LoRA): a quantised base is frozen, so only adapters (and, with "
            "model.train_embeddings, the embedding) can train"
        )


def keep_weights_as_loaded(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for its AVX512-BF16 CPU kernel in no-grad forwards.

    That kernel rewrites a layer's weight and quantisation state in place (its scales rounded to bf16) the first
    time the layer runs without gradients, e.g. in validation: the frozen base would change under the adapters
    and evaluation would see other weights than training. Every forward then takes the unpacked path.
    """
    for _, layer in quantized_modules(model):
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False


def is_quantized(param: Tensor) -> bool:
    """Whether ``param`` is a bitsandbytes quantised weight."""
    return type(param).__name__ in QUANTIZED_PARAMETER_TYPES


def quantized_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every layer holding a quantised weight."""
    for name, sub in module.named_modules():
        if any(is_quantized(p) for p in sub.parameters(recurse=False)):
            yield name, sub


def refuse_trainable_quantized(module: nn.Module, *, prefix: str = "") -> None:
    """Refuse, naming it, a trainable parameter of a quantised layer (e.g. its bias): those layers stay frozen."""
    for name, layer in quantized_modules(module):
        for param_name, param in layer.named_parameters(recurse=False):
            if param.requires_grad:
                raise ValueError(
                    f"{FLAG}: {prefix}{name}.{param_name} belongs to a quantised layer and is trainable; quantised "
                    "layers stay frozen (train adapters with model.peft; freeze it with model.freeze)"
                )


def drop_quantized_weights(module: nn.Module, state_dict: MutableMapping[str, Any]) -> None:
    """Remove every quantised layer's weight (and bitsandbytes' quantisation state) from ``state_dict``."""
    for name, _ in quantized_modules(module):
        for key in [key for key in state_dict if key.startswith(f"{name}.weight")]:
            del state_dict[key]


def add_quantized_weights(module: nn.Module, state_dict: MutableMapping[str, Any]) -> None:
    """Put ``module``'s own quantised weights (reloaded from the base) into a ``state_dict`` saved without them."""
    for name, layer in quantized_modules(module):
        for param_name, param in layer.named_parameters(recurse=False):
            if is_quantized(param):
                state_dict.setdefault(f"{name}.{param_name}", param)
