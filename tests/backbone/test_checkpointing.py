"""model.gradient_checkpointing: recomputed blocks give the same per-example norms and clipped sums (float64, σ = 0)."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.tasks.base import CausalLMModule
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients
from tests.helpers.families import VOCAB, instruction_batch, tiny_task
from tests.helpers.oracles import assert_close, padded_batch, run

CLIP = 0.05
"""Small enough that every example is clipped."""


def task(kind: str, family: str, policy: str, *, checkpointing: bool, **settings: object) -> CausalLMModule:
    """The tiny task, with or without recomputed blocks (seed 0: the same weights either way)."""
    return tiny_task(kind, family, policy, gradient_checkpointing=checkpointing, **settings)


def batch_for(kind: str) -> dict[str, torch.Tensor]:
    """Right-padded examples of different lengths."""
    return padded_batch([5, 9, 2, 7], "right", vocab=VOCAB) if kind == "classifier" else instruction_batch("right")


@pytest.mark.parametrize("kind", ["classifier", "language_model"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["tied", "untied", "lora"])
def test_recomputed_blocks_give_the_same_norms_and_clipped_sum(kind: str, family: str, policy: str) -> None:
    """With checkpointing: equal to the same step without it and to one backward pass per example."""
    batch = batch_for(kind)
    checkpointed, plain = (task(kind, family, policy, checkpointing=on) for on in (True, False))
    assert any(getattr(m, "is_activation_checkpointing", False) for m in checkpointed.modules())
    stats, grads = run(
        GhostEngine(checkpointed, max_grad_norm=CLIP), checkpointed, checkpointed.per_example_loss, batch
    )
    plain_stats, plain_grads = run(GhostEngine(plain, max_grad_norm=CLIP), plain, plain.per_example_loss, batch)
    examples = per_example_gradients(checkpointed, checkpointed.per_example_loss, batch)
    assert_close(stats.norms, plain_stats.norms)
    assert_close(stats.norms, gradient_norms(examples))
    assert bool((stats.norms > CLIP).all())
    expected = clipped_sum(examples, CLIP)
    assert grads.keys() == plain_grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert_close(grad, plain_grads[name])
        assert_close(grad, expected[name])


def test_the_per_example_engine_refuses_checkpointing_in_one_line() -> None:
    model = task("classifier", "gpt2", "tied", checkpointing=True)
    with pytest.raises(ValueError, match="gradient_checkpointing=true") as refused:
        build_engine("per_example", model, max_grad_norm=1.0).check_parameters()
    assert "\n" not in str(refused.value)


def test_evaluation_does_not_recompute() -> None:
    """Blocks are recomputed only in training: evaluation gives the same logits as a model without checkpointing."""
    batch = batch_for("classifier")
    checkpointed, plain = (task("classifier", "llama", "tied", checkpointing=on).eval() for on in (True, False))
    with torch.no_grad():
        torch.testing.assert_close(checkpointed.per_example_loss(batch), plain.per_example_loss(batch))


@pytest.mark.parametrize(("family", "policy"), [("gpt2", "tied"), ("llama", "lora")])
def test_a_share_of_the_blocks_recomputed_is_exact(family: str, policy: str) -> None:
    """``checkpointed_share=0.5`` of 2 blocks: the first is recomputed, the second keeps its activations; exact."""
    batch = batch_for("classifier")
    model = task("classifier", family, policy, checkpointing=True, checkpointed_share=0.5)
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [block.gradient_checkpointing for block in blocks] == [True, False]
    stats, grads = run(GhostEngine(model, max_grad_norm=CLIP), model, model.per_example_loss, batch)
    examples = per_example_gradients(model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(examples))
    expected = clipped_sum(examples, CLIP)
    for name, grad in grads.items():
        assert_close(grad, expected[name])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gradient_checkpointing": True, "checkpointed_share": 0.0}, r"model.checkpointed_share=0.0: must be"),
        ({"gradient_checkpointing": True, "checkpointed_share": 1.5}, r"model.checkpointed_share=1.5: must be"),
        ({"checkpointed_share": 0.5}, r"model.checkpointed_share=0.5 needs model.gradient_checkpointing=true"),
        ({"checkpointed_share": True}, r"model.checkpointed_share=True: must be a finite number in \(0, 1\]"),
        ({"checkpointed_share": 0.0}, r"model.checkpointed_share=0.0: must be a finite number in \(0, 1\]"),
    ],
)
def test_a_share_out_of_range_or_without_checkpointing_is_refused_in_one_line(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        tiny_task("classifier", "llama", "tied", **settings)
    assert "\n" not in str(refused.value)
