"""The arms' Lightning callback that times every optimizer step, training and validation.

Its own module, imported only by the arm's process (where ``--trainer.callbacks`` names it and Lightning builds it):
:mod:`bench.study.arm` and the studies that plan and launch the arms do not import Lightning (seconds per process).
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback


class StepTimer(Callback):
    """Wall time and logical-batch size of every optimizer step, and the wall time of training and of each validation.

    A step is timed from batch start to batch end, optimizer step included (on CUDA, synchronised at both ends); the
    training time is that of the whole training loop.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.train_wall = 0.0
        self.val_walls: list[float] = []
        self._started = self._train_started = self._val_started = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the training loop's clock."""
        self._train_started = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Record the training loop's wall time."""
        self.train_wall = time.perf_counter() - self._train_started

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Start a validation run's clock."""
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Record the validation run's wall time."""
        self.val_walls.append(time.perf_counter() - self._val_started)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Start the step's clock (after the device's queued work)."""
        if pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Record the step's wall time (once the device is done) and its logical-batch size."""
        if pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        self.times.append(time.perf_counter() - self._started)
        self.sizes.append(int(batch["labels"].shape[0]) if isinstance(batch, dict) and "labels" in batch else 0)
