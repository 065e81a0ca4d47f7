"""Parameter-efficient fine-tuning: peft adapters (LoRA, ...) in the backbone, beside a trained or frozen embedding.

The adapters are injected into the causal LM in place (``peft.inject_adapter_in_model``), so the backbone stays the
``transformers`` model it was and every dplit forward runs unchanged; peft freezes every base weight. Whether DP can
clip the adapters exactly is the clipping engine's call: ghost clipping covers LoRA's ``lora_A``/``lora_B``
(plain ``nn.Linear`` layers, also on GPT-2's ``Conv1D``) and refuses, by name, any adapter parameter no rule covers.
"""

from __future__ import annotations

import importlib
import json
import sys
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, fields
from enum import Enum
from types import ModuleType
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from dplit.backbone.embeddings import embedding_pair, is_tied

MISSING_PEFT = "model.peft needs the 'peft' package, which is not installed: pip install peft"


class AdapterConfig(metaclass=ABCMeta):
    """``model.peft``'s type: any peft config class (``peft.PeftConfig`` and its subclasses, e.g. ``peft.LoraConfig``).

    ``issubclass(peft.LoraConfig, AdapterConfig)`` holds without dplit importing peft: such a class exists only once
    peft is imported, and the check then defers to ``peft.PeftConfig``. So a run without ``model.peft`` never imports
    peft, nor the ``bitsandbytes`` package peft imports when it is installed (≈ 1.6 s of every ``dplit`` start on a
    CPU). Short class names (``class_path: LoraConfig``) and ``--help`` list peft's configs, importing peft then.
    (``ABCMeta`` without ``abc.ABC`` as a base: ``issubclass(peft.LoraConfig, abc.ABC)`` stays false.)
    """

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The config's fields (what dplit reads of a peft config; abstract, so this type itself is never built)."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        """Whether ``subclass`` is this type or a peft config class (of ``peft.PeftConfig``, once peft is imported)."""
        if cls in getattr(subclass, "__mro__", ()):
            return True
        peft_config = getattr(sys.modules.get("peft.config"), "PeftConfig", None)
        return isinstance(peft_config, type) and issubclass(subclass, peft_config)

    @classmethod
    def __subclasses__(cls) -> list[type]:  # type: ignore[override]
        """``[peft.PeftConfig]``, importing peft (``[]`` without it): jsonargparse walks these for names and help."""
        try:
            return [imported_peft().PeftConfig]
        except ValueError:
            return []


def peft_importable() -> bool:
    """Whether ``import peft`` succeeds here (it is imported if so)."""
    try:
        imported_peft()
    except ValueError:
        return False
    return True


def imported_peft() -> ModuleType:
    """The ``peft`` module, imported now if it was not.

    Raises:
        ValueError: :data:`MISSING_PEFT` when peft cannot be imported.
    """
    try:
        import peft
    except ImportError as error:  # dplit runs without peft; a model.peft value is then refused naming the package
        raise ValueError(MISSING_PEFT) from error
    return peft


@dataclass(frozen=True)
class TrainableCounts:
    """How many trainable parameters (elements) are adapters, input/output embeddings, or anything else."""

    adapter: int
    embedding: int
    other: int
    frozen: int

    def describe(self) -> str:
        """One line for the start of a run: ``trainable parameters: 4,608 adapter, 0 embedding, 0 other (9,344 frozen)``."""
        return (
            f"trainable parameters: {self.adapter:,} adapter, {self.embedding:,} embedding, {self.other:,} other "
            f"({self.frozen:,} frozen)"
        )


def adapter_hyperparameter(config: Any) -> dict[str, Any]:
    """``{class_path, init_args}`` of a peft config in plain types (lists, strings), as a checkpoint should keep it.

    ``torch.load(weights_only=True)``, which Lightning uses to resume, refuses pickled peft classes and enums.
    """
    config = adapter_config(config)
    kind = type(config)
    values = json.loads(json.dumps(config.to_dict(), default=_plain))
    names = {field.name for field in fields(config) if field.init}
    init_args = {key: value for key, value in values.items() if key in names}
    return {"class_path": f"{kind.__module__}.{kind.__qualname__}", "init_args": init_args}


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"model.peft: {type(value).__name__} values cannot be kept in a checkpoint")


