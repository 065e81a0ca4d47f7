"""PreferenceModel: a preference pair is one privacy unit, clipped exactly (float64 brute force, one backward per pair).

Also its reference policy: adapters off (bit-identical to the base, never moved) or a frozen copy outside the
module's parameters (no optimizer, no clipping engine, no checkpoint sees it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.data.preference import PreferenceCollator, PreferencePair
from dplit.privacy.clipping.engine import trainable_parameters
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.self_check import check_ghost_norms
from dplit.privacy.clipping.units import UNIT_KEY, placeholder_example, without_units
from dplit.tasks.preference import PreferenceModel
from dplit.tasks.reference import adapter_parameter_names
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_unit_gradients
from tests.helpers.families import LORA_TARGETS, TASK_CONFIGS, VOCAB
from tests.helpers.oracles import assert_close, run

CASES = [("gpt2", "tied"), ("gpt2", "untied"), ("llama", "tied"), ("llama", "untied"), ("gpt2", "lora"),
         ("llama", "lora")]  # fmt: skip


def tiny_preference_model(family: str, policy: str, **settings: Any) -> PreferenceModel:
    """A tiny float64 PreferenceModel in training mode, seed 0 (``lora``: rank-4 LoRA on a tied base)."""
    torch.manual_seed(0)
    adapters = {"peft": LoraConfig(r=4, target_modules=LORA_TARGETS[family], init_lora_weights=False)}
    return PreferenceModel(
        config=TASK_CONFIGS[family], vocab_size=VOCAB,
        embeddings=UntiedEmbeddings() if policy == "untied" else TiedEmbeddings(),
        **(adapters if policy == "lora" else {}), **settings,
    ).double().train()  # fmt: skip


def pair_batch(seed: int = 0, pairs: int = 4) -> dict[str, torch.Tensor]:
    """``pairs`` pairs of different lengths (prompts of 0 to 6 tokens), as the data module's collate lays them out."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for index in range(pairs):
        prompt = torch.randint(0, VOCAB, (index * 2,), generator=generator).tolist()
        answers = [torch.randint(0, VOCAB, (3 + (index + side) % 4,), generator=generator).tolist() for side in (0, 1)]
        rows = [(prompt + answer, [0] * len(prompt) + [1] * len(answer)) for answer in answers]
        items.append(PreferencePair(chosen_ids=rows[0][0], chosen_mask=rows[0][1],
                                    rejected_ids=rows[1][0], rejected_mask=rows[1][1]))  # fmt: skip
    return PreferenceCollator(pad_token_id=0)(items)


