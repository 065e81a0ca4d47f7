"""What a DP-SGD run states about itself: its privacy unit, its segment of the weights' history, a resume's changes.

Plain functions of public parameters (σ, q, C, N, k, the clipping mode and its noisy state): nothing here is computed
from the training data, except the largest user's row count, which only ``private_diagnostics`` lets into the
run's own ledger and never into the weights' history.
"""

from __future__ import annotations

from typing import Any

from dplit.privacy.clip_bound import FixedBound
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.noise import NoiseSource
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings
from dplit.privacy.training_units import TrainingUnits

MECHANISM_FACTS = ("clip_mode", "max_grad_norm", "max_rows_per_user")
"""The facts of a run's mechanism a resume may change (said in one line; the privacy unit and N it may not)."""


NO_NOISE_WARNING = (
    f"{FLAG_OWNER}.noise_multiplier=0: NO NOISE is added, so this run is NOT differentially private (ε = ∞); "
    "clipping alone protects nothing"
)
"""The warning a run without noise starts with (``FLAG_OWNER`` replaced by the strategy in use)."""


def unit_facts(units: TrainingUnits | None, *, private_diagnostics: bool) -> dict[str, Any]:
    """The unit's facts (``example`` before the training set is known; see :meth:`TrainingUnits.facts`)."""
    return units.facts(private_diagnostics=private_diagnostics) if units is not None else {"privacy_unit": "example"}


def segment_facts(
    settings: DPSGDSettings, *, units: TrainingUnits | None, delta: float, noise: NoiseSource, bound: FixedBound
) -> dict[str, Any]:
    """A run's public parameters, as its segment of the weights' privacy history records them (no diagnostic)."""
    return {
        "max_grad_norm": settings.max_grad_norm, "dataset_size": units.size if units else None, "delta": delta,
        "mechanism": settings.accountant, "noise": noise.describe(), "noise_secure": noise.secure,
        **unit_facts(units, private_diagnostics=False), **bound.facts(),
        **({"people_overlap": settings.people_overlap} if settings.people_overlap is not None else {}),
    }  # fmt: skip


def mechanism_changes(
    restored: dict[str, Any], *, run_id: str, settings: DPSGDSettings, units: TrainingUnits | None, bound: FixedBound
) -> str | None:
    """The line saying what a resume changes of the resumed run's mechanism (clipping mode, C, k); ``None``: nothing.

    Args:
        restored: the resumed checkpoint's ledger facts (``{}`` for a fresh run).
        run_id: the resumed run.
        settings: this run's knobs.
        units: this run's units.
        bound: this run's clip bound (a learned quantile bound C_t of another mode is dropped).
    """
    now = {**unit_facts(units, private_diagnostics=False), **bound.facts(), "max_grad_norm": settings.max_grad_norm}
    before = {key: restored.get(key) for key in MECHANISM_FACTS if restored.get(key) is not None}
    changed = [f"{key} {value!r} → {now.get(key)!r}" for key, value in before.items() if value != now.get(key)]
    if not changed:
        return None
    learned = restored.get("clip_bound") if restored.get("clip_mode") != bound.mode else None
    dropped = f"; the learned quantile bound C_t = {learned:.6g} is not used" if learned is not None else ""
    return (
        f"DP-SGD: this resume changes the mechanism of run {run_id}: {', '.join(changed)}{dropped} (the weights' "
        "privacy history records each segment's own)"
    )


def ledger_facts(
    settings: DPSGDSettings, *, history: PrivacyHistory, noise: NoiseSource, bound: FixedBound,
    units: TrainingUnits | None, sigma: float | None, epsilon_steps: int,
) -> dict[str, Any]:  # fmt: skip
    """What a run's ledger records beside the accountant's history (never a seed; diagnostics as the settings say)."""
    reason = history.reason_not_private()
    gradient_noise = {"gradient_noise_multiplier": bound.gradient_noise_multiplier(sigma or 0.0)}
    return {
        "noise_multiplier": sigma, "max_grad_norm": settings.max_grad_norm,
        "sample_rate": units.sample_rate if units else None, "dataset_size": units.size if units else None,
        "target_epsilon": settings.target_epsilon, "expected_batch_size": units.expected_batch_size if units else None,
        "epsilon_steps": epsilon_steps, "sampling": "poisson", **bound.facts(), **bound.state_dict(),
        **(gradient_noise if bound.mode == "quantile" else {}),
        **unit_facts(units, private_diagnostics=settings.private_diagnostics), **(units.packing if units else {}),
        "clipping": settings.clipping, "tied_norm": settings.tied_norm, "noise": noise.describe(),
        "noise_secure": noise.secure and history.noise_secure,
        "differentially_private": reason is None and bool(sigma), "reason_not_private": reason,
        "privacy_history": history.state_dict(),
    }  # fmt: skip


def start_line(
    settings: DPSGDSettings, *, sigma: float, units: TrainingUnits, delta: float, steps: int, noise: NoiseSource
) -> str:
    """The line a DP-SGD run starts with: σ, C and its mode, q, the expected batch in units, δ, engine, noise."""
    return (
        f"DP-SGD: σ={sigma:.4f}, {_clip_text(settings)}, q={units.sample_rate:.3g}, expected batch "
        f"{units.expected_batch_size:.1f} {units.name}s, δ={delta:.3g}, clipping={settings.clipping}, "
        f"steps so far {steps}, noise {noise.describe()}"
    )


def _clip_text(settings: DPSGDSettings) -> str:
    """The start-up line's clipping: ``C=1.0 (clip_mode fixed)``, ``C_0=1.0 (clip_mode quantile: ...)`` or automatic."""
    bound, mode = settings.max_grad_norm, settings.clip_mode
    if mode == "quantile":
        return f"C_0={bound} (clip_mode quantile: C follows a quantile of the norms)"
    if mode == "automatic":
        return f"C={bound} (clip_mode automatic: a scale, not a bound)"
    return f"C={bound} (clip_mode fixed)"
