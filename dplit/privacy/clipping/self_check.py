"""Checking the ghost engine on the user's own model: its per-parameter norms against autograd, example by example.

Ghost clipping trusts that every covered layer sees batch-first inputs, runs its class's own ``forward`` and is
the only way its parameters reach the loss. Architectures dplit has never seen can break these assumptions
without any error, so before the first DP step :func:`check_ghost_norms` recomputes the per-example gradient of a
few real examples with one plain autograd backward each and refuses, naming the parameter, when the ghost norms
disagree (or when a trainable parameter gets no gradient through any covered layer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dplit.privacy.clipping.engine import Batch, PerExampleLoss, trainable_parameters
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.token_units import TOKEN_UNIT_KEY
from dplit.privacy.clipping.units import units_of, without_units


class FirstBatchCheck:
    """:func:`check_ghost_norms` once, on the first batch with examples (ghost engines only; off: never).

    Args:
        engine: the run's clipping engine (any other engine than :class:`GhostEngine` is not checked).
        module: the model.
        enabled: ``settings.self_check``.
        examples: how many examples of that batch are compared.
    """

    def __init__(self, engine: Any, module: nn.Module, *, enabled: bool, examples: int) -> None:
        self._engine, self._module, self._examples = engine, module, examples
        self._pending = enabled and isinstance(engine, GhostEngine)

    def __call__(self, loss_fn: PerExampleLoss, batch: Batch) -> bool:
        """Run the check if it is due and ``batch`` has examples; whether it ran (and passed) now."""
        if not self._pending or next(iter(batch.values())).shape[0] == 0:
            return False
        check_ghost_norms(self._engine, self._module, loss_fn, batch, examples=self._examples)
        self._pending = False
        return True


def check_ghost_norms(
    engine: GhostEngine, module: nn.Module, loss_fn: PerExampleLoss, batch: Batch, *, examples: int = 4
) -> None:
    """Refuse (``ValueError`` naming the parameter) ghost per-example norms that disagree with autograd's.

    The module runs in the mode it is in (train mode during training, so a layer that behaves differently there,
    such as one using batch statistics, is checked as it trains) with every dropout disabled (so both passes see
    the same function), under whatever autocast the caller set (the trainer's precision), and ``param.grad`` is
    left as it was. Agreement is to 1e-3 of each example's whole gradient norm (5e-2 for 16-bit weights or
    autocast); with
    ``tied_norm="bound"`` a shared parameter's ghost norm may exceed autograd's, never fall below it.

    Args:
        engine: the ghost engine built for ``module``.
        module: the model being trained.
        loss_fn: the per-example loss the engine will clip.
        batch: real examples; the first ``examples`` are used (with ``batch[UNIT_KEY]``: the first ``examples``
            units, whole, each compared as one example).
        examples: how many examples to compare.
    """
    sample = _first_units(batch, examples)
    with DropoutDisabled():  # the module stays in its (train) mode: batch statistics and the like are seen
        reference = _autograd_norms(module, loss_fn, sample)  # first: it must see graphs a ghost pass would free
        ghost = engine.parameter_norms(loss_fn, sample)
    whole = torch.stack(list(reference.values())).pow(2).sum(0).sqrt()  # [k] each example's norm
    device = next(iter(sample.values())).device.type
    sixteen_bit = any(p.element_size() < 4 for p in trainable_parameters(module).values())
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device).itemsize < 4
    tolerance = 5e-2 if sixteen_bit or autocast else 1e-3
    for name, expected in reference.items():
        _compare(name, ghost[name], expected, whole, tolerance, bound=engine.tied_norm == "bound")


def _first_units(batch: Batch, count: int) -> Batch:
    """The rows of ``batch``'s first ``count`` examples: its first rows, or (with units) its first units' rows."""
    units = units_of(batch)
    if units is None:
        return {key: value[:count] for key, value in batch.items()}
    rows = (units.unit < count).nonzero().flatten()
    return {key: value[rows] for key, value in batch.items()}


def _autograd_norms(module: nn.Module, loss_fn: PerExampleLoss, batch: Batch) -> dict[str, Tensor]:
    """Each trainable parameter's per-example (per-unit) gradient norm [k] from one backward per example (unit)."""
    params = trainable_parameters(module)
    if TOKEN_UNIT_KEY in batch:
        return _autograd_token_unit_norms(params, loss_fn, batch)
    units = units_of(batch)
    size = next(iter(batch.values())).shape[0] if units is None else units.count
    plain = without_units(batch)
    norms: dict[str, list[Tensor]] = {name: [] for name in params}
    for i in range(size):
        rows = slice(i, i + 1) if units is None else (units.unit == i).nonzero().flatten()
        example = {key: value[rows] for key, value in plain.items()}  # [rows of the example, ...] per field
        with torch.enable_grad():
            loss = loss_fn(example).sum()
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
        for name, grad in zip(params, grads, strict=True):
            norms[name].append(torch.zeros(()) if grad is None else grad.detach().double().norm().cpu())
    return {name: torch.stack(values) for name, values in norms.items()}


