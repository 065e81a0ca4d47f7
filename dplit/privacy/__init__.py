"""The privacy engine: per-example clipping and accounting, in plain PyTorch (no Lightning)."""

from dplit.privacy.engine import ClippingEngine, ClipStats
from dplit.privacy.ghost import GhostEngine
from dplit.privacy.per_example import PerExampleEngine

__all__ = ["ClipStats", "ClippingEngine", "GhostEngine", "PerExampleEngine", "build_engine"]


def build_engine(name: str, module: object, *, max_grad_norm: float, **options: object) -> ClippingEngine:
    """Construct the clipping engine called ``name`` (``"per_example"`` or ``"ghost"``) for ``module``."""
    if name == "per_example":
        return PerExampleEngine(module, max_grad_norm=max_grad_norm)  # type: ignore[arg-type]
    if name == "ghost":
        return GhostEngine(module, max_grad_norm=max_grad_norm, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown clipping engine {name!r}: choose 'per_example' or 'ghost'")
