"""Small per-example modules such as RMSNorm: exact per-example gradients of their own parameters by ``vmap``.

One rule serves every normalisation layer whose parameters are small (d-sized scales and shifts) and whose
output for an example depends on that example's input only: ``nn.RMSNorm``, and the RMSNorm classes of the
Llama, Qwen2/Qwen3, Mistral, Phi-3, Granite, SmolLM3 and Gemma families (Gemma's ``x̂ ⊙ (1 + w)`` included).
The module's own ``forward`` is replayed on each example's captured input with ``torch.func.vjp``, so the
rule is exact for whatever arithmetic that class does (float32 upcasts, ``1 + w``), with no per-class copy.
The per-example gradients are [B, *parameter.shape]: as small as the parameters themselves.
"""

from __future__ import annotations

import importlib

from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from dplit.privacy.norms.factors import ExampleGradient, GradientUse
from dplit.privacy.norms.registry import register_norm_rule

TRANSFORMERS_NORMS = {
    "llama": "LlamaRMSNorm",
    "qwen2": "Qwen2RMSNorm",
    "qwen3": "Qwen3RMSNorm",
    "mistral": "MistralRMSNorm",
    "phi3": "Phi3RMSNorm",
    "granite": "GraniteRMSNorm",
    "smollm3": "SmolLM3RMSNorm",
    "gemma": "GemmaRMSNorm",
    "gemma2": "Gemma2RMSNorm",
}
"""transformers family → its RMSNorm class (each a plain elementwise-affine module of one weight)."""


def elementwise_affine_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """Each own parameter's per-example gradient [B, *shape], by a per-example vector-Jacobian product."""
    params = {name: p.detach().to(activation.dtype) for name, p in module.named_parameters(recurse=False)}

    def example_gradient(inputs: Tensor, grad: Tensor) -> dict[str, Tensor]:
        def output(values: dict[str, Tensor]) -> Tensor:
            return functional_call(module, values, (inputs.unsqueeze(0),))  # [1, ...] one example

        _, pullback = vjp(output, params)
        return pullback(grad.unsqueeze(0).to(activation.dtype))[0]

    grads = vmap(example_gradient)(activation, output_grad)  # name -> [B, *shape]
    return {name: ExampleGradient(grad) for name, grad in grads.items()}


def _norm_types() -> list[type[nn.Module]]:
    """``nn.RMSNorm`` and the RMSNorm class of every family in :data:`TRANSFORMERS_NORMS` this transformers has."""
    types: list[type[nn.Module]] = [nn.RMSNorm]
    for family, class_name in TRANSFORMERS_NORMS.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        if isinstance(getattr(module, class_name, None), type):
            types.append(getattr(module, class_name))
    return types


for _norm_type in _norm_types():
    register_norm_rule(_norm_type, ("weight", "bias"))(elementwise_affine_gradients)