def _autograd_token_unit_norms(
    params: dict[str, nn.Parameter], loss_fn: PerExampleLoss, batch: Batch
) -> dict[str, Tensor]:
    """Per token unit (packed rows): autograd of the unit's tokens' losses on the rows as packed, in engine order.

    A model that lets one document attend to another gives a unit gradients through other units' tokens, which
    the ghost engine's per-token restriction does not see: this check then fails, naming a parameter.
    """
    labels = batch[TOKEN_UNIT_KEY]
    order = list(dict.fromkeys(labels[labels >= 0].tolist()))  # the engine's unit order (first token, row-major)
    plain = without_units(batch)
    norms: dict[str, list[Tensor]] = {name: [] for name in params}
    with torch.enable_grad():
        token_losses = loss_fn(plain)  # [B, T]
        for label in order:
            loss = (token_losses * (labels == label)).sum()
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
            for name, grad in zip(params, grads, strict=True):
                norms[name].append(torch.zeros(()) if grad is None else grad.detach().double().norm().cpu())
    return {name: torch.stack(values) for name, values in norms.items()}


def _compare(name: str, ghost: Tensor | None, expected: Tensor, whole: Tensor, tolerance: float, bound: bool) -> None:
    """Raise unless the ghost norms of parameter ``name`` match autograd's.

    The message names the parameter and the size of the disagreement relative to the tolerance, never a norm:
    per-example norms are computed from private examples.
    """
    if ghost is None:
        raise ValueError(
            f"trainable parameter {name!r} is not used by any covered layer in the forward, so ghost clipping gives "
            "it no gradient; a tensor derived from it before the forward (e.g. a cached copy or cast) hides it: use "
            "the parameter inside its module, or freeze it"
        )
    ghost = ghost.detach().double().cpu()
    error = expected - ghost if bound else (ghost - expected).abs()
    relative = error / whole.clamp(min=1e-12)
    checked = torch.isfinite(whole)  # an example whose autograd gradient is not finite is dropped by the engines
    failed = checked & ~(relative <= tolerance)  # NaN fails
    if bool(failed.any()):
        worst = f"{float(relative[failed].max()):.1e}"  # "nan" when a ghost norm is not finite
        raise ValueError(
            f"ghost clipping self-check failed for trainable parameter {name!r}: its per-example gradient norms "
            f"disagree with autograd's by up to {worst} of the example's gradient norm (tolerance {tolerance:g}). "
            "Its layer is used in a way the norm rules do not describe (input not batch-first, a replaced forward, "
            "a use outside its module); the per-example bound would not hold. Use clipping='per_example' or fix "
            "the model"
        )


_DROPOUTS = frozenset(
    {
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        torch.dropout,
        torch.alpha_dropout,
        torch.feature_dropout,
        torch.feature_alpha_dropout,
    }
)


class DropoutDisabled(TorchFunctionMode):
    """Within this context every dropout is the identity and attention dropout is 0; nothing else changes."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Skip dropout calls; run ``scaled_dot_product_attention`` with ``dropout_p=0``; run the rest unchanged."""
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)
