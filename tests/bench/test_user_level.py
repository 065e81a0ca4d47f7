"""bench/user_level.py without the shared data: the user-column copy of a tiny TSV and the users-per-batch rule.

The arms themselves need SmolLM2 and SST-2 (minutes on a CPU); the script's recorded run is in
bench/results/user_level/.
"""

from __future__ import annotations

from pathlib import Path

from bench.user_level import user_batch, write_user_tsv
from dplit.data.users import synthetic_users


def test_write_user_tsv_adds_the_seeded_users(tmp_path: Path) -> None:
    source = tmp_path / "train.tsv"
    source.write_text("sentence\tlabel\n" + "".join(f"row {i} \t{i % 2}\n" for i in range(50)), encoding="utf-8")
    users = write_user_tsv(source, tmp_path / "out" / "train.tsv", 30, most_rows=5)
    assert users == synthetic_users(30, seed=0, most_rows=5)
    lines = (tmp_path / "out" / "train.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "sentence\tlabel\tuser"
    assert lines[1:] == [f"row {i} \t{i % 2}\t{user}" for i, user in enumerate(users)]


def test_user_batch_matches_the_expected_rows_per_step() -> None:
    users = ["a"] * 10 + ["b"] * 2 + ["c"]  # min(rows, 4): 4, 2, 1 → 7/3 rows per sampled user
    batch, per_user = user_batch(users, 8, 4)
    assert per_user == 7 / 3
    assert batch == 3  # 8 / (7/3) = 3.43
    assert user_batch(["a"], 1, 4)[0] == 1
