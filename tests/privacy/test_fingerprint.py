"""rows_fingerprint: what data-parallel ranks compare before the first DP step (tests/test_ddp.py runs the refusal)."""

from __future__ import annotations

import torch

from dplit.privacy.fingerprint import rows_fingerprint
from tests.helpers.tiny import RandomTokens


def test_the_same_rows_give_the_same_fingerprint_and_any_change_another() -> None:
    rows = [RandomTokens(20, seed=0)[i] for i in range(20)]
    same = rows_fingerprint(rows)
    assert rows_fingerprint([(ids.clone(), label) for ids, label in rows]) == same
    changed = list(rows)
    changed[7] = (torch.cat([changed[7][0][:-1], changed[7][0][-1:] + 1]), changed[7][1])
    swapped = [rows[1], rows[0], *rows[2:]]
    relabelled = [*rows[:-1], (rows[-1][0], 1 - rows[-1][1])]
    others = [changed, swapped, relabelled, rows[:-1], [(ids.int(), label) for ids, label in rows]]
    assert len({same, *(rows_fingerprint(other) for other in others)}) == 1 + len(others)


def test_dict_rows_and_nested_values_are_fingerprinted_by_content() -> None:
    rows = [{"input_ids": [1, 2, 3], "label": 0, "text": "a"}, {"label": 1, "input_ids": [4], "text": "b"}]
    reordered_keys = [dict(reversed(list(row.items()))) for row in rows]
    assert rows_fingerprint(rows) == rows_fingerprint(reordered_keys)
    assert rows_fingerprint(rows) != rows_fingerprint([rows[0], {**rows[1], "text": "c"}])
