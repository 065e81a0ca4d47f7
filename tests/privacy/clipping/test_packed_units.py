"""Packed rows: each document (or user) clipped as one example, exactly, in float64 at σ = 0.

The oracle is the brute-force loop on the UNPACKED documents: each document's pieces run alone, one padded row each,
one backward per document; the packed run must give the same per-document norms and clipped sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from dplit.backbone.isolation import SEGMENT_KEY
from dplit.data.packing import pack_documents
from dplit.data.text import TextCollator, TextExample
from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.norms.factors import (
    DenseFactor,
    FactoredGradient,
    IndexFactor,
    example_slice,
    live_positions,
    squared_norm,
)
from dplit.privacy.clipping.parameter_norms import (
    CHUNK_ELEMENTS,
    _computed_squared_norms,
    _exact_squared_norm,
    length_groups,
    parameter_squared_norm,
)
from dplit.privacy.clipping.self_check import check_ghost_norms
from dplit.privacy.clipping.token_units import TOKEN_UNIT_KEY, relaid, token_units_of, unit_token_sums
from dplit.privacy.clipping.units import UNIT_KEY, placeholder_example
from dplit.privacy.refusal import SettingError
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_unit_gradients
from tests.helpers.families import VOCAB, tiny_task
from tests.helpers.oracles import assert_close, run

ROW = 16
MIXES = {
    "one_per_row": [16, 15, 16, 14],
    "dozens_per_row": [1, 2, 1, 3, 1, 1, 2, 1, 1, 2, 1, 1, 4, 1, 1, 2, 1, 1, 1, 3, 1, 2, 1, 1, 1, 2, 1],
    "spanning_rows": [29, 5, 3, 9, 2, 16, 1],  # 29 tokens: two rows of one document
}


def packed_task(family: str, policy: str, **settings: object) -> CausalLanguageModel:
    """A tiny float64 LM; Llama with SDPA (its eager attention takes the softmax in float32: ~1e-7, not 1e-9)."""
    attention = "sdpa" if family == "llama" else "eager"
    return tiny_task("language_model", family, policy, attn_implementation=attention, **settings)  # type: ignore[return-value]


def documents(lengths: Sequence[int], seed: int = 0) -> list[TextExample]:
    """Random documents; the second has a prompt (loss on its response only), one repeats a token (tied ids)."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for index, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        prompt = n // 2 if index == 1 else 0
        docs.append(TextExample(input_ids=ids, loss_mask=[0] * prompt + [1] * (n - prompt)))
    if len(docs) > 2:
        docs[2]["input_ids"] = [5] * len(docs[2]["input_ids"])
    return docs


