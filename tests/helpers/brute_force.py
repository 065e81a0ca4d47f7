"""The ground truth every clipping engine is tested against: one backward pass per example."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dplit.privacy.clipping.engine import Batch, PerExampleLoss


def per_example_gradients(module: nn.Module, loss_fn: PerExampleLoss, batch: Batch) -> list[dict[str, Tensor]]:
    """Each example's full gradient (tied parameters once, as the sum of their uses), by its own backward."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    size = next(iter(batch.values())).shape[0]
    grads = []
    for i in range(size):
        example = {key: value[i : i + 1] for key, value in batch.items()}  # [1, ...] per field
        loss = loss_fn(example)[0]
        grad = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads.append(dict(zip(params, grad, strict=True)))
    return [{n: (g if g is not None else torch.zeros_like(params[n])) for n, g in eg.items()} for eg in grads]


def gradient_norms(grads: list[dict[str, Tensor]]) -> Tensor:
    """‖g_i‖ over all parameters, per example."""
    return torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in eg.values())) for eg in grads])


def clipped_sum(grads: list[dict[str, Tensor]], max_grad_norm: float) -> dict[str, Tensor]:
    """Σ_i min(1, C/‖g_i‖) g_i, per parameter."""
    norms = gradient_norms(grads)
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {name: sum(f * eg[name] for f, eg in zip(factors, grads, strict=True)) for name in grads[0]}


def per_unit_gradients(
    module: nn.Module, loss_fn: PerExampleLoss, batch: Batch, units: Tensor
) -> list[dict[str, Tensor]]:
    """Each privacy unit's (user's) full gradient: one backward pass of the sum of its rows' losses, in unit order.

    Units are taken in order of first appearance in ``units`` [B] (as the engines number them).
    """
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    order = list(dict.fromkeys(units.tolist()))
    grads = []
    for label in order:
        rows = (units == label).nonzero().flatten()
        loss = loss_fn({key: value[rows] for key, value in batch.items()}).sum()
        grad = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads.append(
            {n: g if g is not None else torch.zeros_like(params[n]) for n, g in zip(params, grad, strict=True)}
        )
    return grads
