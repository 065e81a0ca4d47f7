"""What DPStrategy refuses in a Trainer before any data is read (one line each, naming the flag)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from dplit.privacy.history import PrivacyHistory

TESTED_PRECISIONS = ("32-true", "64-true", "bf16-mixed")
"""The precisions the DP path is tested with; others (``16-true``: fp16 weights overflow to NaN) are refused."""


def check_trainer(trainer: Trainer, precision: Precision, *, planned: bool) -> None:
    """Refuse trainer settings that break DP-SGD or its accounting (``planned``: σ is calibrated for a target ε)."""
    if planned and trainer.max_steps == -1 and trainer.max_epochs == -1:
        raise ValueError(
            "DPStrategy.target_epsilon spreads ε over the planned steps: set a finite trainer.max_epochs or "
            "trainer.max_steps (both are -1), or give DPStrategy.noise_multiplier instead"
        )
    if trainer.gradient_clip_val:
        raise ValueError(
            "trainer.gradient_clip_val must be unset with DPStrategy: it clips per example "
            "(DPStrategy.max_grad_norm); clipping the noisy batch gradient again is not DP-SGD"
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "trainer.accumulate_grad_batches must be 1 with DPStrategy: raise data.batch_size for larger "
            "logical batches and DPStrategy.max_physical_batch_size bounds memory"
        )
    if trainer.fast_dev_run:
        raise ValueError(
            "trainer.fast_dev_run is refused with DPStrategy: it spends real privacy on the private data and writes "
            "no ledger or checkpoint; for a short run set trainer.max_steps (σ is then calibrated for those steps)"
        )
    check_precision(precision)
    refuse_tuner(trainer)


def refuse_tuner(trainer: Trainer) -> None:
    """Refuse Lightning's tuner (``lr_find``, ``scale_batch_size``): its trial steps train on the private data."""
    tuning = next(
        (type(c).__name__ for c in trainer.callbacks if isinstance(c, (LearningRateFinder, BatchSizeFinder))), None
    )
    if tuning is not None:
        raise ValueError(
            f"Lightning's tuner ({tuning}: Tuner.lr_find / scale_batch_size) cannot run with DPStrategy: its trial "
            "steps train on the private data outside the privacy ledger and the value it picks leaks it; tune on "
            "public data, or spend ε on each trial run and count it"
        )


def check_precision(precision: Precision) -> None:
    """Refuse loss scaling (fp16-mixed) and any precision the DP path is not tested with."""
    name = str(precision.precision)
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            "trainer.precision '16-mixed' (loss scaling) is not supported with DPStrategy: use 'bf16-mixed'"
        )
    if name not in TESTED_PRECISIONS:
        raise ValueError(
            f"trainer.precision={name!r} is not supported with DPStrategy (the DP path is tested with "
            f"{', '.join(TESTED_PRECISIONS)}; '16-true' weights overflow to NaN): use 'bf16-mixed' or '32-true'"
        )


def check_module(module: LightningModule) -> None:
    """Refuse a module DP-SGD cannot train: no per-example loss, no privacy history, manual optimization."""
    if not callable(getattr(module, "per_example_loss", None)):
        raise TypeError(f"DPStrategy needs {type(module).__name__}.per_example_loss(batch) -> Tensor[B]")
    if not isinstance(getattr(module, "privacy_history", None), PrivacyHistory):
        raise TypeError(
            f"DPStrategy needs {type(module).__name__}.privacy_history, the weights' "
            "dplit.privacy.history.PrivacyHistory (subclass dplit.tasks.base.CausalLMModule, which keeps one)"
        )
    if not module.automatic_optimization:
        raise ValueError("DPStrategy replaces the optimizer step: use automatic optimization")


def check_same_privacy_unit(restored: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Refuse a resume that changes ``data.privacy_unit``: the checkpoint's ε counts another unit (one line).

    Args:
        restored: the checkpoint's ledger state (``None``: a fresh run); its ``dataset_size`` counts its unit.
        current: this run's DP-SGD facts (``privacy_unit``).
    """
    before, now = (restored or {}).get("privacy_unit"), current.get("privacy_unit")
    if before is None or before == now:
        return
    size = (restored or {}).get("dataset_size")
    counted = f" ({size:,} {'users' if before == 'user' else 'rows'})" if isinstance(size, int) else ""
    raise ValueError(
        f"data.privacy_unit={now!r} differs from the checkpoint's run, which protected each {before}{counted}: its ε "
        f"cannot continue under another unit; resume with data.privacy_unit={before} (and the same data and user "
        "settings), or start a new run from the exported model"
    )
