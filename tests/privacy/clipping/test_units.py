"""Privacy units of several rows (user-level DP): each user's summed gradient clipped as one, in float64, σ = 0."""

from __future__ import annotations

import pytest
import torch

from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.units import UNIT_KEY, units_of
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients, per_unit_gradients
from tests.helpers.families import VOCAB, instruction_batch, tiny_task
from tests.helpers.oracles import assert_close, padded_batch, run

USERS = torch.tensor([4, 9, 9, 2, 2, 2, 2, 2, 2, 2])
"""Ten rows of three users, of 1, 2 and 7 rows (numbered out of order, as any id may be)."""
CLIP = 0.05


def rows(kind: str, users: torch.Tensor) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths, with their users."""
    if kind == "classifier":
        batch = padded_batch([5, 9, 2, 7, 3, 8, 4, 6, 1, 9], "right", vocab=VOCAB)
    else:
        batch = {k: torch.cat([v, v[:2], v[1:], v[:1]]) for k, v in instruction_batch("right").items()}  # 10 rows
    return {**batch, UNIT_KEY: users}


def test_units_are_numbered_by_first_appearance_with_each_rows_place() -> None:
    units = units_of({UNIT_KEY: USERS})
    assert units is not None and units.count == 3 and units.most_rows == 7
    assert units.unit.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert units.slot.tolist() == [0, 0, 1, 0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("kind", ["classifier", "language_model"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["tied", "untied", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_each_users_clipped_sum_is_a_loop_of_one_backward_per_user(
    kind: str, family: str, policy: str, checkpointing: bool
) -> None:
    """Users of 1, 2 and 7 rows: the Gram terms between a user's rows and the tied cross term included.

    With activation checkpointing, the calls normed in the backward pass as they complete are normed per user too.
    """
    model, batch = tiny_task(kind, family, policy, gradient_checkpointing=checkpointing), rows(kind, USERS)
    loss = model.per_example_loss
    users = per_unit_gradients(model, loss, {k: v for k, v in batch.items() if k != UNIT_KEY}, USERS)
    expected = clipped_sum(users, CLIP)
    stats, grads = run(build_engine("ghost", model, max_grad_norm=CLIP), model, loss, batch)
    rtol = 1e-10 if kind == "classifier" else 1e-9  # the LM's cross-entropy runs on float32 logits
    assert stats.norms.shape == (3,) and stats.losses.shape == (3,)
    assert_close(stats.norms, gradient_norms(users), rtol=rtol)
    assert bool((stats.norms > CLIP).all())
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert_close(grad, expected[name], rtol=rtol)


@pytest.mark.parametrize("policy", ["tied", "untied"])
def test_the_per_example_engine_clips_users_alike(policy: str) -> None:
    """The reference engine: each user's rows' vmapped gradients added, then clipped."""
    model, batch = tiny_task("classifier", "gpt2", policy), rows("classifier", USERS)
    ghost_stats, ghost = run(build_engine("ghost", model, max_grad_norm=CLIP), model, model.per_example_loss, batch)
    stats, grads = run(build_engine("per_example", model, max_grad_norm=CLIP), model, model.per_example_loss, batch)
    assert_close(stats.norms, ghost_stats.norms)
    for name, grad in grads.items():
        assert_close(grad, ghost[name])


@pytest.mark.parametrize("policy", ["tied", "untied"])
def test_users_of_one_row_each_are_example_level_dp(policy: str) -> None:
    model = tiny_task("classifier", "llama", policy)
    batch = rows("classifier", torch.arange(10) * 3)
    examples = per_example_gradients(model, model.per_example_loss, {k: v for k, v in batch.items() if k != UNIT_KEY})
    engine = build_engine("ghost", model, max_grad_norm=CLIP)
    _, per_user = run(engine, model, model.per_example_loss, batch)
    plain_stats, per_row = run(engine, model, model.per_example_loss, {k: v for k, v in batch.items() if k != UNIT_KEY})
    assert_close(plain_stats.norms, gradient_norms(examples))
    for name, grad in per_user.items():
        torch.testing.assert_close(grad, per_row[name], rtol=0, atol=1e-14)


@pytest.mark.parametrize("scale", [1e3, 1.0])
def test_each_users_contribution_is_at_most_c(scale: float) -> None:
    """Adversarial rows (embeddings scaled up): every user's clipped update, run alone, has norm ≤ C (1 + 1e-6)."""
    model = tiny_task("classifier", "gpt2", "tied")
    with torch.no_grad():
        model.backbone.get_input_embeddings().weight.mul_(scale)
    batch = rows("classifier", USERS)
    engine = build_engine("ghost", model, max_grad_norm=CLIP)
    for label in USERS.unique():
        alone = {key: value[USERS == label] for key, value in batch.items()}
        _, grads = run(engine, model, model.per_example_loss, alone)
        norm = torch.sqrt(sum(grad.pow(2).sum() for grad in grads.values()))
        assert float(norm) <= CLIP * (1 + 1e-6)