def apply_adapters(model: PreTrainedModel, config: Any, *, train_embeddings: bool) -> None:
    """Inject the adapters of peft ``config`` into ``model`` (base weights frozen), then set the embeddings.

    Args:
        model: the causal LM, its embedding policy already applied (a tied weight stays one Parameter).
        config: a ``peft.PeftConfig`` of an adapter method (LoRA, IA3, ...; not a prompt-learning method).
        train_embeddings: whether the input and output embedding (tied: the one shared matrix) are trained
            beside the adapters.

    Raises:
        ValueError: naming ``model.peft`` when peft is missing, ``config`` is not a peft adapter config, its
            ``target_modules`` match no module of the model, it sets an option dplit cannot train
            (:data:`UNTRAINABLE_OPTIONS`), or a ``modules_to_save`` copy of an embedding would not be trained as
            asked (see :func:`check_saved_copies`).
    """
    config = adapter_config(config)
    refuse_untrainable_options(config)
    refuse_silent_adapters(config)
    from peft import inject_adapter_in_model
    from peft.utils.error import NoMatchingPeftModuleError

    tied, saved = is_tied(model), list(getattr(config, "modules_to_save", None) or [])  # peft edits the list
    try:
        inject_adapter_in_model(config, model)
    except (NoMatchingPeftModuleError, ValueError, TypeError) as error:  # TypeError: a layer type it cannot wrap
        hint = f" ({CONV1D_HINT})" if "Conv1D" in str(error) else ""
        raise ValueError(f"model.peft: {' '.join(str(error).split())}{hint}") from error
    tying = tied and bool(getattr(config, "ensure_weight_tying", False))
    check_saved_copies(model, saved, tying=tying, train_embeddings=train_embeddings)
    set_embeddings_trainable(model, train_embeddings)


CONV1D_HINT = (
    "GPT-2's attention and MLP layers are transformers' Conv1D, which this peft method cannot wrap: use LoRA "
    "(peft.LoraConfig), or target nn.Linear layers of another family"
)
UNTRAINABLE_OPTIONS = {
    "trainable_token_indices": (
        "peft's trainable tokens",
        "it swaps the embedding for a layer whose trainable_tokens_delta rows no dplit clipping rule covers; train "
        "the whole embedding with model.train_embeddings: true instead",
    ),
    "alora_invocation_tokens": (
        "activated LoRA",
        "the adapter acts only after the invocation tokens, whose offsets peft's own model wrapper computes per "
        "batch and dplit's injected adapters never receive; use plain LoRA (drop alora_invocation_tokens)",
    ),
}
"""peft options dplit cannot train under DP: option → (what peft calls it, why dplit refuses it)."""


def refuse_untrainable_options(config: Any) -> None:
    """Refuse, before anything is injected, a peft option that :data:`UNTRAINABLE_OPTIONS` names, with its cause."""
    for option, (name, cause) in UNTRAINABLE_OPTIONS.items():
        if getattr(config, option, None):
            raise ValueError(f"model.peft: {option} ({name}) is not supported: {cause}")


def refuse_silent_adapters(config: Any) -> None:
    """Refuse a LoRA scale of zero: ``lora_alpha: 0`` multiplies every adapter's output by 0/r.

    Such adapters change nothing the model computes, so their gradients are zero and the run would spend ε for no
    training at all; the same holds for one module given 0 in ``alpha_pattern``.
    """
    if getattr(config, "lora_alpha", None) == 0:
        raise ValueError(
            "model.peft.init_args.lora_alpha=0 scales every LoRA adapter's output by lora_alpha/r = 0, so the adapters "
            "would never change the model while the run spends ε: use lora_alpha > 0 (peft's default is 8)"
        )
    for module, alpha in (getattr(config, "alpha_pattern", None) or {}).items():
        if alpha == 0:
            raise ValueError(
                f"model.peft.init_args.alpha_pattern[{module!r}]=0 scales that LoRA adapter's output by 0, so it would "
                "never change the model while the run spends ε: give it an alpha > 0, or drop it from target_modules"
            )


