"""The call recorder under activation checkpointing: no first-forward input kept, each replay paired once or refused."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from transformers.modeling_layers import GradientCheckpointingLayer

from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.recorder import CallRecorder, Fingerprint, ModuleCall
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients
from tests.helpers.families import VOCAB, tiny_task
from tests.helpers.oracles import assert_close, padded_batch, run

CLIP = 0.05


class Block(GradientCheckpointingLayer):
    """A checkpointable layer of one Linear; ``drift`` adds the number of calls so far, so a replay differs."""

    def __init__(self, *, drift: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, dtype=torch.float64)
        self.drift, self.calls = drift, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x + self.calls if self.drift else x))


class Stack(nn.Module):
    """``blocks`` checkpointed layers in a row (``repeat``: the first one runs twice)."""

    def __init__(self, *, replay: bool = True, drift: bool = False, repeat: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(drift=drift), Block()])
        self.repeat = repeat
        for block in self.blocks:
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = (
                partial(checkpoint, use_reentrant=False) if replay else lambda function, *args: function(*args)
            )

    def per_example_loss(self, batch: dict[str, Tensor]) -> Tensor:
        x = batch["x"]
        for block in [self.blocks[0], *self.blocks] if self.repeat else self.blocks:
            x = block(x)
        return x.pow(2).sum(-1)  # [B]


def batch() -> dict[str, Tensor]:
    return {"x": torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}


def test_a_checkpointed_layers_calls_keep_no_input_until_replayed_and_complete_once() -> None:
    model = tiny_task("classifier", "llama", "lora", gradient_checkpointing=True)
    completed: list[ModuleCall] = []
    recorder = CallRecorder(on_complete=completed.append)
    coverage = GhostEngine(model, max_grad_norm=CLIP).coverage()
    recorder.attach(coverage.modules.values(), coverage.layers)
    with set_checkpoint_early_stop(False):  # as the engine runs it: early stop would skip the blocks' last calls
        losses = model.per_example_loss(padded_batch([5, 9, 2, 7], "right", vocab=VOCAB))
    inside = [call for call in recorder.calls if call.recomputed]
    assert inside and all(call.activation is None for call in inside)  # nothing of the blocks is held
    assert all(call.activation is not None for call in recorder.calls if not call.recomputed)  # the embedding's
    recorder.forward_done()
    losses.sum().backward()
    recorder.remove_hooks()
    recorder.check_paired()
    assert [id(call) for call in completed] == list(dict.fromkeys(id(call) for call in completed))  # each once
    assert {id(call) for call in completed} == {id(call) for call in inside}
    assert all(tuple(call.activation.shape) == call.input_shape for call in completed)


def test_a_frozen_embedding_with_lora_under_checkpointing_is_exact() -> None:
    """Nothing upstream of the blocks trains: the graph starts inside a recomputed layer (the replay must match)."""
    model = tiny_task("classifier", "llama", "lora", gradient_checkpointing=True, train_embeddings=False)
    batch_ = padded_batch([5, 9, 2, 7], "right", vocab=VOCAB)
    stats, grads = run(GhostEngine(model, max_grad_norm=CLIP), model, model.per_example_loss, batch_)
    examples = per_example_gradients(model, model.per_example_loss, batch_)
    assert_close(stats.norms, gradient_norms(examples))
    expected = clipped_sum(examples, CLIP)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert_close(grad, expected[name])


@pytest.mark.parametrize("repeat", [False, True], ids=["once", "first-layer-twice"])
def test_a_small_checkpointed_stack_is_exact(repeat: bool) -> None:
    """A layer run twice in one forward is replayed twice, in reverse order: each replay finds its own call."""
    model = Stack(repeat=repeat)
    stats, grads = run(GhostEngine(model, max_grad_norm=CLIP), model, model.per_example_loss, batch())
    examples = per_example_gradients(model, model.per_example_loss, batch())
    assert_close(stats.norms, gradient_norms(examples))
    for name, grad in grads.items():
        assert_close(grad, clipped_sum(examples, CLIP)[name])


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        (partial(Stack, drift=True), "the input recomputed by activation checkpointing differs"),
        (partial(Stack, replay=False), "whose forward was not replayed in the backward pass"),
        (partial(Stack, drift=True, repeat=True), "the input recomputed by activation checkpointing differs"),
    ],
    ids=["replay-differs", "never-replayed", "layer-run-twice-replay-differs"],
)
def test_a_replay_that_cannot_be_paired_is_refused_in_one_line(stack: partial[Stack], message: str) -> None:
    """Never a gradient paired with another input, nor a gradient without its input: one line naming the setting.

    Refused before any clipped sum reaches a gradient (a module run once is checked after the backward pass; one
    run twice is matched, or refused, during it).
    """
    model = stack()
    engine = GhostEngine(model, max_grad_norm=CLIP)
    with pytest.raises(ValueError, match=message) as refused:
        engine.accumulate(model.per_example_loss, batch())
    assert "\n" not in str(refused.value) and "gradient_checkpointing=false" in str(refused.value)
    assert all(param.grad is None for param in model.parameters())


def test_equal_infinities_and_nans_match_and_a_sampled_or_summed_difference_does_not() -> None:
    """A replay reproducing inf or NaN is the same input; one value changed anywhere moves the sum (or a sample)."""
    first = torch.randn(2, 7, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    first[1, 2, 3] = float("nan")  # a padding row's NaN: left out of the sum
    assert Fingerprint.of(first).matches(Fingerprint.of(first.clone()))
    for place in [(0, 0, 0), (1, 6, 299)]:  # one sampled place, one between the samples
        changed = first.clone()
        changed[place] += 1.0
        assert not Fingerprint.of(first).matches(Fingerprint.of(changed))
    infinite = first.clone()
    infinite[0, 0, 0] = float("inf")
    assert Fingerprint.of(infinite).matches(Fingerprint.of(infinite.clone()))
