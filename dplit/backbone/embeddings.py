"""How a causal LM's input embedding relates to its output embedding (LM head): one Parameter, or two."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from transformers import PreTrainedModel


def embedding_pair(model: PreTrainedModel) -> tuple[nn.Module, nn.Module]:
    """The model's input embedding and output embedding (LM head), checked to have the same [V, d] weight shape."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or not isinstance(getattr(outputs, "weight", None), nn.Parameter):
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head) to tie or untie")
    if inputs.weight.shape != outputs.weight.shape:
        raise ValueError(
            f"{type(model).__name__}: input embedding {tuple(inputs.weight.shape)} and LM head "
            f"{tuple(outputs.weight.shape)} differ in shape, so they cannot share or copy one weight"
        )
    return inputs, outputs


def is_tied(model: PreTrainedModel) -> bool:
    """Whether the LM head's weight IS the input embedding's (one Parameter)."""
    outputs = model.get_output_embeddings()
    return outputs is not None and outputs.weight is model.get_input_embeddings().weight


class EmbeddingPolicy(ABC):
    """Decides whether the LM head's weight is the input embedding's weight or a separate Parameter."""

    @abstractmethod
    def apply(self, model: PreTrainedModel) -> None:
        """Set up the output embedding of ``model`` (any ``AutoModelForCausalLM``) according to the policy."""


@dataclass(frozen=True)
class TiedEmbeddings(EmbeddingPolicy):
    """The LM head IS the input embedding (one Parameter, two uses): GPT-2's, SmolLM2's and Llama 3.2's default.

    Tying a checkpoint that was pretrained with a separate LM head keeps its input embedding for both uses and
    discards the pretrained LM head (a warning says so).
    """

    def apply(self, model: PreTrainedModel) -> None:
        """Make the LM head's weight the very same Parameter as the input embedding's."""
        inputs, outputs = embedding_pair(model)
        if outputs.weight is not inputs.weight and model.config.name_or_path:  # a checkpoint, not a random init
            rank_zero_warn(
                f"TiedEmbeddings on {type(model).__name__}, whose checkpoint has a separate LM head: the input "
                "embedding now serves as the LM head too and the pretrained LM head weights are discarded"
            )
        model.config.tie_word_embeddings = True
        outputs.weight = inputs.weight


@dataclass(frozen=True)
class UntiedEmbeddings(EmbeddingPolicy):
    """An LM head with its own Parameter.

    Args:
        init: ``"copy"`` starts the head as an independent clone of the (pretrained) input embedding;
            ``"random"`` draws it from N(0, initializer_range²) as GPT-2 initialises linear layers;
            ``"pretrained"`` keeps the checkpoint's own separate LM head (refused for a tied checkpoint).
    """

    init: Literal["copy", "random", "pretrained"] = "copy"

    def __post_init__(self) -> None:
        if self.init not in ("copy", "random", "pretrained"):
            raise ValueError(f"UntiedEmbeddings.init must be 'copy', 'random' or 'pretrained', got {self.init!r}")

    def apply(self, model: PreTrainedModel) -> None:
        """Give the LM head its own weight: cloned from the input embedding, fresh, or the checkpoint's."""
        inputs, outputs = embedding_pair(model)
        model.config.tie_word_embeddings = False
        if self.init == "pretrained":
            if outputs.weight is inputs.weight:
                raise ValueError(
                    f"UntiedEmbeddings(init='pretrained'): {type(model).__name__} ties its LM head to the input "
                    "embedding, so there is no separate pretrained head to keep; use init='copy'"
                )
            return
        source = inputs.weight
        if self.init == "copy":
            weight = source.detach().clone()
        else:
            weight = torch.empty_like(source).normal_(0.0, getattr(model.config, "initializer_range", 0.02))
        outputs.weight = nn.Parameter(weight, requires_grad=source.requires_grad)