def unpacked(docs: Sequence[TextExample], users: Sequence[int] | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Each document cut into ROW-token pieces, one right-padded row per piece, and each row's unit."""
    pieces, owners = [], []
    for index, doc in enumerate(docs):
        for start in range(0, len(doc["input_ids"]), ROW):
            piece = slice(start, start + ROW)
            pieces.append(TextExample(input_ids=doc["input_ids"][piece], loss_mask=doc["loss_mask"][piece]))
            owners.append(index if users is None else users[index])
    return TextCollator(pad_token_id=0)(pieces), torch.tensor(owners)


def in_unit_order(grads: list[dict[str, Tensor]], owners: Tensor, packed: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """The brute-force units (in order of first row) reordered as the engine numbers them (first packed token)."""
    labels = packed[TOKEN_UNIT_KEY][packed[TOKEN_UNIT_KEY] >= 0].tolist()
    engine_order = list(dict.fromkeys(labels))
    brute_order = list(dict.fromkeys(owners.tolist()))
    return [grads[brute_order.index(label)] for label in engine_order]


def check_packed(
    model: CausalLanguageModel,
    docs: list[TextExample],
    clip: float,
    users: list[int] | None = None,
    *,
    rtol: tuple[float, float] = (1e-9, 1e-9),
) -> None:
    """The packed run's per-unit norms and clipped sum against the brute-force loop on the unpacked documents.

    ``rtol``: of the norms and of the clipped sum (float64: 1e-9 both).
    """
    packed = pack_documents(docs, max_length=ROW, pad_token_id=0, users=users).batch
    plain, owners = unpacked(docs, users)
    expected_units = in_unit_order(per_unit_gradients(model, model.per_example_loss, plain, owners), owners, packed)
    stats, grads = run(build_engine("ghost", model, max_grad_norm=clip), model, model.per_example_loss, packed)
    assert stats.norms.shape == (len(expected_units),)
    assert_close(stats.norms, gradient_norms(expected_units), rtol=rtol[0])
    expected = clipped_sum(expected_units, clip)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert_close(grad, expected[name], rtol=rtol[1])


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("policy", ["tied", "untied", "lora"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_packed_documents_clipped_sum_is_a_loop_over_the_unpacked_documents(
    family: str, policy: str, mix: str
) -> None:
    """GPT-2 and Llama, tied / untied / LoRA; rows of one, of dozens, and a document spanning two rows."""
    check_packed(packed_task(family, policy), documents(MIXES[mix]), clip=0.05)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_users_are_clipped_across_all_their_documents_and_rows(family: str) -> None:
    """User-level DP: a user's documents (one spanning two rows) are one unit."""
    lengths = MIXES["spanning_rows"]
    check_packed(packed_task(family, "tied"), documents(lengths), clip=0.05, users=[3, 1, 3, 8, 1, 1, 3])


def test_with_activation_checkpointing_the_recomputed_calls_are_per_document_too() -> None:
    model = packed_task("llama", "lora", gradient_checkpointing=True)
    check_packed(model, documents(MIXES["spanning_rows"]), clip=0.05)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_with_a_small_bound_each_documents_contribution_is_at_most_c(family: str) -> None:
    """Each document's true gradient (the unpacked loop's) times its clip factor has norm ≤ C."""
    model, clip, docs = packed_task(family, "tied"), 1e-3, documents(MIXES["dozens_per_row"])
    packed = pack_documents(docs, max_length=ROW, pad_token_id=0).batch
    plain, owners = unpacked(docs)
    truth = in_unit_order(per_unit_gradients(model, model.per_example_loss, plain, owners), owners, packed)
    engine = build_engine("ghost", model, max_grad_norm=clip)
    stats, _ = run(engine, model, model.per_example_loss, packed)
    contributions = engine.factors(stats.norms) * gradient_norms(truth)
    trained = sum(len(doc["input_ids"]) >= 2 for doc in docs)  # a one-token document predicts nothing: zero gradient
    assert int((stats.norms > clip).sum()) == trained
    assert bool((contributions <= clip * (1 + 1e-9)).all())


def test_a_model_leaking_across_documents_fails_the_norm_check() -> None:
    """Cross-document attention switched on (a plain causal mask over the row): the per-document norms differ.

    The leaking model's true per-document gradients (autograd of each document's loss on the packed row) are not
    what the token-restricted rule computes, so the same check that passes for an isolating model fails here.
    """
    model = packed_task("gpt2", "tied")
    docs = documents(MIXES["dozens_per_row"])
    packed = pack_documents(docs, max_length=ROW, pad_token_id=0).batch
    leaking = {**packed, SEGMENT_KEY: packed[SEGMENT_KEY].clamp(max=0)}  # one "document" per row for attention
    labels = packed[TOKEN_UNIT_KEY][packed[TOKEN_UNIT_KEY] >= 0].unique()  # per_document_autograd's order
    units = in_unit_order(per_document_autograd(model, leaking), labels, packed)
    stats, _ = run(build_engine("ghost", model, max_grad_norm=0.05), model, model.per_example_loss, leaking)
    isolated = in_unit_order(per_document_autograd(model, packed), labels, packed)
    isolated_stats, _ = run(build_engine("ghost", model, max_grad_norm=0.05), model, model.per_example_loss, packed)
    assert_close(isolated_stats.norms, gradient_norms(isolated), rtol=1e-9)  # the check passes when isolated
    error = (stats.norms - gradient_norms(units)).abs().max() / gradient_norms(units).max()
    assert float(error) > 1e-3  # and fails when documents see each other


def per_document_autograd(model: CausalLanguageModel, packed: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Each document's gradient by autograd on the packed rows as given: the sum of its tokens' losses."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    plain = {key: value for key, value in packed.items() if key not in (TOKEN_UNIT_KEY, UNIT_KEY)}
    units = packed[TOKEN_UNIT_KEY]
    grads = []
    for label in units[units >= 0].unique().tolist():
        loss = (model.per_example_loss(plain) * (units == label)).sum()
        grad = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads.append(
            {n: g if g is not None else torch.zeros_like(params[n]) for n, g in zip(params, grad, strict=True)}
        )
    return grads


def test_the_first_batch_self_check_passes_isolated_rows_and_refuses_leaking_ones() -> None:
    """The run's self-check (autograd per document on the packed rows) is the isolation check at run time."""
    model = packed_task("gpt2", "tied")
    packed = pack_documents(documents(MIXES["dozens_per_row"]), max_length=ROW, pad_token_id=0).batch
    engine = GhostEngine(model, max_grad_norm=0.05)
    check_ghost_norms(engine, model, model.per_example_loss, packed, examples=2)
    leaking = {**packed, SEGMENT_KEY: packed[SEGMENT_KEY].clamp(max=0)}
    with pytest.raises(ValueError, match="trainable parameter"):
        check_ghost_norms(engine, model, model.per_example_loss, leaking, examples=2)


def test_the_per_example_engine_refuses_packed_rows() -> None:
    model = packed_task("gpt2", "tied")
    packed = pack_documents(documents([3, 4]), max_length=ROW, pad_token_id=0).batch
    with pytest.raises(SettingError, match="data.packing=true needs"):
        build_engine("per_example", model, max_grad_norm=1.0).accumulate(model.per_example_loss, packed)


def test_token_units_are_numbered_by_first_token_and_laid_side_by_side() -> None:
    units = token_units_of({TOKEN_UNIT_KEY: torch.tensor([[7, 7, 3, -1], [3, 9, 9, 9]])})
    assert units is not None and units.count == 3 and units.longest == 3
    assert units.unit.tolist() == [0, 0, 1, 1, 2, 2, 2] and units.slot.tolist() == [0, 1, 0, 1, 0, 1, 2]
    values = torch.arange(1.0, 9.0).reshape(2, 4)  # padding (position 3 of row 0, value 4) is in no unit
    assert relaid(values, units).tolist() == [[1, 2, 0], [3, 5, 0], [6, 7, 8]]
    assert unit_token_sums(values, units).tolist() == [3, 8, 21]
    with pytest.raises(ValueError, match="must be a \\[B, T\\] integer tensor"):
        token_units_of({TOKEN_UNIT_KEY: torch.zeros(3)})


def test_a_placeholder_pass_of_a_packed_batch_adds_zero() -> None:
    """Sharded weights: a rank without a micro-batch runs a placeholder forward shaped like a packed batch."""
    model = packed_task("gpt2", "tied")
    packed = pack_documents(documents([3, 4]), max_length=ROW, pad_token_id=0).batch
    stats, grads = run(
        build_engine("ghost", model, max_grad_norm=1.0),
        model,
        lambda rows: model.per_example_loss(rows) * 0.0,
        placeholder_example(packed),
    )
    assert stats.norms.shape == (1,) and all(bool((grad == 0).all()) for grad in grads.values())


def test_the_grams_of_units_of_different_lengths_span_each_groups_own_positions() -> None:
    """Units of 1 to 29 live positions in slots of 29: grouped by length, each group's Grams cut to its own longest.

    The grouped norms equal the norms of the whole slots (the positions left out hold zero vectors), and a position
    zeroed in the middle of a unit (a masked token) is not mistaken for the unit's end.
    """
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([29, 1, 3, 16, 2, 9, 5, 17, 28, 4])
    live = torch.arange(29)[None, :] < lengths[:, None]  # [U, L]
    left = torch.randn(10, 29, 6, generator=generator, dtype=torch.float64) * live[..., None]
    right = torch.randn(10, 29, 5, generator=generator, dtype=torch.float64) * live[..., None]
    right[3, 7] = 0.0  # a zero output gradient inside unit 3
    indices = torch.randint(0, 6, (10, 29), generator=generator)
    uses = [
        FactoredGradient(DenseFactor(left), DenseFactor(right)),
        FactoredGradient(IndexFactor(indices, 6), DenseFactor(right)),  # an embedding-like second use
    ]
    groups = length_groups(uses)
    assert [int(x) for x in live_positions(uses[0])] == lengths.tolist()
    assert sorted(i for index, _ in groups for i in index.tolist()) == list(range(10)) and len(groups) == 6
    for index, kept in groups:
        assert kept[0] == int(lengths[index].max()) and kept[0] < 2 * int(lengths[index].min()) + 1
    whole = _exact_squared_norm([example_slice(use, 0, 10) for use in uses])  # every slot, the same float64 sums
    for chunk in (CHUNK_ELEMENTS, 400):  # one copy, or a few examples a copy (as on a CPU)
        assert_close(_computed_squared_norms(uses, chunk_elements=chunk)[0], whole, rtol=1e-12)  # less the zero terms
    assert bool((parameter_squared_norm(uses) >= whole).all())  # with the rounding slack of the untrimmed T
    assert_close(parameter_squared_norm(uses), whole, rtol=1e-9)
    for use in uses:
        assert_close(
            _computed_squared_norms([use], chunk_elements=CHUNK_ELEMENTS)[0],
            squared_norm(example_slice(use, 0, 10)),
            rtol=1e-12,
        )
