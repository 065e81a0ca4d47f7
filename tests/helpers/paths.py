"""Where the repository is, for tests at any depth under tests/."""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
"""The repository root (configs/, dplit/, tests/ ...)."""
