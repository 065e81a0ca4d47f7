"""Checkpoint integrity: a digest of the weights, their privacy history and the run ledger, checked before reuse.

A checkpoint whose bytes were damaged (a bad disk, an interrupted copy, a hand edit) can still unpickle: its
weights are then not the ones the ledger's ε describes. dplit records a SHA-256 of each part when it writes a
checkpoint and refuses to resume or export one whose parts no longer match, naming the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from dplit.privacy.weights_content import content_digest

DIGEST_KEY = "dplit_digest"
"""The checkpoint entry holding the digest of each sealed part."""
WEIGHTS_PART = "weights"
"""The sealed part holding the content digest of ``checkpoint["state_dict"]`` (``"state_dict"``: the byte digest of
:func:`weights_digest`, in checkpoints written before 2026-12-07, still checked)."""


def weights_digest(state_dict: Mapping[str, Any]) -> str:
    """SHA-256 over every entry of a state dict: name, dtype, shape and bytes of each tensor, in key order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        value = state_dict[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f" {flat.dtype} {tuple(value.shape)} ".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(json.dumps(value, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


def record_digest(checkpoint: dict[str, Any], part: str) -> None:
    """Seal ``checkpoint[part]`` (a plain-data entry) in ``checkpoint[DIGEST_KEY]``."""
    checkpoint.setdefault(DIGEST_KEY, {})[part] = _digest(checkpoint[part], part)


def record_weights_digest(checkpoint: dict[str, Any], digest: str) -> None:
    """Seal ``checkpoint["state_dict"]`` by its content digest (computed once by the caller, who seals the history)."""
    checkpoint.setdefault(DIGEST_KEY, {})[WEIGHTS_PART] = digest


def check_digests(checkpoint: dict[str, Any], *, source: str) -> None:
    """Refuse a checkpoint one of whose sealed parts changed since dplit wrote it (no digest: nothing to check).

    Args:
        checkpoint: the loaded checkpoint.
        source: how to name it in the error (the flag and the file).

    Raises:
        ValueError: in one line naming ``source`` and the part that does not match.
    """
    for part, recorded in (checkpoint.get(DIGEST_KEY) or {}).items():
        entry = "state_dict" if part == WEIGHTS_PART else part
        if entry not in checkpoint or _digest(checkpoint[entry], part) != recorded:
            raise ValueError(
                f"{source}: its {_PARTS.get(part, part)} do not match the digest dplit recorded when it wrote the "
                "file (damaged or modified since): refusing to use it; resume or export an intact checkpoint"
            )


_PARTS = {
    WEIGHTS_PART: "weights",
    "state_dict": "weights",
    "dplit_privacy": "privacy ledger",
    "dplit_privacy_history": "privacy history",
}


def _digest(value: Any, part: str) -> str:
    if part == WEIGHTS_PART:
        return content_digest(value)
    if part == "state_dict":
        return weights_digest(value)
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()
