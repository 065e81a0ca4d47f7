"""``privacy_ledger.json``: the run's privacy spend, kept current in the log folder for audits and crashes."""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dplit.privacy.accounting import History, Mechanism, PrivacyAccountant

LEDGER_FILE = "privacy_ledger.json"
CHECKPOINT_KEY = "dplit_privacy"
"""The checkpoint entry holding a run's ledger (:meth:`RunLedger.state`)."""


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


def ledger_folders(checkpoint: Path, log_dir: str | None) -> list[Path]:
    """The version folders whose ledgers may belong to the run of ``checkpoint``: its own and their siblings."""
    roots = [checkpoint.resolve().parent.parent.parent]  # root/version_N/checkpoints/x.ckpt → root
    if log_dir is not None:
        roots.append(Path(log_dir).resolve().parent)
    folders = {folder for root in roots if root.is_dir() for folder in root.iterdir() if folder.is_dir()}
    return sorted(folders)


class RunLedger:
    """One run's privacy ledger: its accountant, the state a resumed checkpoint brought, and its JSON file.

    A run keeps one random ``run_id`` from its fresh start through every resume, so that the ledger files of
    its version folders can be told apart from other runs' (no value in it comes from the data).
    """

    def __init__(self) -> None:
        self.accountant: PrivacyAccountant | None = None
        self.run_id = secrets.token_hex(8)
        self._restored: dict[str, Any] | None = None
        self._directory: str | None = None

    def restore(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's ledger state, continued by :meth:`open`."""
        self._restored = state
        self.run_id = state.get("run_id", self.run_id)

    @property
    def restored_noise_multiplier(self) -> float | None:
        """The σ a resumed run's plan was calibrated for (``None`` for a fresh run)."""
        return self._restored.get("noise_multiplier") if self._restored else None

    @property
    def restored_dataset_size(self) -> int | None:
        """N of the run a resumed checkpoint belongs to (``None`` for a fresh run or an old ledger)."""
        return self._restored.get("dataset_size") if self._restored else None

    @property
    def steps(self) -> int:
        """DP steps taken so far (those of the restored checkpoint before :meth:`open`)."""
        if self.accountant is not None:
            return self.accountant.steps
        return history_steps(self._restored["accountant"]["history"]) if self._restored else 0

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
        return {"run_id": self.run_id, "accountant": self.accountant.state_dict(), **facts}

    def steps_after_checkpoint(self, folders: Iterable[Path]) -> tuple[History, str] | None:
        """The DP steps this run's newest ``privacy_ledger.json`` in ``folders`` counts beyond the checkpoint.

        Steps taken after the resumed checkpoint (an interrupt before the next checkpoint) touched the data: the
        model they trained is discarded, but their privacy cost stays counted. Returns those steps' (σ, q, steps)
        and a line saying what was found, or ``None``.
        """
        assert self.accountant is not None
        records = self._records(folders)
        if not records:
            return None
        path, state = max(records, key=lambda record: record[0].stat().st_mtime)
        checkpoint, recorded = self.accountant.steps, history_steps(state["accountant"]["history"])
        if recorded <= checkpoint:
            return None
        extra = _steps_beyond(state["accountant"]["history"], self.accountant.state_dict()["history"])
        message = (
            f"DP-SGD: the checkpoint's ledger has {checkpoint} DP steps, but this run's newest ledger {path} records "
            f"{recorded}: the model of the last {recorded - checkpoint} steps is discarded, but those steps touched "
            f"the data and stay counted (ε continues from {recorded} steps)"
        )
        return extra, message

    def has_record(self, folders: Iterable[Path]) -> bool:
        """Whether any of ``folders`` holds a ``privacy_ledger.json`` of this run (its ``run_id``)."""
        return bool(self._records(folders))

    def _records(self, folders: Iterable[Path]) -> list[tuple[Path, dict[str, Any]]]:
        records = [record for record in (_read_record(folder / LEDGER_FILE) for folder in folders) if record]
        return [(path, state) for path, state in records if state.get("run_id") == self.run_id]

    def write(self, facts: dict[str, Any], *, epsilon: float) -> None:
        """Replace the ledger file with the current state and ε (no-op without a directory)."""
        if self._directory is not None:
            write_ledger(self._directory, self.state(facts), epsilon=epsilon)


def history_steps(history: Iterable[tuple[float, float, int]]) -> int:
    """The number of DP steps in an accountant history of (σ, q, steps) entries."""
    return sum(int(count) for _, _, count in history)


def _steps_beyond(longer: Iterable[Sequence[float]], shorter: Iterable[Sequence[float]]) -> History:
    """The (σ, q, steps) entries of ``longer`` after the first ``steps`` of ``shorter`` (a history it extends)."""
    remaining = history_steps(shorter)  # type: ignore[arg-type]
    extra: History = []
    for sigma, rate, count in longer:
        taken = min(int(count), remaining)
        remaining -= taken
        if int(count) > taken:
            extra.append((float(sigma), float(rate), int(count) - taken))
    return extra


def _read_record(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """A ledger file and its content (``None`` if missing or unreadable)."""
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError):
        return None
