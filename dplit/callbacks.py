"""Training monitors: peak memory and throughput, logged to every logger (TensorBoard by default)."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


def peak_memory_mb(device: torch.device) -> float:
    """CUDA max allocated on a GPU, else the process' peak resident set size, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


class ResourceMonitor(Callback):
    """Logs ``memory/peak_mb`` and ``perf/samples_per_sec`` (examples of the logical batch per second).

    Both depend on the private batches (their size and lengths): nothing is logged under a strategy whose
    ``private_diagnostics`` is ``False``.
    """

    def __init__(self) -> None:
        self._started = 0.0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not getattr(trainer.strategy, "private_diagnostics", True):  # DPStrategy(private_diagnostics=False)
            return
        elapsed = time.perf_counter() - self._started
        examples = batch["input_ids"].shape[0] if isinstance(batch, dict) and "input_ids" in batch else 0
        pl_module.log("memory/peak_mb", peak_memory_mb(pl_module.device), on_step=True, batch_size=1)
        pl_module.log("perf/samples_per_sec", examples / max(elapsed, 1e-9), on_step=True, batch_size=1)


class TQDMProgressBarWithoutVersion(TQDMProgressBar):
    """Lightning's plain progress bar without ``v_num`` (the log folder's number: noise beside loss and ε)."""

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


class RichProgressBarWithoutVersion(RichProgressBar):
    """Lightning's rich progress bar (its default when ``rich`` is installed) without ``v_num``."""

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


def _without_version(items: dict[str, Any]) -> dict[str, Any]:
    items.pop("v_num", None)  # as Lightning's own docstring of ProgressBar.get_metrics shows
    return items


_QUIET_BARS: dict[type, type] = {
    TQDMProgressBar: TQDMProgressBarWithoutVersion,
    RichProgressBar: RichProgressBarWithoutVersion,
}


def use_quiet_progress_bar(trainer: Trainer) -> None:
    """Swap the progress bar Lightning added by default for the same kind without ``v_num`` (call it only when
    the user configured no progress bar of their own)."""
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in _QUIET_BARS:
            trainer.callbacks[index] = _QUIET_BARS[type(callback)]()
