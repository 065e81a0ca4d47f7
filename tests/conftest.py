"""Shared fixtures: tiny float64 models, the real-data folder, quiet offline environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def shared_data_dir() -> Path:
    """The folder with real GLUE SST-2 TSVs and the GPT-2 tokenizer, from ``DPLIT_DATA_DIR``."""
    folder = os.environ.get("DPLIT_DATA_DIR")
    if not folder or not Path(folder).is_dir():
        pytest.skip("DPLIT_DATA_DIR is not set to the shared data folder (GLUE SST-2 + GPT-2 tokenizer)")
    return Path(folder)
