"""The interrupt checkpoint: a run stopped by an error or Ctrl-C keeps its finished DP steps and their ledger."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

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

    One process saves after any exception. Several processes save only where no rank can be left waiting:

    * SIGTERM (Lightning's ``SIGTERMException``): Lightning forwards the signal to every rank and stops them all at
      the same batch, so every rank takes part in the save (data-parallel and sharded alike);
    * an interrupt (``KeyboardInterrupt``) may reach one rank only (``kill -INT`` of the launcher) while the others
      wait inside a step's collective: under data parallelism every rank holds the same weights, so rank 0 writes
      the checkpoint alone, with no collective (Lightning then stops the other ranks); a sharded run's weights are
      split over the ranks, so it saves none and says that ``privacy_ledger.json`` counts every step;
    * after an error the other ranks may wait inside a collective: ``privacy_ledger.json`` is the record.
    """
    dpsgd.budget.finish()  # ε and the ledger; the segment is closed by the strategy (no collective here)
    if dpsgd.budget.steps_this_run == 0:
        return
    stopped = f"DP-SGD: training stopped by {type(exception).__name__} after {dpsgd.budget.steps} DP steps"
    if not multi_process or isinstance(exception, SIGTERMException):
        trainer.save_checkpoint(path, weights_only=False)
    elif isinstance(exception, KeyboardInterrupt) and isinstance(trainer.strategy, DDPStrategy):
        _save_on_rank_zero_alone(trainer, path)
    else:
        if isinstance(exception, KeyboardInterrupt):
            rank_zero_warn(
                f"{stopped}; a sharded run saves no {INTERRUPT_CHECKPOINT} on an interrupt (its weights are split over "
                "ranks that may still be inside a step): privacy_ledger.json counts every step; resume with "
                "--ckpt_path last (the newest checkpoint; the steps after it stay counted)",
                category=PrivacyWarning,
            )
        return
    rank_zero_warn(
        f"{stopped}; saved {path} with the privacy ledger (resume with --ckpt_path {path})", category=PrivacyWarning
    )


def _save_on_rank_zero_alone(trainer: Trainer, path: Path) -> None:
    """Write the checkpoint from rank 0 without any collective (``Trainer.save_checkpoint`` ends with a barrier)."""
    if trainer.is_global_zero:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        trainer.strategy.save_checkpoint(checkpoint, path)
