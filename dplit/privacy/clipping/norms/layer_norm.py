"""nn.LayerNorm: y = x̂ ⊙ γ + β, whose d-sized per-example gradients are cheap to materialise."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from dplit.privacy.clipping.norms.factors import ExampleGradient, GradientUse
from dplit.privacy.clipping.norms.registry import as_positions, register_norm_rule


@register_norm_rule(nn.LayerNorm, ("weight", "bias"))
def layer_norm_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """γ: Σ_t g_t ⊙ x̂_t; β: Σ_t g_t (x̂ recomputed from the captured input), each [B, *normalized_shape]."""
    shape = tuple(module.normalized_shape)
    width = math.prod(shape)
    normalised = F.layer_norm(activation, shape, eps=module.eps)  # x̂, same shape as the input
    grads = as_positions(output_grad, width)  # [B, T, D]
    size = activation.shape[0]
    return {
        "weight": ExampleGradient((grads * as_positions(normalised, width)).sum(1).reshape(size, *shape)),
        "bias": ExampleGradient(grads.sum(1).reshape(size, *shape)),  # [B, D] -> [B, *normalized_shape]
    }
