"""Per-example clipping: the engines that sum Σ_i min(1, C/‖g_i‖)·g_i, and the norm rules they are built on."""

from dplit.privacy.clipping.engine import ClippingEngine, ClipStats
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.per_example import PerExampleEngine

__all__ = ["ClipStats", "ClippingEngine", "GhostEngine", "PerExampleEngine", "build_engine"]


def build_engine(
    name: str, module: object, *, max_grad_norm: float, stability: float | None = None, **options: object
) -> ClippingEngine:
    """Construct the clipping engine called ``name`` (``"per_example"`` or ``"ghost"``) for ``module``.

    ``stability``: automatic clipping's γ (each example scaled by C / (‖g‖ + γ)); ``None`` clips to C.
    """
    if name == "per_example":
        return PerExampleEngine(module, max_grad_norm=max_grad_norm, stability=stability)  # type: ignore[arg-type]
    if name == "ghost":
        return GhostEngine(module, max_grad_norm=max_grad_norm, stability=stability, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown clipping engine {name!r}: choose 'per_example' or 'ghost'")
