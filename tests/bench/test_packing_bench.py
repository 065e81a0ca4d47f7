"""bench/packing.py: every model shape at every row length, the table and results rewritten as rows are measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.packing import main


@pytest.mark.slow
def test_the_packing_benchmark_measures_each_model_at_each_row_length(tmp_path: Path) -> None:
    args = ["--model", "tiny", "smollm2_tiny", "--row", "24", "32", "--documents", "4", "--micro", "4",
            "--repeats", "1", "--mixes", "lognormal", "--out", str(tmp_path)]  # fmt: skip
    main(args)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["model"], r["row"]) for r in rows] == [
        ("tiny", 24),
        ("tiny", 32),
        ("smollm2_tiny", 24),
        ("smollm2_tiny", 32),
    ]
    for r in rows:
        assert r["packed_dp_tokens_per_s"] > 0 and r["padded_dp_tokens_per_s"] > 0 and 0 < r["packed_fill"] <= 1
    table = (tmp_path / "table.md").read_text()
    assert "| smollm2_tiny | 32 | lognormal |" in table and "| tiny | 24 | lognormal |" in table
