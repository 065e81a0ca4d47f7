"""Where the repository is, for tests at any depth under tests/."""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
"""The repository root (configs/, dplit/, tests/ ...)."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The real SmolLM2-135M-Instruct checkpoint in the shared data folder (``smollm2-135m-instruct/``)."""
