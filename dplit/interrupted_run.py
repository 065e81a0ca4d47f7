"""The interrupt checkpoint: a run stopped by an error or Ctrl-C keeps its finished DP steps and their ledger."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.warnings import PrivacyWarning

INTERRUPT_CHECKPOINT = "interrupted.ckpt"
"""Saved in the run's ``checkpoints/`` folder, with the ledger, when training is interrupted or crashes."""


def interrupt_checkpoint_path(trainer: Trainer, log_dir: str | None) -> Path:
    """``interrupted.ckpt`` in the run's ``ModelCheckpoint`` folder, else in ``<log_dir>/checkpoints``."""
    folder = getattr(trainer.checkpoint_callback, "dirpath", None)
    return (
        Path(folder) if folder else Path(log_dir or trainer.default_root_dir) / "checkpoints"
    ) / INTERRUPT_CHECKPOINT


def save_interrupted_run(
    trainer: Trainer, dpsgd: DPSGD, path: Path, exception: BaseException, *, multi_process: bool
) -> None:
    """Bring the ledger up to date and, when this run took DP steps, save them with it at ``path``.

    With several processes only a ``KeyboardInterrupt`` (which every rank receives) saves a checkpoint: after an
    error the other ranks may wait inside a collective, so ``privacy_ledger.json`` is the record.
    """
    dpsgd.finish()
    if dpsgd.budget.steps_this_run == 0 or (multi_process and not isinstance(exception, KeyboardInterrupt)):
        return
    trainer.save_checkpoint(path)
    rank_zero_warn(
        f"DP-SGD: training stopped by {type(exception).__name__} after {dpsgd.budget.steps} DP steps; saved {path} with "
        f"the privacy ledger (resume with --ckpt_path {path})",
        category=PrivacyWarning,
    )
