"""nn.Embedding: e_t = W[x_t] with W [V, d], so example i's gradient is Σ_t onehot(x_t) b_tᵀ."""

from __future__ import annotations

from torch import Tensor, nn

from dplit.privacy.clipping.norms.factors import DenseFactor, FactoredGradient, GradientUse, IndexFactor
from dplit.privacy.clipping.norms.registry import as_positions, register_norm_rule


def embedding_refusal(module: nn.Module) -> str | None:
    """Why an embedding cannot be clipped per example (``scale_grad_by_freq`` mixes examples), or ``None``."""
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq=True scales gradients by token counts over the whole batch"
    return None


@register_norm_rule(nn.Embedding, ("weight",), refusal=embedding_refusal)
def embedding_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """Weight: left one-hot(x) as indices [B, T], right b [B, T, d] (zero where x is ``padding_idx``)."""
    indices = as_positions(activation)  # [B, T]
    grads = as_positions(output_grad, module.embedding_dim)  # [B, T, d]
    if module.padding_idx is not None:
        grads = grads * (indices != module.padding_idx).unsqueeze(-1).to(grads.dtype)  # [B, T, 1] mask
    return {"weight": FactoredGradient(IndexFactor(indices, module.num_embeddings), DenseFactor(grads))}
