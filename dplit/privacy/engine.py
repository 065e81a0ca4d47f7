"""Per-example clipping engines: each adds Σ_i c_i ∇ℓ_i to ``param.grad`` with ‖c_i ∇ℓ_i‖ ≤ C."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

Batch = Mapping[str, Tensor]
PerExampleLoss = Callable[[Batch], Tensor]
"""Maps a batch of B examples to the B per-example losses; example i's loss depends on example i only."""


@dataclass(frozen=True)
class ClipStats:
    """What one micro-batch produced: per-example losses and per-example gradient norms (before clipping)."""

    losses: Tensor
    norms: Tensor


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """Per-example factors c_i = min(1, C / ‖g_i‖) so that ‖c_i g_i‖ ≤ C."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def at_least_float32(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 if it is a lower precision (bf16 norms and sums are kept in fp32), else unchanged."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name; a parameter shared by several modules appears once."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def add_to_grad(param: nn.Parameter, update: Tensor) -> None:
    """Accumulate ``update`` (a fresh tensor, which may become the grad) into ``param.grad``."""
    if param.grad is None:
        param.grad = update.to(param.dtype)
    else:
        param.grad.add_(update.to(param.grad.dtype))


class ClippingEngine(ABC):
    """Computes per-example clipped gradients of a module and sums them into ``param.grad``.

    Args:
        module: the model whose trainable parameters are privatised.
        max_grad_norm: the clipping bound C.
    """

    def __init__(self, module: nn.Module, *, max_grad_norm: float) -> None:
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self._module = module
        self._max_grad_norm = float(max_grad_norm)

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C."""
        return self._max_grad_norm

    def check_parameters(self) -> None:
        """Refuse (``ValueError`` naming it) a trainable parameter no rule covers, before any data is seen."""

    def validate(self, loss_fn: PerExampleLoss, batch: Batch) -> None:
        """Refuse (raise ``ValueError`` naming it) any trainable parameter this engine cannot clip exactly."""

    @abstractmethod
    def accumulate(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Add Σ_i c_i ∇ℓ_i over the batch's examples to each trainable parameter's ``grad``."""


class _LossModule(nn.Module):
    """Makes ``loss_fn`` (bound to ``module``) callable through ``torch.func.functional_call``."""

    def __init__(self, module: nn.Module, loss_fn: PerExampleLoss) -> None:
        super().__init__()
        self.module = module
        self._loss_fn = loss_fn

    def forward(self, batch: Batch) -> Tensor:
        return self._loss_fn(batch)


class PerExampleEngine(ClippingEngine):
    """Reference engine: materialises every example's full gradient with ``torch.func.vmap(grad(...))``.

    Exact for any model whose per-example loss is a function of that example alone. Memory grows as
    B × (number of parameters): it is the baseline the ghost engine is tested and benchmarked against.
    """

    def accumulate(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Add Σ_i c_i ∇ℓ_i to ``param.grad`` using materialised per-example gradients."""
        wrapper = _LossModule(self._module, loss_fn)
        params = {f"module.{name}": p.detach() for name, p in trainable_parameters(self._module).items()}

        def example_loss(params: dict[str, Tensor], example: Batch) -> tuple[Tensor, Tensor]:
            one = {key: value.unsqueeze(0) for key, value in example.items()}  # [1, ...] per field
            loss = functional_call(wrapper, params, (one,))[0]
            return loss, loss.detach()

        try:
            per_example_grads, losses = vmap(
                grad(example_loss, has_aux=True), in_dims=(None, 0), randomness="different"
            )(params, dict(batch))
        except RuntimeError as error:
            if "vmap" not in str(error):
                raise
            raise RuntimeError(
                "the per_example engine traces the model with torch.func.vmap, which failed on a data-dependent "
                "branch (e.g. transformers' sdpa attention mask): use attn_implementation='eager' or clipping='ghost'"
            ) from error
        squared = [at_least_float32(g).flatten(1).pow(2).sum(1) for g in per_example_grads.values()]  # each [B]
        norms = torch.stack(squared).sum(0).sqrt()
        factors = clip_factors(norms, self._max_grad_norm)
        for name, param in trainable_parameters(self._module).items():
            g = per_example_grads[f"module.{name}"]  # [B, *param.shape]
            add_to_grad(param, torch.einsum("b,b...->...", factors.to(g.dtype), g))
        return ClipStats(losses=losses.detach(), norms=norms.detach())


def build_engine(name: str, module: nn.Module, *, max_grad_norm: float, **options: object) -> ClippingEngine:
    """Construct the clipping engine called ``name`` (``"per_example"`` or ``"ghost"``)."""
    if name == "per_example":
        return PerExampleEngine(module, max_grad_norm=max_grad_norm)
    if name == "ghost":
        from dplit.privacy.ghost import GhostEngine

        return GhostEngine(module, max_grad_norm=max_grad_norm, **options)
    raise ValueError(f"unknown clipping engine {name!r}: choose 'per_example' or 'ghost'")
