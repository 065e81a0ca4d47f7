"""Privacy accounting for Poisson-sampled DP-SGD: ε so far, σ calibration, checkpointable state."""

from __future__ import annotations

from typing import Any, Literal

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

Mechanism = Literal["prv", "rdp"]


def default_delta(dataset_size: int) -> float:
    """The field's default δ = N^-1.1 for a dataset of N examples."""
    if dataset_size < 1:
        raise ValueError(f"cannot choose δ for an empty dataset (size {dataset_size})")
    return float(dataset_size) ** -1.1


def calibrate_noise_multiplier(
    *, target_epsilon: float, delta: float, sample_rate: float, steps: int, mechanism: Mechanism = "prv"
) -> float:
    """The smallest σ (to opacus' tolerance) whose ε after ``steps`` Poisson steps at rate q is ≤ target."""
    if target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=max(1, steps),
            accountant=mechanism,
        )
    )


class PrivacyAccountant:
    """The privacy ledger of one training run: every (σ, q) step taken, and the ε it has spent.

    Args:
        delta: the δ at which ε is reported.
        mechanism: opacus accountant, ``"prv"`` (tight, default) or ``"rdp"``.
    """

    def __init__(self, *, delta: float, mechanism: Mechanism = "prv") -> None:
        if mechanism not in ("prv", "rdp"):
            raise ValueError(f"accountant must be 'prv' or 'rdp', got {mechanism!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self._delta = float(delta)
        self._mechanism = mechanism
        self._history: list[tuple[float, float, int]] = []

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
        """ε spent so far, or what it would be after ``extra_steps`` more steps at (σ, q)."""
        history = list(self._history)
        if extra_steps:
            history.append((float(noise_multiplier), float(sample_rate), extra_steps))
        if not history:
            return 0.0
        if any(sigma <= 0 for sigma, _, _ in history):
            return float("inf")
        accountant = create_accountant(self._mechanism)
        accountant.history = history
        return float(accountant.get_epsilon(self._delta))

    def state_dict(self) -> dict[str, Any]:
        """The ledger, for checkpoints."""
        return {"delta": self._delta, "mechanism": self._mechanism, "history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ledger (δ and mechanism must match this run's)."""
        if state["mechanism"] != self._mechanism or abs(state["delta"] - self._delta) > 1e-15:
            raise ValueError(
                f"checkpoint ledger was kept with accountant={state['mechanism']}, δ={state['delta']}; "
                f"this run asks for accountant={self._mechanism}, δ={self._delta}: keep them equal on resume"
            )
        self._history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
