"""Whether values computed from private data without noise may reach logs: what the trainer's strategy declares.

Such values (losses, norms, prompt lengths, a user's share of the rows, timings) sit outside ε. A DP strategy
declares :class:`DiagnosticsPolicy` (the strategy's ``private_diagnostics: false`` keeps them out); every logger that
could write one asks :func:`private_diagnostics_allowed` of the trainer's strategy, and nothing else.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class DiagnosticsPolicy(Protocol):
    """A training strategy that says whether values computed from private data without noise may be logged."""

    @property
    def private_diagnostics(self) -> bool:
        """``False``: such values stay out of logs, warnings and the run's ledger."""
        ...


def private_diagnostics_allowed(strategy: object) -> bool:
    """Whether ``strategy`` (a trainer's, or ``None`` before a trainer) lets private diagnostics into the logs.

    A strategy without a :class:`DiagnosticsPolicy` (no DP-SGD) protects nothing, so it forbids nothing: ``True``.
    """
    return not isinstance(strategy, DiagnosticsPolicy) or strategy.private_diagnostics
