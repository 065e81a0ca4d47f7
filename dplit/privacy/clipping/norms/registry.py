"""Per-example gradient rules, registered by module type (the module's exact type, not subclasses)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from dplit.privacy.clipping.norms.factors import GradientUse

GradientRule = Callable[[nn.Module, Tensor, Tensor], dict[str, GradientUse]]
"""Maps (module, its input [B, ...], the gradient of its output [B, ...]) to each parameter's use, by name."""


@dataclass(frozen=True)
class NormRule:
    """How one module type's per-example parameter gradients factorise.

    Attributes:
        parameter_names: the parameters (attribute names) the rule covers.
        gradients: the :data:`GradientRule` computing their per-example uses from one call's input and
            output gradient (both already in the norm dtype when floating point).
        refusal: returns why a particular module of this type cannot be covered, or ``None``.
    """

    parameter_names: tuple[str, ...]
    gradients: GradientRule
    refusal: Callable[[nn.Module], str | None] = lambda module: None


NORM_RULES: dict[type[nn.Module], NormRule] = {}
"""The built-in rules (filled by the layer modules of this package on import)."""


def register_norm_rule(
    module_type: type[nn.Module],
    parameter_names: tuple[str, ...],
    refusal: Callable[[nn.Module], str | None] | None = None,
) -> Callable[[GradientRule], GradientRule]:
    """Decorator registering a :data:`GradientRule` for ``module_type`` in :data:`NORM_RULES`."""

    def register(gradients: GradientRule) -> GradientRule:
        NORM_RULES[module_type] = NormRule(parameter_names, gradients, refusal or (lambda module: None))
        return gradients

    return register


def as_positions(tensor: Tensor, width: int | None = None) -> Tensor:
    """View a batch-first tensor as [B, T, width] (``width=None``: indices [B, T]); a 2-D input is T = 1."""
    if width is None:
        return tensor.reshape(tensor.shape[0], -1)  # [B, *] -> [B, T]
    return tensor.reshape(tensor.shape[0], -1, width)  # [B, *, width] -> [B, T, width]
