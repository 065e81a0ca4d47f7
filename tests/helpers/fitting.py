"""A tiny float64 GPT-2 classifier, fitted with DPStrategy in a few lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.strategy import DPStrategy
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, RandomTokenData


class BatchRecorder(Callback):
    """Keeps every logical batch the trainer fed to the model."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Keep a copy of the batch."""
        self.batches.append({key: value.clone() for key, value in batch.items()})


def make_model(policy: str = "untied", head: str = "label_words") -> GPT2Classifier:
    """A tiny float64 GPT-2 classifier with the given embedding policy and head (seed 0)."""
    torch.manual_seed(0)
    embeddings = TiedEmbeddings() if policy == "tied" else UntiedEmbeddings()
    return GPT2Classifier(
        config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS, embeddings=embeddings, head=head
    ).double()


def fit(
    tmp_path: Path,
    model: GPT2Classifier,
    *,
    max_steps: int,
    data: RandomTokenData | None = None,
    ckpt_path: str | None = None,
    callbacks: list[Callback] | None = None,
    **strategy_kwargs: Any,
) -> tuple[L.Trainer, DPStrategy]:
    """Fit ``model`` with DPStrategy (float64, σ = 0 and seeded unless ``strategy_kwargs`` say otherwise)."""
    settings = {"max_grad_norm": 0.1, "noise_multiplier": 0.0, "max_physical_batch_size": 5, "seed": 0}
    strategy = DPStrategy(accelerator="cpu", **{**settings, **strategy_kwargs})
    trainer = L.Trainer(
        strategy=strategy,
        devices=1,
        precision="64-true",
        max_steps=max_steps,
        default_root_dir=tmp_path,
        callbacks=callbacks or [],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(model, data or RandomTokenData(), ckpt_path=ckpt_path)
    return trainer, strategy


class CrashAtStep(Callback):
    """Raises ``error`` when the trainer is about to run step ``step``."""

    def __init__(self, step: int, error: BaseException) -> None:
        self._step, self._error = step, error

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Raise the error at the chosen step."""
        if trainer.global_step == self._step:
            raise self._error
