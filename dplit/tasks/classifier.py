"""CausalLMClassifier: a decoder-only LM (GPT-2, Llama, Qwen2, Mistral, ...) classifying at the last real token."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from typing_extensions import override

from dplit.backbone.embeddings import embedding_pair
from dplit.tasks.base import Batch, CausalLMModule, positions_of


class CausalLMClassifier(CausalLMModule):
    """Causal-LM classifier scoring label words through the LM head (or a linear head) at the last real token.

    Args:
        head: ``"label_words"`` scores the task's label-word logits of the LM head; ``"linear"`` adds a
            d×K score layer (the LM head is then unused and, when untied, frozen).
        label_word_ids: token id of each class's label word, in class order (linked from the data).
        num_classes: number of classes K for the linear head when no label words are given.
        task: task name; QQP also reports F1.
        **kwargs: the backbone, embedding, adapter, freezing and optimizer arguments of
            :class:`~dplit.tasks.base.CausalLMModule` (``pretrained``, ``config``, ``lr``, ...).
    """

    def __init__(
        self,
        *,
        head: Literal["label_words", "linear"] = "label_words",
        label_word_ids: list[int] | None = None,
        num_classes: int | None = None,
        task: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        inputs, outputs = embedding_pair(self.backbone)
        _check_label_words(head, label_word_ids, outputs.weight.shape[0])
        classes = len(label_word_ids) if label_word_ids else num_classes
        if not classes or classes < 2:
            raise ValueError("model.num_classes (or model.label_word_ids) must give at least two classes")
        self.register_buffer("label_word_ids", torch.tensor(label_word_ids or [], dtype=torch.long), persistent=False)
        self.score = nn.Linear(inputs.weight.shape[1], classes, bias=False) if head == "linear" else None
        head_froze = None
        if head == "linear" and outputs.weight is not inputs.weight:
            outputs.requires_grad_(False)
            head_froze = "model.head='linear' (which freezes the unused untied LM head)"
        self.apply_freeze(also_frozen_by=head_froze)
        self.val_acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.val_f1 = MulticlassF1Score(num_classes=classes, average="macro") if task == "qqp" else None

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Class logits [B, K] read at each sequence's last real token (left or right padding)."""
        positions = positions_of(attention_mask)  # [B, T]: same ids for either padding side
        hidden = self.backbone.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions
        ).last_hidden_state  # [B, T, d]
        steps = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (attention_mask * steps).argmax(-1)  # [B]: index of the last real token
        h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, d]
        if self.score is not None:
            return self.score(h)  # [B, K]
        return self.backbone.get_output_embeddings()(h)[:, self.label_word_ids]  # [B, V] -> [B, K]

    @override
    def per_example_loss(self, batch: Batch) -> Tensor:
        """Cross-entropy of each example [B]; example i's loss depends on example i only."""
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.float(), batch["labels"], reduction="none")

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Non-private step (DPStrategy replaces it with clipped, noisy micro-batches)."""
        loss = self.per_example_loss(batch).mean()
        self.log("train/loss", loss, batch_size=batch["labels"].shape[0])
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        """Log ``val/loss``, ``val/acc`` (and ``val/f1`` for QQP)."""
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        """Log ``test/loss``, ``test/acc`` (and ``test/f1`` for QQP)."""
        self._evaluate(batch, "test")

    def _evaluate(self, batch: Batch, stage: str) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"]).float()
        labels = batch["labels"]
        size = labels.shape[0]
        self.log(f"{stage}/loss", F.cross_entropy(logits, labels), batch_size=size, sync_dist=True)
        self.val_acc(logits, labels)
        self.log(f"{stage}/acc", self.val_acc, batch_size=size, prog_bar=True)
        if self.val_f1 is not None:
            self.val_f1(logits, labels)
            self.log(f"{stage}/f1", self.val_f1, batch_size=size)


def _check_label_words(head: str, label_word_ids: list[int] | None, vocab_size: int) -> None:
    if head == "linear":
        return
    if not label_word_ids:
        raise ValueError("model.head='label_words' needs model.label_word_ids (linked from data.label_word_ids)")
    if len(set(label_word_ids)) != len(label_word_ids):
        raise ValueError(f"model.label_word_ids must be distinct tokens, got {label_word_ids}")
    outside = [i for i in label_word_ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"model.label_word_ids {outside} are outside the vocabulary of size {vocab_size}")


class GPT2Classifier(CausalLMClassifier):
    """The name configs used before other families: a :class:`CausalLMClassifier` (GPT-2 by default)."""
