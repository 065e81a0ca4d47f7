"""Where a run keeps its checkpoints, and the line it prints when it ends: done, or stopped by SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from dplit.privacy.composition import PER_UNIT, mixed_epsilon, mixed_units, protected_unit, smallest_delta
from dplit.privacy.ledger import LEDGER_FILE
from dplit.strategy.hooks import DPSGDHooks
from dplit.strategy.interrupted_run import INTERRUPT_CHECKPOINT

PREEMPTED_EXIT = 128 + signal.SIGTERM
"""The exit status of a run stopped by SIGTERM (the shell's convention), so schedulers see it did not finish."""
INTERRUPTED_EXIT = 128 + signal.SIGINT
"""The exit status of a run stopped by Ctrl-C (SIGINT), as a shell reports it (Lightning itself exits 1)."""


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
"""What gloo's collectives raise on a rank whose peer process stopped (interrupted alone, or crashed)."""


def peer_stopped_line(trainer: Trainer, error: BaseException) -> str | None:
    """The line for a rank whose collective failed because another rank's process stopped (``None``: not that)."""
    if trainer.world_size < 2 or not isinstance(error, RuntimeError) or not any(s in str(error) for s in PEER_GONE):
        return None
    return (
        f"dplit: stopped: another process of this {trainer.world_size}-process run stopped (interrupted alone, or "
        "crashed) during a step, so this one could not go on; no checkpoint was saved, privacy_ledger.json counts "
        "every step: rerun the same command with --ckpt_path last to continue from the newest checkpoint"
    )


def resume_hint(trainer: Trainer) -> str:
    """How to resume a run that SIGTERM stopped: the ``--ckpt_path`` of the ``interrupted.ckpt`` it saved."""
    saved = [path for path in checkpoint_folders(trainer) if (path / INTERRUPT_CHECKPOINT).is_file()]
    if not saved:
        return (
            "no checkpoint was saved (no DP step since the start, or a multi-process run whose privacy_ledger.json is "
            "current): rerun the same command with --ckpt_path last to continue from the newest checkpoint"
        )
    path = max((folder / INTERRUPT_CHECKPOINT for folder in saved), key=lambda file: file.stat().st_mtime)
    return f"saved {path} with the privacy ledger; resume by rerunning the same command with --ckpt_path {path}"


def checkpoint_folders(trainer: Trainer) -> list[Path]:
    """The run's checkpoint folders: its ``ModelCheckpoint`` folders, else ``<log_dir>/checkpoints``."""
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    return folders or [Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"]


def find_last_checkpoint(trainer: Trainer) -> Path:
    """The newest checkpoint (``last.ckpt``, ``interrupted.ckpt`` or any other) of this run's checkpoint folders.

    Those are the ``ModelCheckpoint`` folders and the ``checkpoints/`` of every version folder beside the new one:
    a resumed run writes a new version folder, so Lightning's own ``"last"`` would look only in an empty one.
    """
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    root = Path(getattr(trainer.logger, "root_dir", None) or trainer.default_root_dir)
    folders += [path for path in root.glob("*/checkpoints") if path.is_dir()]
    found = [path for folder in folders for path in folder.glob("*.ckpt") if path.is_file()]
    if not found:
        raise ValueError(
            f"--ckpt_path last: no checkpoint under {root}, so there is nothing to resume (training would restart "
            "ε at 0): give a checkpoint file, or leave --ckpt_path unset for a new run"
        )
    return max(found, key=lambda path: path.stat().st_mtime)


def nothing_trained(trainer: Trainer) -> str:
    """Why a resumed fit took no step (its plan was already done), and how to train further."""
    steps, epochs = trainer.max_steps, trainer.max_epochs
    if steps is not None and steps != -1 and trainer.global_step >= steps:
        reached = f"trainer.max_steps={steps}"
    else:
        reached = f"trainer.max_epochs={epochs}"
    return (
        f"nothing to train: the run is at step {trainer.global_step} (epoch {trainer.current_epoch}), where "
        f"{reached} ends the plan; to train further, rerun with a larger {reached.split('=')[0]}"
    )


def run_summary(trainer: Trainer) -> str:
    """Where a finished ``fit`` left its checkpoint, ``privacy_ledger.json`` and TensorBoard logs, and its ε."""
    parts = []
    callback = trainer.checkpoint_callback
    checkpoint = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    ledger = Path(trainer.log_dir or trainer.default_root_dir) / LEDGER_FILE
    if ledger.is_file():
        parts.append(f"privacy ledger {ledger}")
    board = next((logger.log_dir for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)
    if board is not None:
        parts.append(f"TensorBoard logs {board} (tensorboard --logdir {Path(board).parent})")
    return "; ".join([*parts, privacy_spent(trainer.strategy)])


def privacy_spent(strategy: Any) -> str:
    """``ε=7.99 at δ=0.00294 per training example after 40 DP steps``, or that the run had no privacy guarantee.

    The unit is the one the weights' whole history protects: ``per user`` only when every DP segment trained over
    users. Where some did and others did not, ε is the per-example one that composes each segment under its own
    relation (a segment over users as replace-one), at the smallest of the segments' δ, as the exported card states.
    """
    if not isinstance(strategy, DPSGDHooks):
        return "NON-PRIVATE run: no ε, no differential privacy guarantee"
    accountant = strategy.accountant
    if accountant is None:  # DP-SGD never started: no step was taken, and a checkpoint's ε is its ledger's
        return "no DP step taken (the ε of a resumed checkpoint is in its privacy_ledger.json)"
    segments = strategy.dpsgd.history.segments
    if mixed_units(segments):
        delta = smallest_delta(segments, accountant.delta)
        assert delta is not None
        return (
            f"ε={mixed_epsilon(segments, delta=delta):.4g} at δ={delta:.3g} per training example after "
            f"{accountant.steps} DP steps (the segments over users counted as replace-one, by dp-accounting's PLD)"
        )
    unit = PER_UNIT[protected_unit(segments)]
    return f"ε={accountant.epsilon():.4g} at δ={accountant.delta:.3g} {unit} after {accountant.steps} DP steps"
