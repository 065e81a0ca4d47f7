"""HF Conv1D: y = a W + b with W [in, out] (transposed nn.Linear), so example i's gradient is Σ_t a_t g_tᵀ."""

from __future__ import annotations

from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from dplit.privacy.clipping.norms.factors import DenseFactor, ExampleGradient, FactoredGradient, GradientUse
from dplit.privacy.clipping.norms.registry import as_positions, register_norm_rule


@register_norm_rule(Conv1D, ("weight", "bias"))
def conv1d_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """Weight: left a [B, T, in], right g [B, T, out]; bias: Σ_t g_t [B, out]."""
    inputs = as_positions(activation, module.nx)  # [B, T, in]
    grads = as_positions(output_grad, module.nf)  # [B, T, out]
    return {
        "weight": FactoredGradient(DenseFactor(inputs), DenseFactor(grads)),
        "bias": ExampleGradient(grads.sum(1)),
    }
