"""The ghost engine checked against its oracles (brute force, per-example engine) on tiny models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import dplit.privacy.clipping.norms.factors as factors_module
from dplit.privacy.clipping import PerExampleEngine
from dplit.privacy.clipping.engine import Batch, ClippingEngine, ClipStats
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.norms import FactoredGradient
from dplit.privacy.clipping.norms.factors import prefers_materialising
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients

VOCAB = 50


TINY = {"n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 64}


RTOL = 1e-10


def padded_batch(lengths: list[int], side: str, seed: int = 0, vocab: int = VOCAB) -> dict[str, Tensor]:
    """Random token ids padded to the longest length on ``side``, with random binary labels."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    if side == "left":
        mask = mask.flip(1)
    labels = torch.randint(0, 2, (len(lengths),), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def record_materialise_choices(monkeypatch: pytest.MonkeyPatch) -> set[bool]:
    """The set that collects every Gram-or-materialise decision the ghost engine makes from now on."""
    choices: set[bool] = set()

    def spy(use: FactoredGradient) -> bool:
        choices.add(prefers_materialising(use))
        return prefers_materialising(use)

    monkeypatch.setattr(factors_module, "prefers_materialising", spy)
    return choices


def run(
    engine: ClippingEngine, module: nn.Module, loss_fn: Callable[[Batch], Tensor], batch: Batch
) -> tuple[ClipStats, dict[str, Tensor]]:
    """Per-example norms and the accumulated clipped sum (``param.grad`` starting from ``None``)."""
    for param in module.parameters():
        param.grad = None
    stats = engine.accumulate(loss_fn, batch)
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.requires_grad}
    return stats, grads


def assert_close(actual: Tensor, expected: Tensor, rtol: float = RTOL) -> None:
    """Relative agreement, scaled by the largest entry (entries near zero do not dominate)."""
    scale = expected.abs().max().clamp(min=1e-30)
    assert actual.shape == expected.shape
    assert ((actual - expected).abs().max() / scale).item() <= rtol, (actual, expected)


def check_against_oracles(module: nn.Module, loss_fn: Callable[[Batch], Tensor], batch: Batch, clip: float) -> None:
    """Ghost norms and clipped sums equal the brute force and PerExampleEngine's, to ~1e-10."""
    grads = per_example_gradients(module, loss_fn, batch)
    ghost_stats, ghost_grads = run(GhostEngine(module, max_grad_norm=clip), module, loss_fn, batch)
    reference_stats, reference_grads = run(PerExampleEngine(module, max_grad_norm=clip), module, loss_fn, batch)
    assert_close(ghost_stats.norms, gradient_norms(grads))
    assert_close(ghost_stats.norms, reference_stats.norms)
    assert_close(ghost_stats.losses, reference_stats.losses)
    expected = clipped_sum(grads, clip)
    for name, grad in ghost_grads.items():
        assert_close(grad, expected[name])
        assert_close(grad, reference_grads[name])
