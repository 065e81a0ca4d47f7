"""nn.Linear: y = a Wᵀ + b with W [out, in], so example i's weight gradient is Σ_t g_t a_tᵀ."""

from __future__ import annotations

from torch import Tensor, nn

from dplit.privacy.clipping.norms.factors import DenseFactor, ExampleGradient, FactoredGradient, GradientUse
from dplit.privacy.clipping.norms.registry import as_positions, register_norm_rule


@register_norm_rule(nn.Linear, ("weight", "bias"))
def linear_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """Weight: left g [B, T, out], right a [B, T, in]; bias (when there is one): Σ_t g_t [B, out]."""
    inputs = as_positions(activation, module.in_features)  # [B, T, in]
    grads = as_positions(output_grad, module.out_features)  # [B, T, out]
    uses: dict[str, GradientUse] = {"weight": FactoredGradient(DenseFactor(grads), DenseFactor(inputs))}
    if module.bias is not None:  # Llama-family projections have none: no [B, T, out] reduction to throw away
        uses["bias"] = ExampleGradient(grads.sum(1))
    return uses