def _nudge(model: PreferenceModel) -> None:
    """Move the trained weights off the reference (at the start the policy IS the reference: every margin 0)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trainable_parameters(model).values():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)


@pytest.mark.parametrize(("family", "policy"), CASES)
@pytest.mark.parametrize("clip", [1e6, 1e-3])
def test_ghost_clips_each_pair_exactly_as_the_per_pair_brute_force(family: str, policy: str, clip: float) -> None:
    model = tiny_preference_model(family, policy, loss_type="sigmoid", beta=0.5)
    _nudge(model)
    batch = pair_batch()
    grads = per_unit_gradients(model, model.per_example_loss, without_units(batch), batch[UNIT_KEY])  # per pair
    assert len(grads) == 4 and all(any(g.abs().sum() > 0 for g in grad.values()) for grad in grads)
    stats, ghost = run(GhostEngine(model, max_grad_norm=clip), model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(grads), rtol=1e-9)
    expected = clipped_sum(grads, clip)
    for name, grad in ghost.items():
        assert_close(grad, expected[name], rtol=1e-9)
    if clip < 1:  # every pair's norm is far above C: each contributes exactly C
        assert bool((stats.norms > clip).all())
        total = torch.cat([g.flatten() for g in ghost.values()]).norm()
        assert float(total) <= 4 * clip * (1 + 1e-9)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_a_pair_is_one_unit_under_every_loss_and_the_self_check_passes(loss_type: str) -> None:
    model = tiny_preference_model("gpt2", "tied", loss_type=loss_type, label_smoothing=0.0)
    _nudge(model)
    batch = pair_batch(seed=3)
    grads = per_unit_gradients(model, model.per_example_loss, without_units(batch), batch[UNIT_KEY])
    stats, _ = run(GhostEngine(model, max_grad_norm=1e6), model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(grads), rtol=1e-9)
    check_ghost_norms(GhostEngine(model, max_grad_norm=1.0), model, model.per_example_loss, batch, examples=2)


def test_the_unit_is_the_pair_not_the_row() -> None:
    """Clipping the rows one by one would give different norms: the test above could fail."""
    model = tiny_preference_model("gpt2", "untied")
    _nudge(model)
    batch = pair_batch()
    rows = {**without_units(batch), UNIT_KEY: torch.arange(8)}
    by_row, _ = run(GhostEngine(model, max_grad_norm=1e6), model, model.per_example_loss, rows)
    by_pair, _ = run(GhostEngine(model, max_grad_norm=1e6), model, model.per_example_loss, batch)
    assert by_row.norms.shape == (8,) and by_pair.norms.shape == (4,)
    assert not torch.allclose(by_row.norms.view(4, 2).pow(2).sum(1).sqrt(), by_pair.norms)


def test_a_batch_out_of_pair_order_is_refused() -> None:
    model = tiny_preference_model("gpt2", "tied")
    batch = pair_batch()
    swapped = {key: value[[1, 0, 2, 3, 4, 5, 6, 7]] for key, value in batch.items()}
    with pytest.raises(ValueError, match="chosen then rejected"):
        model.per_example_loss(swapped)


def test_lora_reference_is_the_base_bit_for_bit_and_never_moves() -> None:
    torch.manual_seed(0)
    base = PreferenceModel(config=TASK_CONFIGS["llama"], vocab_size=VOCAB).double()
    model = tiny_preference_model("llama", "lora")
    base.backbone.load_state_dict(model.backbone.state_dict(), strict=False)  # same base weights, no adapters
    batch = without_units(pair_batch())
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with model.reference.active(model.backbone) as reference:
        adapters_off = reference(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(adapters_off, base.backbone(input_ids=ids, attention_mask=mask).logits)
    assert not torch.equal(model(ids, mask), adapters_off)  # the adapters are back on after the block
    names = adapter_parameter_names(model.backbone)
    assert names and {n.removeprefix("backbone.") for n in trainable_parameters(model)} <= names
    before = model.reference.digest(model.backbone)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        model.per_example_loss(batch).sum().backward()
        optimizer.step()
    assert model.reference.digest(model.backbone) == before


def test_lora_with_a_trained_embedding_is_refused() -> None:
    with pytest.raises(ValueError, match="model.train_embeddings=false"):
        tiny_preference_model("gpt2", "lora", train_embeddings=True)


def test_frozen_copy_is_outside_parameters_state_and_clipping() -> None:
    model = tiny_preference_model("gpt2", "untied")
    reference = model.reference.copy
    assert reference is not None and all(not p.requires_grad for p in reference.parameters())
    own = {id(p) for p in model.parameters()}
    assert not own & {id(p) for p in reference.parameters()}
    assert not any(key.startswith("reference") for key in model.state_dict())
    assert set(trainable_parameters(model)) == {n for n, p in model.named_parameters() if p.requires_grad}
    engine = GhostEngine(model, max_grad_norm=1.0)
    covered = {id(p) for _, p in engine.coverage().parameters.values()}
    assert not covered & {id(p) for p in reference.parameters()}
    before = model.reference.digest(model.backbone)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    batch = without_units(pair_batch())
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model.per_example_loss(batch).sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert model.reference.digest(model.backbone) == before
    assert losses[-1] < losses[0]  # the policy moved away from the reference, towards the chosen answers


@pytest.mark.parametrize(("family", "policy"), [("gpt2", "tied"), ("llama", "lora")])
def test_user_level_clips_all_of_a_users_pairs_as_one_unit(family: str, policy: str) -> None:
    model = tiny_preference_model(family, policy)
    _nudge(model)
    batch = pair_batch(pairs=4)
    batch[UNIT_KEY] = torch.tensor([7, 7, 7, 7, 3, 3, 9, 9])  # user 7 owns the first two pairs
    grads = per_unit_gradients(model, model.per_example_loss, without_units(batch), batch[UNIT_KEY])
    assert len(grads) == 3
    for clip in (1e6, 1e-3):
        stats, ghost = run(GhostEngine(model, max_grad_norm=clip), model, model.per_example_loss, batch)
        assert_close(stats.norms, gradient_norms(grads), rtol=1e-9)
        expected = clipped_sum(grads, clip)
        for name, grad in ghost.items():
            assert_close(grad, expected[name], rtol=1e-9)


@pytest.mark.parametrize(("family", "policy"), [("gpt2", "tied"), ("llama", "lora")])
def test_pairs_are_exact_under_activation_checkpointing(family: str, policy: str) -> None:
    model = tiny_preference_model(family, policy, gradient_checkpointing=True)
    _nudge(model)
    batch = pair_batch(seed=5)
    grads = per_unit_gradients(model, model.per_example_loss, without_units(batch), batch[UNIT_KEY])
    stats, ghost = run(GhostEngine(model, max_grad_norm=0.5), model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(grads), rtol=1e-9)
    expected = clipped_sum(grads, 0.5)
    for name, grad in ghost.items():
        assert_close(grad, expected[name], rtol=1e-9)


@pytest.mark.parametrize("policy", ["tied", "lora"])
def test_a_sharded_ranks_placeholder_runs_both_passes_and_adds_exactly_zero(policy: str) -> None:
    """A rank with fewer micro-batches runs one empty row (dplit's placeholder) through both passes, as DPSGD does."""
    model = tiny_preference_model("gpt2", policy)
    placeholder = placeholder_example(without_units(pair_batch()))
    calls: list[tuple[bool, int]] = []
    model.register_forward_hook(lambda _, args, __: calls.append((torch.is_grad_enabled(), args[0].shape[0])))
    stats, grads = run(GhostEngine(model, max_grad_norm=1.0), model, lambda rows: model.per_example_loss(rows) * 0.0,
                       placeholder)  # fmt: skip
    assert stats.losses.shape == (1,) and torch.isfinite(stats.losses).all() and torch.isfinite(stats.norms).all()
    assert all(not grad.any() for grad in grads.values())
    if policy == "lora":  # the reference (adapters off, no gradient) and the policy, both through the task, one row
        assert [call for call in calls if not call[0]] and all(rows == 1 for _, rows in calls)
    else:  # the frozen copy is a separate module; the policy runs through the task
        assert calls and all(grad and rows == 1 for grad, rows in calls)
