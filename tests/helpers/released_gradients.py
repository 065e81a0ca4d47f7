"""A callback for runs of the real executable that saves the first released gradient (``--trainer.callbacks``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override


class FirstReleasedGradient(Callback):
    """Saves every trainable parameter's gradient as the first optimizer step sees it (whole tensors, rank 0 writes).

    Under DP the gradient the optimizer steps on is the released (clipped, noised, averaged) one.

    Args:
        path: the file ``torch.save`` writes ({parameter name: gradient}).
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.saved = False

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        if self.saved:
            return
        self.saved = True
        grads = {name: _whole(p.grad) for name, p in pl_module.named_parameters() if p.grad is not None}
        if trainer.global_rank == 0:
            torch.save(grads, self.path)


def _whole(grad: Tensor) -> Tensor:
    """The whole gradient (a sharded ``DTensor`` gathered from every rank: every rank must call this)."""
    return grad.full_tensor().detach().clone() if hasattr(grad, "full_tensor") else grad.detach().clone()
