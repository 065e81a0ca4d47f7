"""How the input embedding relates to the LM head: one shared Parameter, or two independent ones."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import GPT2LMHeadModel


class EmbeddingPolicy(ABC):
    """Decides whether ``lm_head.weight`` is ``transformer.wte.weight`` or a separate Parameter."""

    @abstractmethod
    def apply(self, model: GPT2LMHeadModel) -> None:
        """Set up ``model.lm_head.weight`` according to the policy."""


@dataclass(frozen=True)
class TiedEmbeddings(EmbeddingPolicy):
    """GPT-2's default: the LM head IS the input embedding (one Parameter, two uses)."""

    def apply(self, model: GPT2LMHeadModel) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``wte.weight``."""
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.transformer.wte.weight


@dataclass(frozen=True)
class UntiedEmbeddings(EmbeddingPolicy):
    """An LM head with its own Parameter.

    Args:
        init: ``"copy"`` starts the head as an independent clone of the (pretrained) input embedding;
            ``"random"`` draws it from N(0, initializer_range²) as GPT-2 initialises linear layers.
    """

    init: Literal["copy", "random"] = "copy"

    def __post_init__(self) -> None:
        if self.init not in ("copy", "random"):
            raise ValueError(f"UntiedEmbeddings.init must be 'copy' or 'random', got {self.init!r}")

    def apply(self, model: GPT2LMHeadModel) -> None:
        """Give ``lm_head`` its own weight, cloned from ``wte`` or freshly initialised."""
        wte = model.transformer.wte.weight
        model.config.tie_word_embeddings = False
        if self.init == "copy":
            weight = wte.detach().clone()
        else:
            weight = torch.empty_like(wte).normal_(0.0, model.config.initializer_range)
        model.lm_head.weight = nn.Parameter(weight, requires_grad=wte.requires_grad)
