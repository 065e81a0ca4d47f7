"""The warning category of settings that weaken or void the privacy guarantee, and how DP-SGD speaks (rank 0 only)."""

from __future__ import annotations

import logging
import warnings
from typing import Protocol

log = logging.getLogger("dplit.privacy.dpsgd")
"""DP-SGD's log (its name is what the terminal and the tests filter on)."""


class PrivacyWarning(UserWarning):
    """A setting or event that weakens, voids or ends the privacy guarantee of a run (never filtered by dplit)."""


class Ranked(Protocol):
    """Anything that knows this process's rank (a :class:`~dplit.privacy.world.World`)."""

    rank: int


def say(world: Ranked, line: str) -> None:
    """Log ``line`` (INFO) on rank 0 only."""
    if world.rank == 0:
        log.info(line)


def warn(world: Ranked, line: str) -> None:
    """Warn ``line`` (:class:`PrivacyWarning`) on rank 0 only."""
    if world.rank == 0:
        warnings.warn(line, PrivacyWarning, stacklevel=3)
