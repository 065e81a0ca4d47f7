"""``privacy_ledger.json``: the run's privacy spend, kept current in the log folder for audits and crashes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

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
