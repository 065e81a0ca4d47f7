"""``privacy_ledger.json``: the run's privacy spend, kept current in the log folder for audits and crashes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from dplit.privacy.accountant import Mechanism, PrivacyAccountant

LEDGER_FILE = "privacy_ledger.json"


def write_ledger(directory: str | Path, state: dict[str, Any], *, epsilon: float) -> Path:
    """Atomically replace ``directory/privacy_ledger.json`` with ``state`` and ``epsilon`` (strict JSON).

    An infinite ε (σ = 0) is written as ``null`` with ``"epsilon_infinite": true``, never as ``Infinity``.
    """
    path = Path(directory) / LEDGER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    finite = math.isfinite(epsilon)
    record = {**state, "epsilon": epsilon if finite else None, "epsilon_infinite": not finite}
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(_strict(record), indent=1, allow_nan=False))
    os.replace(temporary, path)
    return path


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no infinity or NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


class RunLedger:
    """One run's privacy ledger: its accountant, the state a resumed checkpoint brought, and its JSON file."""

    def __init__(self) -> None:
        self.accountant: PrivacyAccountant | None = None
        self._restored: dict[str, Any] | None = None
        self._directory: str | None = None

    def restore(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's ledger state, continued by :meth:`open`."""
        self._restored = state

    @property
    def restored_noise_multiplier(self) -> float | None:
        """The σ a resumed run's plan was calibrated for (``None`` for a fresh run)."""
        return self._restored.get("noise_multiplier") if self._restored else None

    @property
    def steps(self) -> int:
        """DP steps taken so far (those of the restored checkpoint before :meth:`open`)."""
        if self.accountant is not None:
            return self.accountant.steps
        history = self._restored["accountant"]["history"] if self._restored else []
        return sum(int(count) for _, _, count in history)

    def open(self, *, delta: float, mechanism: Mechanism, directory: str | None) -> PrivacyAccountant:
        """Start the accountant (continuing a restored ledger); the file goes to ``directory`` (``None``: no file)."""
        self.accountant = PrivacyAccountant(delta=delta, mechanism=mechanism)
        if self._restored is not None:
            self.accountant.load_state_dict(self._restored["accountant"])
        self._directory = directory
        return self.accountant

    def state(self, facts: dict[str, Any]) -> dict[str, Any]:
        """What checkpoints keep: the accountant's history and the run's privacy ``facts`` (σ, C, q, N, ...)."""
        assert self.accountant is not None
        return {"accountant": self.accountant.state_dict(), **facts}

    def write(self, facts: dict[str, Any], *, epsilon: float) -> None:
        """Replace the ledger file with the current state and ε (no-op without a directory)."""
        if self._directory is not None:
            write_ledger(self._directory, self.state(facts), epsilon=epsilon)
