"""Small per-example modules such as RMSNorm: exact per-example gradients of their own parameters by ``vmap``.

One rule serves every normalisation layer whose parameters are small (d-sized scales and shifts) and whose
output for an example depends on that example's input only: ``nn.RMSNorm``, and the RMSNorm classes of the
Llama, Qwen2/Qwen3, Mistral, Phi-3, Granite, SmolLM3 and Gemma families (Gemma's ``x̂ ⊙ (1 + w)`` included).
The module's own ``forward`` is replayed on the captured input with a vector-Jacobian product, so the rule is
exact for whatever arithmetic that class does (float32 upcasts, ``1 + w``), with no per-class copy. The replay
is batched: the module runs ONCE on the whole input with each parameter expanded to one copy per example
([B, 1, ..., *shape], broadcasting against [B, T, ..., *shape] exactly as the shared parameter does), and one
``torch.autograd.grad`` gives every example's gradient. A class whose forward does not broadcast so (e.g.
``nn.RMSNorm``, whose ``F.rms_norm`` insists on the parameter's own shape), or whose batched result differs
from the per-example ``vmap`` replay on its first call, uses that ``vmap`` replay instead. The per-example
gradients are [B, *parameter.shape]: as small as the parameters themselves.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call, vjp, vmap

from dplit.privacy.clipping.norms.factors import ExampleGradient, GradientUse
from dplit.privacy.clipping.norms.registry import register_norm_rule

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


_BATCHED_REPLAY: dict[type[nn.Module], bool] = {}
"""By module class: whether the batched replay matched the per-example ``vmap`` replay on a call that could tell.

A class is only marked safe by a call with at least two examples whose inputs differ (with one example, or
identical ones, a replay that mixes examples agrees with ``vmap`` by accident); until then every call is checked.
A class marked unsafe always uses the ``vmap`` replay.
"""


def elementwise_affine_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """Each own parameter's per-example gradient [B, *shape], by a vector-Jacobian product of the module's forward."""
    kind = type(module)
    params = whole_parameters(module)  # once per call on every rank, whichever replay runs (a collective if sharded)
    if _BATCHED_REPLAY.get(kind, True):
        batched = _batched_gradients(module, params, activation, output_grad)
        if kind not in _BATCHED_REPLAY:  # not yet known safe: check the batched replay against vmap's
            reference = _vmap_gradients(module, params, activation, output_grad)
            if not _same(batched, reference):
                _BATCHED_REPLAY[kind] = False
                batched = reference
            elif _can_tell(activation):
                _BATCHED_REPLAY[kind] = True
        if batched is not None:
            return {name: ExampleGradient(grad) for name, grad in batched.items()}
    replayed = _vmap_gradients(module, params, activation, output_grad)
    return {name: ExampleGradient(grad) for name, grad in replayed.items()}


def whole_parameters(module: nn.Module) -> dict[str, Tensor]:
    """The module's own parameters, detached and whole: a parameter sharded by FSDP2 (a ``DTensor``) is gathered."""
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach()
        for name, param in module.named_parameters(recurse=False)
    }


def _can_tell(activation: Tensor) -> bool:
    """Whether a call on ``activation`` can reveal a replay that mixes examples: ≥ 2 examples, not all identical."""
    return activation.shape[0] >= 2 and not bool((activation == activation[:1]).all())


def _same(batched: dict[str, Tensor] | None, reference: dict[str, Tensor]) -> bool:
    """Whether the batched replay gave the vmap replay's gradients (up to summation order)."""
    if batched is None or batched.keys() != reference.keys():
        return False
    return all(
        batched[name].shape == grad.shape and bool((batched[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-12)
        for name, grad in reference.items()
    )


def _batched_gradients(
    module: nn.Module, params: dict[str, Tensor], activation: Tensor, output_grad: Tensor
) -> dict[str, Tensor] | None:
    """Per-example gradients from ONE replay with per-example copies of the parameters; ``None`` if it cannot run."""
    size = activation.shape[0]
    expanded: dict[str, Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in params.items():
        shapes[name] = tuple(param.shape)
        middle = activation.dim() - 1 - param.dim()  # the positions between the example and the parameter's dims
        if middle < 0 or tuple(activation.shape[activation.dim() - param.dim() :]) != tuple(param.shape):
            return None
        with torch.enable_grad():  # the engine calls rules under no_grad: the view must be in the graph
            base = param.detach().to(activation.dtype).requires_grad_()
            expanded[name] = base.reshape((1,) * (middle + 1) + tuple(param.shape)).expand(
                (size,) + (1,) * middle + tuple(param.shape)
            )  # [B, 1, ..., *shape]: one copy per example (a view; its gradient is per example)
    try:
        with torch.enable_grad():
            output = functional_call(module, expanded, (activation,))
            if not isinstance(output, Tensor) or output.shape != output_grad.shape:
                return None
            grads = torch.autograd.grad(output, list(expanded.values()), output_grad.to(output.dtype))
    except RuntimeError:  # e.g. F.rms_norm / F.layer_norm require the parameter's own shape
        return None
    return {
        name: grad.reshape((size, *shapes[name])) for name, grad in zip(expanded, grads, strict=True)
    }  # [B, *shape]


def _vmap_gradients(
    module: nn.Module, whole: dict[str, Tensor], activation: Tensor, output_grad: Tensor
) -> dict[str, Tensor]:
    """Per-example gradients by replaying the forward on each example separately (``vmap`` of ``vjp``)."""
    params = {name: value.to(activation.dtype) for name, value in whole.items()}

    def example_gradient(inputs: Tensor, grad: Tensor) -> dict[str, Tensor]:
        def output(values: dict[str, Tensor]) -> Tensor:
            return functional_call(module, values, (inputs.unsqueeze(0),))  # [1, ...] one example

        _, pullback = vjp(output, params)
        return pullback(grad.unsqueeze(0).to(activation.dtype))[0]

    return vmap(example_gradient)(activation, output_grad)  # name -> [B, *shape]


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
