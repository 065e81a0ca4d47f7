"""Training monitors: peak memory and throughput, logged to every logger (TensorBoard by default)."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from dplit.privacy.diagnostics import private_diagnostics_allowed


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
        if not private_diagnostics_allowed(trainer.strategy):  # DPStrategy(private_diagnostics=False)
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


class ParameterSummary(ModelSummary):
    """Lightning's model summary as a plain table, without the FLOPs column and total when nothing counted FLOPs.

    Lightning counts FLOPs only for a module with an ``example_input_array``, which dplit's modules do not have, so
    its summary (and the rich one) would print a column of zeros and ``Total FLOPs: 0``.
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [(name, values) for name, values in summary_data if total_flops or name != "FLOPs"]
        widths = [max([len(name), *(len(str(value)) for value in values)]) for name, values in columns]
        rows = [[name for name, _ in columns], *zip(*(values for _, values in columns), strict=True)]
        lines = [" | ".join(f"{str(cell):<{width}}" for cell, width in zip(row, widths, strict=True)) for row in rows]
        totals = {
            "Trainable params": f"{trainable_parameters:,}",
            "Non-trainable params": f"{total_parameters - trainable_parameters:,}",
            "Total params": f"{total_parameters:,}",
            "Total estimated model params size (MB)": f"{model_size:,.1f}",
            "Modules in train mode": str(total_training_modes.get("train", 0)),
            "Modules in eval mode": str(total_training_modes.get("eval", 0)),
            **({"Total FLOPs": f"{total_flops:,}"} if total_flops else {}),
        }
        lines += [f"{value:<12}{name}" for name, value in totals.items()]
        rank_zero_info("\n" + "\n".join(lines))


_QUIET_SUMMARIES = (ModelSummary, RichModelSummary)

_QUIET_BARS: dict[type, type] = {
    TQDMProgressBar: TQDMProgressBarWithoutVersion,
    RichProgressBar: RichProgressBarWithoutVersion,
}


def use_plain_summary(trainer: Trainer) -> None:
    """Swap the model summary Lightning added by default for :class:`ParameterSummary`.

    Call it only when the user configured no model summary of their own.
    """
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in _QUIET_SUMMARIES:
            trainer.callbacks[index] = ParameterSummary()


def use_quiet_progress_bar(trainer: Trainer) -> None:
    """Swap the progress bar Lightning added by default for the same kind without ``v_num``.

    Call it only when the user configured no progress bar of their own.
    """
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in _QUIET_BARS:
            trainer.callbacks[index] = _QUIET_BARS[type(callback)]()
