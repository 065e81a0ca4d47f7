"""Packing documents into rows: first-fit decreasing, and each document isolated (its logits as if run alone)."""

from __future__ import annotations

import pytest
import torch

from dplit.backbone.isolation import POSITION_KEY, SEGMENT_KEY, isolating_mask, isolation_refusal
from dplit.data.packing import first_fit_decreasing, pack_documents
from dplit.privacy.clipping.token_units import TOKEN_UNIT_KEY
from dplit.privacy.clipping.units import UNIT_KEY
from tests.helpers.families import VOCAB, tiny_task


def documents(lengths: list[int], seed: int = 0) -> list[dict[str, list[int]]]:
    """Random documents of ``lengths`` tokens, every token trained."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist(), "loss_mask": [1] * n}
        for n in lengths
    ]


def test_first_fit_decreasing_places_every_token_once_within_rows() -> None:
    lengths = [3, 9, 1, 4, 4, 7, 2, 12, 5]
    rows = first_fit_decreasing(lengths, 8)
    assert all(sum(piece.length for piece in row) <= 8 for row in rows)
    covered = sorted((p.document, t) for row in rows for p in row for t in range(p.start, p.stop))
    assert covered == sorted((d, t) for d, n in enumerate(lengths) for t in range(n))
    long_rows = [row for row in rows if any(p.document in (1, 7) for p in row)]
    assert all(len(row) == 1 for row in long_rows)  # a document longer than a row has rows of its own
    assert len(rows) == 8  # 12 and 9: two rows each, alone; then 7+1, 5+3, 4+4 and 2


def test_packed_rows_say_each_tokens_document_position_and_unit() -> None:
    packed = pack_documents(documents([3, 2, 6]), max_length=6, pad_token_id=0)
    batch = packed.batch
    assert batch[SEGMENT_KEY].tolist() == [[2] * 6, [0, 0, 0, 1, 1, -1]]
    assert batch[POSITION_KEY].tolist() == [list(range(6)), [0, 1, 2, 0, 1, 0]]
    assert torch.equal(batch[TOKEN_UNIT_KEY], batch[SEGMENT_KEY])
    assert batch["attention_mask"].tolist() == [[1] * 6, [1] * 5 + [0]]
    assert packed.tokens == 11 and packed.capacity == 12


def test_a_long_documents_rows_share_a_group_and_a_users_documents_their_rows() -> None:
    packed = pack_documents(documents([9, 2, 2]), max_length=4, pad_token_id=0)
    groups = packed.batch[UNIT_KEY].tolist()
    assert groups[0] == groups[1] == groups[2] != groups[3] and len(groups) == 4  # 9 tokens: 3 rows, one group
    by_user = pack_documents(documents([2, 2, 2]), max_length=4, pad_token_id=0, users=[5, 7, 5])
    assert by_user.batch[TOKEN_UNIT_KEY].tolist() == [[5, 5, 5, 5], [7, 7, -1, -1]]  # users never share a row
    assert by_user.batch[UNIT_KEY].tolist() == [0, 1]


def test_padding_sees_itself_and_no_document_sees_padding_or_another_document() -> None:
    segments = torch.tensor([[0, 0, 1, -1]])
    mask = isolating_mask(segments, torch.float64)[0, 0] == 0
    assert torch.equal(isolating_mask(segments, torch.bool)[0, 0], mask)  # SDPA's boolean form: the same pattern
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, False, True],
    ]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_each_documents_logits_in_a_packed_row_are_its_logits_alone(family: str, attention: str) -> None:
    """float64: a packed row of several documents (and a long one cut into rows) against each piece run alone."""
    model = tiny_task("language_model", family, "tied", attn_implementation=attention).eval()
    docs = documents([5, 11, 3, 1, 7, 2, 20])
    packed = pack_documents(docs, max_length=12, pad_token_id=0).batch
    with torch.no_grad():
        logits = model.packed_logits(packed["input_ids"], packed[SEGMENT_KEY], packed[POSITION_KEY])
        for row in range(packed["input_ids"].shape[0]):
            for document in packed[SEGMENT_KEY][row].unique().tolist():
                if document < 0:
                    continue
                where = (packed[SEGMENT_KEY][row] == document).nonzero().flatten()
                ids = packed["input_ids"][row, where][None]
                alone = model(ids, torch.ones_like(ids))  # [1, n, V]
                scale = alone.abs().max()
                assert float((logits[row, where] - alone[0]).abs().max() / scale) <= 1e-10


def test_an_attention_kernel_that_takes_no_mask_is_refused_in_one_line() -> None:
    model = tiny_task("language_model", "llama", "tied")
    assert isolation_refusal(model.backbone) is None
    model.backbone.config._attn_implementation = "flash_attention_2"
    reason = isolation_refusal(model.backbone)
    assert reason is not None and "\n" not in reason and "data.packing" in reason
