"""PrivacyAccountant: the (σ, q, steps) a run took and the ε they spend, through opacus' RDP or PRV accountant.

opacus' accountants have a limited working range, and outside it they hang, allocate petabytes or raise errors that
mean nothing to a user: :mod:`~dplit.privacy.accounting.checks` refuses such plans before training,
:mod:`~dplit.privacy.accounting.calibration` searches σ only where the accountant works, and :func:`accounted_epsilon`
turns opacus' own errors into one-line errors (the measured limits: :mod:`~dplit.privacy.accounting.limits`).
"""

from __future__ import annotations

from typing import Any

import dplit.privacy.accounting.opacus_epsilon as opacus_epsilon
from dplit.privacy.accounting.checks import refuse_prv_grid
from dplit.privacy.accounting.limits import DELTA_MAX, History, Mechanism, describe
from dplit.privacy.refusal import OWNER, SettingError


def default_delta(dataset_size: int) -> float:
    """The field's default δ = N^-1.1 for a dataset of N examples."""
    if dataset_size < 1:
        raise SettingError(f"cannot choose δ for an empty dataset (size {dataset_size})")
    return float(dataset_size) ** -1.1


class PrivacyAccountant:
    """The privacy ledger of one training run: every (σ, q) step taken, and the ε it has spent.

    Args:
        delta: the δ at which ε is reported.
        mechanism: opacus accountant, ``"prv"`` (tight, default) or ``"rdp"``.
    """

    def __init__(self, *, delta: float, mechanism: Mechanism = "prv") -> None:
        if mechanism not in ("prv", "rdp"):
            raise SettingError(f"accountant must be 'prv' or 'rdp', got {mechanism!r}")
        if not 0 < delta < 1:
            raise SettingError(f"delta must be in (0, 1), got {delta}")
        self._delta = float(delta)
        self._mechanism = mechanism
        self._history: History = []

    @property
    def delta(self) -> float:
        """The δ at which ε is reported."""
        return self._delta

    @property
    def steps(self) -> int:
        """Number of DP steps taken so far."""
        return sum(count for _, _, count in self._history)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one DP step with noise σ and Poisson rate q."""
        last = self._history[-1] if self._history else None
        if last is not None and last[0] == noise_multiplier and last[1] == sample_rate:
            self._history[-1] = (last[0], last[1], last[2] + 1)
        else:
            self._history.append((float(noise_multiplier), float(sample_rate), 1))

    def epsilon(self, *, extra_steps: int = 0, noise_multiplier: float = 0.0, sample_rate: float = 0.0) -> float:
        """ε spent so far, or what it would be after ``extra_steps`` more steps at (σ, q).

        Raises:
            ValueError: in one line naming the flags, where the accountant cannot compute ε (a PRV grid over its
                limit, or an error from opacus).
        """
        history = list(self._history)
        if extra_steps:
            history.append((float(noise_multiplier), float(sample_rate), extra_steps))
        if not history:
            return 0.0
        if any(sigma <= 0 for sigma, _, _ in history):
            return float("inf")
        return accounted_epsilon(self._mechanism, history, self._delta)

    def state_dict(self) -> dict[str, Any]:
        """The ledger, for checkpoints."""
        return {"delta": self._delta, "mechanism": self._mechanism, "history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ledger (δ and mechanism must match this run's)."""
        if state["mechanism"] != self._mechanism or abs(state["delta"] - self._delta) > 1e-15:
            raise SettingError(
                f"checkpoint ledger was kept with accountant={state['mechanism']}, δ={state['delta']}; "
                f"this run asks for accountant={self._mechanism}, δ={self._delta}: keep them equal on resume"
            )
        self._history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]


def accounted_epsilon(mechanism: Mechanism, history: History, delta: float) -> float:
    """Opacus' ε for ``history`` at δ (refusing a PRV grid over its limit), its errors as one-line ValueErrors."""
    if mechanism == "prv":
        refuse_prv_grid(history, delta)
    try:
        with opacus_epsilon.quiet():
            if mechanism == "rdp":
                return opacus_epsilon.rdp_epsilon(history, delta)
            return opacus_epsilon.prv_epsilon(history, delta)
    except (ValueError, RuntimeError, MemoryError, OverflowError) as error:
        raise SettingError(_translate(error, mechanism, history, delta)) from error


def _translate(error: BaseException, mechanism: Mechanism, history: History, delta: float) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if "Cannot compute epsilon" in text:
        advice = f"use {OWNER}.target_delta ≤ {DELTA_MAX:g} (the default N^-1.1 is safe)"
    elif "Floating point errors" in text:
        advice = f"raise {OWNER}.target_delta, or use {OWNER}.accountant='rdp'"
    elif mechanism == "prv":
        advice = f"use {OWNER}.accountant='rdp', or change {OWNER}.noise_multiplier or the sample rate"
    else:
        advice = f"change {OWNER}.noise_multiplier or the sample rate q = data.batch_size / N"
    return (
        f"{OWNER}.accountant='{mechanism}' cannot compute ε for {describe(history)} at "
        f"δ={delta:.3g} (opacus: {text}): {advice}"
    )
