"""A checkpoint file given on the command line: refused in one line naming its flag unless dplit can load it.

``dplit fit|validate --ckpt_path``, ``dplit export --ckpt_path`` and ``dplit lm generate --model`` check the file
here, before anything reads it whole.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from dplit.privacy.integrity import check_digests


def check_checkpoint_file(path: str | Path, *, flag: str, weights_only: bool = True) -> Path:
    """Refuse a path that is not a ``torch.save`` file, or one that pickles what weights-only loading refuses.

    The file is not read whole. Objects ``torch.load(weights_only=True)`` would refuse to run are refused unless
    ``weights_only`` is ``False`` (``--weights_only false``).

    Args:
        path: the flag's value.
        flag: the command-line flag named in the refusal (``--ckpt_path``, ``--model``).
        weights_only: whether the file will be loaded with ``torch.load(weights_only=True)``.

    Returns:
        The path, ``~`` expanded.

    Raises:
        ValueError: in one line naming ``flag`` and the path, for a folder, a missing file, a file that
            ``torch.save`` did not write, or one that pickles other objects than tensors and plain values.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a checkpoint file in it (e.g. checkpoints/last.ckpt)")
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    unsafe = unsafe_globals(path)
    if unsafe is None and _starts_as_a_zip(path):
        raise ValueError(
            f"{flag} {path}: truncated or damaged (it starts as a torch.save file, but is not a whole one: a copy or "
            "a save that did not finish?); use another checkpoint of the run, or copy this one again"
        )
    if unsafe is None:
        raise ValueError(f"{flag} {path}: not a checkpoint (not a file written by torch.save / Lightning)")
    if unsafe and weights_only:
        raise ValueError(
            f"{flag} {path}: not a checkpoint dplit can load: it pickles {', '.join(unsafe)}, which "
            "torch.load(weights_only=True) refuses to run (a Lightning checkpoint holds tensors and plain values)"
        )
    return path


def unsafe_globals(path: Path) -> list[str] | None:
    """The classes a ``torch.save`` file pickles beyond what ``weights_only`` loading allows (``None``: not such a file)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path) if zipfile.is_zipfile(path) else None
    except RuntimeError:  # a zip archive that torch.save did not write
        return None


def _starts_as_a_zip(path: Path) -> bool:
    """Whether the file opens with a zip entry's signature, as every ``torch.save`` file does."""
    with path.open("rb") as file:
        return file.read(4) == b"PK\x03\x04"


def read_checkpoint(path: str | Path, *, flag: str) -> dict[str, Any]:
    """The content of a Lightning checkpoint of a dplit module (tensors and plain types only: ``weights_only``)."""
    path = check_checkpoint_file(path, flag=flag)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{flag} {path}: not a dplit checkpoint ({first})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{flag} {path}: not a Lightning checkpoint (no state_dict)")
    check_digests(checkpoint, source=f"{flag} {path}")
    hparams = checkpoint.get("hyper_parameters") or {}
    if "lr" not in hparams or not any(str(key).startswith("backbone.") for key in checkpoint["state_dict"]):
        raise ValueError(f"{flag} {path}: not a dplit checkpoint (no dplit model hyperparameters or backbone weights)")
    return checkpoint
