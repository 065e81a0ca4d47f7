"""The privacy engine: per-example clipping and accounting, in plain PyTorch (no Lightning)."""

from dplit.privacy.engine import ClippingEngine, ClipStats, PerExampleEngine, build_engine

__all__ = ["ClipStats", "ClippingEngine", "PerExampleEngine", "build_engine"]