def check_saved_copies(
    model: PreTrainedModel, modules_to_save: list[str], *, tying: bool, train_embeddings: bool
) -> None:
    """Refuse a ``modules_to_save`` copy of the input embedding or LM head that dplit would not train as asked.

    Args:
        model: the causal LM, adapters injected.
        modules_to_save: the peft config's ``modules_to_save`` as the user gave it.
        tying: whether peft was asked to keep a tied embedding tied (``ensure_weight_tying`` on a tied model).
        train_embeddings: whether the embeddings (and so such copies) are trained.

    Raises:
        ValueError: naming ``model.peft`` for a copy peft ties across the embedding and the LM head
            (``ensure_weight_tying``), and naming ``model.train_embeddings`` too for a copy it would freeze.
    """
    from peft.utils.other import ModulesToSaveWrapper

    copied = [
        name for name, module in (("input embedding", model.get_input_embeddings()),
                                  ("LM head", model.get_output_embeddings()))
        if isinstance(module, ModulesToSaveWrapper)
    ]  # fmt: skip
    if not copied:
        return
    saved = f"modules_to_save={modules_to_save!r}"
    if tying:
        raise ValueError(
            f"model.peft: {saved} with ensure_weight_tying=True makes peft train one copy of the tied embedding "
            "matrix inside two wrappers, which dplit's clipping does not cover; to train the tied embedding, drop "
            "the embedding and LM head from modules_to_save and set model.train_embeddings: true (dplit clips the "
            "tied matrix exactly)"
        )
    if not train_embeddings:
        raise ValueError(
            f"model.peft: {saved} asks peft to train a copy of the {' and '.join(copied)}, but "
            "model.train_embeddings is false (its default beside adapters), which would freeze that copy: set "
            "model.train_embeddings: true to train it, or drop it from modules_to_save"
        )


def adapter_config(config: Any) -> Any:
    """The peft adapter config ``model.peft`` gives: a ``PeftConfig``, or its ``{class_path, init_args}`` (hparams).

    Raises:
        ValueError: naming ``model.peft`` when peft is missing, or the value is not a peft adapter config.
    """
    peft_config = imported_peft().PeftConfig
    if isinstance(config, dict) and isinstance(config.get("class_path"), str):
        config = _built(config["class_path"], config.get("init_args") or {})
    if not isinstance(config, peft_config):
        raise ValueError(f"model.peft must be a peft config such as peft.LoraConfig, got {type(config).__name__}")
    if config.is_prompt_learning:
        raise ValueError(
            f"model.peft: {type(config).__name__} is a prompt-learning method (virtual tokens), which dplit does not "
            "train; use an adapter method such as peft.LoraConfig"
        )
    return config


def _built(class_path: str, init_args: dict[str, Any]) -> Any:
    """An instance of the peft config class named ``class_path`` (as a checkpoint's hyperparameters store it)."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        kind = (
            getattr(importlib.import_module(module_name), class_name, None) if module_name.startswith("peft") else None
        )
    except ImportError:
        kind = None
    if not (isinstance(kind, type) and issubclass(kind, imported_peft().PeftConfig)):
        raise ValueError(f"model.peft: class_path {class_path!r} is not a peft config class such as peft.LoraConfig")
    return kind(**init_args)


def set_embeddings_trainable(model: PreTrainedModel, trainable: bool) -> None:
    """Train or freeze the input and output embedding (one Parameter when tied, both when untied)."""
    for module in embedding_pair(model):
        module.weight.requires_grad_(trainable)


def trainable_counts(module: nn.Module, model: PreTrainedModel) -> TrainableCounts:
    """Count the trainable parameters of ``module`` by kind; ``model`` is its causal LM (embeddings, adapters)."""
    embeddings = {id(m.weight) for m in embedding_pair(model)}
    adapters = {id(p) for p in adapter_parameters(model)}
    counts = {"adapter": 0, "embedding": 0, "other": 0, "frozen": 0}
    for param in module.parameters():  # a tied Parameter is listed once
        kind = "adapter" if id(param) in adapters else "embedding" if id(param) in embeddings else "other"
        counts[kind if param.requires_grad else "frozen"] += param.numel()
    return TrainableCounts(**counts)


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters peft added to ``model``: those of its tuner layers, outside their frozen ``base_layer``.

    Without peft imported no module can be a tuner layer (its class is peft's), so peft is not imported to find none.
    """
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = []
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            base = {id(p) for p in module.get_base_layer().parameters()}
            found += [p for p in module.parameters() if id(p) not in base]
    return found
