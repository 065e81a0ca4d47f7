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
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.user_sampling import UserLevel

MECHANISM_FACTS = ("clip_mode", "max_grad_norm", "max_rows_per_user")
"""The facts of a run's mechanism a resume may change (said in one line; the privacy unit and N it may not)."""


PAIR_UNIT = "pair"
"""The privacy unit of a dataset of preference pairs (each item two rows clipped as one unit)."""


def row_unit_of(dataset: object) -> str:
    """The unit a dataset without users samples and clips by: ``"pair"`` when it declares pairs, else ``"example"``."""
    return PAIR_UNIT if getattr(dataset, "privacy_unit", None) == PAIR_UNIT else "example"


def packing_facts(loader: object) -> dict[str, Any]:
    """What a loader whose collate function packs documents into rows says of it (``{}``: no packing).

    A packing collate function (:class:`~dplit.data.packing.PackingCollator`) states its public facts (the row
    length, that documents are isolated); nothing about the data.
    """
    facts = getattr(getattr(loader, "collate_fn", None), "ledger_facts", None)
    return dict(facts()) if callable(facts) else {}


def unit_facts(users: UserLevel | None, *, diagnostics: bool, unit: str = "example") -> dict[str, Any]:
    """The unit's facts: ``unit`` (``example``, ``pair``), or the user-level counts (``diagnostics``: largest user's rows)."""
    return {"privacy_unit": unit} if users is None else users.facts(private_diagnostics=diagnostics)


def segment_facts(
    settings: DPSGDSettings, *, dataset_size: int | None, delta: float, noise: NoiseSource, users: UserLevel | None,
    bound: FixedBound, unit: str = "example",
) -> dict[str, Any]:  # fmt: skip
    """A run's public parameters, as its segment of the weights' privacy history records them (no diagnostic)."""
    return {
        "max_grad_norm": settings.max_grad_norm, "dataset_size": dataset_size, "delta": delta,
        "mechanism": settings.accountant, "noise": noise.describe(), "noise_secure": noise.secure,
        **unit_facts(users, diagnostics=False, unit=unit), **bound.facts(),
    }  # fmt: skip


def mechanism_changes(restored: dict[str, Any], now: dict[str, Any], *, mode: str) -> str | None:
    """What a resume changes of the resumed run's mechanism (clipping mode, C, k), in words (``None``: nothing).

    Args:
        restored: the resumed checkpoint's ledger facts.
        now: this run's unit and clipping facts, and its ``max_grad_norm``.
        mode: this run's clipping mode (a learned quantile bound C_t of another mode is dropped).
    """
    before = {key: restored.get(key) for key in MECHANISM_FACTS if restored.get(key) is not None}
    changed = [f"{key} {value!r} → {now.get(key)!r}" for key, value in before.items() if value != now.get(key)]
    if not changed:
        return None
    learned = restored.get("clip_bound") if restored.get("clip_mode") != mode else None
    dropped = f"; the learned quantile bound C_t = {learned:.6g} is not used" if learned is not None else ""
    return f"{', '.join(changed)}{dropped}"


def ledger_facts(
    settings: DPSGDSettings, *, history: PrivacyHistory, noise: NoiseSource, bound: FixedBound,
    users: UserLevel | None, sigma: float | None, sample_rate: float | None, dataset_size: int | None,
    epsilon_steps: int, unit: str = "example",
) -> dict[str, Any]:  # fmt: skip
    """What a run's ledger records beside the accountant's history (never a seed; diagnostics as the settings say)."""
    reason = history.reason_not_private()
    expected = sample_rate * dataset_size if sample_rate is not None and dataset_size is not None else None
    gradient_noise = {"gradient_noise_multiplier": bound.gradient_noise_multiplier(sigma or 0.0)}
    return {
        "noise_multiplier": sigma, "max_grad_norm": settings.max_grad_norm, "sample_rate": sample_rate,
        "dataset_size": dataset_size, "target_epsilon": settings.target_epsilon, "expected_batch_size": expected,
        "epsilon_steps": epsilon_steps, "sampling": "poisson", **bound.facts(), **bound.state_dict(),
        **(gradient_noise if bound.mode == "quantile" else {}),
        **unit_facts(users, diagnostics=settings.private_diagnostics, unit=unit),
        "clipping": settings.clipping, "tied_norm": settings.tied_norm, "noise": noise.describe(),
        "noise_secure": noise.secure and history.noise_secure,
        "differentially_private": reason is None and bool(sigma), "reason_not_private": reason,
        "privacy_history": history.state_dict(),
    }  # fmt: skip


def start_line(
    settings: DPSGDSettings, *, sigma: float, sample_rate: float, expected: float, delta: float, steps: int,
    noise: NoiseSource, unit: str,
) -> str:  # fmt: skip
    """The line a DP-SGD run starts with: σ, C and its mode, q, the expected batch in ``unit`` s, δ, engine, noise."""
    unit = f"{unit}s"
    return (
        f"DP-SGD: σ={sigma:.4f}, {_clip_text(settings)}, q={sample_rate:.3g}, expected batch {expected:.1f} {unit}, "
        f"δ={delta:.3g}, clipping={settings.clipping}, steps so far {steps}, noise {noise.describe()}"
    )


def _clip_text(settings: DPSGDSettings) -> str:
    """The start-up line's clipping: ``C=1.0 (clip_mode fixed)``, ``C_0=1.0 (clip_mode quantile: ...)`` or automatic."""
    bound, mode = settings.max_grad_norm, settings.clip_mode
    if mode == "quantile":
        return f"C_0={bound} (clip_mode quantile: C follows a quantile of the norms)"
    if mode == "automatic":
        return f"C={bound} (clip_mode automatic: a scale, not a bound)"
    return f"C={bound} (clip_mode fixed)"
