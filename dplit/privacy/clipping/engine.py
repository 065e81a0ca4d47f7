"""The clipping engine interface: each engine adds Σ_i c_i ∇ℓ_i to ``param.grad`` with ‖c_i ∇ℓ_i‖ ≤ C."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dplit.numbers import is_finite_number

Batch = Mapping[str, Tensor]
PerExampleLoss = Callable[[Batch], Tensor]
"""Maps a batch of B examples to the B per-example losses; example i's loss depends on example i only."""
SummedHook = Callable[[nn.Parameter], None]
"""``hook(param)``: called once a micro-batch's clipped sum is complete in ``param.grad`` (it may move it elsewhere)."""


@dataclass(frozen=True)
class ClipStats:
    """What one micro-batch produced: per-example losses and per-example gradient norms (before clipping)."""

    losses: Tensor
    norms: Tensor


def clip_factors(norms: Tensor, max_grad_norm: float, *, stability: float | None = None) -> Tensor:
    """Per-example factors c_i with ‖c_i g_i‖ ≤ C: min(1, C / ‖g_i‖), or C / (‖g_i‖ + γ) (automatic, γ = ``stability``)."""
    if stability is not None:  # automatic clipping (AUTO-S): every example normalised, ‖c_i g_i‖ < C
        return max_grad_norm / (norms + stability)
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


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
        stability: automatic clipping's γ: every example scaled by C / (‖g_i‖ + γ) instead of clipped
            (``None``: clipped to C).
    """

    def __init__(self, module: nn.Module, *, max_grad_norm: float, stability: float | None = None) -> None:
        if not is_finite_number(max_grad_norm, above=0):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")
        if stability is not None and not is_finite_number(stability, above=0):
            raise ValueError(f"automatic clipping's stability must be a finite number > 0, got {stability}")
        self._module = module
        self._max_grad_norm = float(max_grad_norm)
        self.stability = stability
        self._summed_hooks: OrderedDict[int, SummedHook] = OrderedDict()

    def register_summed_hook(self, hook: SummedHook) -> RemovableHandle:
        """Call ``hook(param)`` as soon as :meth:`accumulate` has added a micro-batch's sum to ``param.grad``.

        Parameters are handed over one at a time, in the same order on every rank, so a hook may move the sum
        elsewhere (e.g. reduce-scatter it into a shard and set ``param.grad = None``): no more than one
        parameter's whole gradient need exist at once.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._summed_hooks)
        self._summed_hooks[handle.id] = hook
        return handle

    def _summed(self, param: nn.Parameter) -> None:
        """Hand ``param``'s completed sum to the registered hooks (every engine calls it once per parameter)."""
        for hook in self._summed_hooks.values():
            hook(param)

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C."""
        return self._max_grad_norm

    def set_max_grad_norm(self, bound: float) -> None:
        """Clip the next micro-batches to ``bound`` (quantile-adaptive clipping moves C between steps)."""
        if not is_finite_number(bound, above=0):
            raise ValueError(f"the clipping bound must be a finite number > 0, got {bound}")
        self._max_grad_norm = float(bound)

    def factors(self, norms: Tensor) -> Tensor:
        """Each example's clip factor for its norm (see :func:`clip_factors`)."""
        return clip_factors(norms, self._max_grad_norm, stability=self.stability)

    def check_parameters(self) -> None:  # noqa: B027 (optional: an engine that clips anything checks nothing)
        """Refuse (``ValueError`` naming it) a trainable parameter no rule covers, before any data is seen."""

    @abstractmethod
    def accumulate(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Add Σ_i c_i ∇ℓ_i over the batch's examples to each trainable parameter's ``grad``."""
