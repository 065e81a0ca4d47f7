"""PerExampleEngine: the reference engine, materialising every example's gradient with ``torch.func``."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dplit.privacy.clipping.engine import (
    Batch,
    ClippingEngine,
    ClipStats,
    PerExampleLoss,
    add_to_grad,
    trainable_parameters,
)
from dplit.privacy.clipping.rounding import clipping_arithmetic, kept_gradient_norm, unit_roundoff
from dplit.privacy.clipping.token_units import TOKEN_UNIT_KEY
from dplit.privacy.clipping.units import unit_sums, units_of, without_units
from dplit.privacy.refusal import OWNER, SettingError


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

    def check_parameters(self) -> None:
        """Refuse what ``vmap`` cannot trace: sdpa attention's mask handling, checkpointing, a quantised base."""
        if any(type(p).__name__ in ("Params4bit", "Int8Params") for p in self._module.parameters()):
            raise SettingError(
                f"{OWNER}.clipping=per_example cannot run model.quantization (torch.func.vmap cannot trace "
                f"bitsandbytes' quantised matmuls): use {OWNER}.clipping=ghost"
            )
        if any(getattr(sub, "is_activation_checkpointing", False) is True for sub in self._module.modules()):
            raise SettingError(
                f"{OWNER}.clipping=per_example cannot run model.gradient_checkpointing=true (torch.func.vmap "
                f"cannot trace torch.utils.checkpoint): use {OWNER}.clipping=ghost or gradient_checkpointing=false"
            )
        for sub in self._module.modules():
            if getattr(getattr(sub, "config", None), "_attn_implementation", None) == "sdpa":
                raise SettingError(
                    f"{OWNER}.clipping=per_example cannot run model.attn_implementation='sdpa' (torch.func.vmap "
                    f"fails on its attention mask): use model.attn_implementation=eager or {OWNER}.clipping=ghost"
                )

    def accumulate(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Add Σ_i c_i ∇ℓ_i to ``param.grad`` using materialised per-example gradients."""
        if TOKEN_UNIT_KEY in batch:
            raise SettingError(
                f"data.packing=true needs {OWNER}.clipping=ghost: the per_example engine clips whole rows, and a packed "
                "row holds several documents"
            )
        wrapper = _LossModule(self._module, loss_fn)
        params = {f"module.{name}": p.detach() for name, p in trainable_parameters(self._module).items()}

        def example_loss(params: dict[str, Tensor], example: Batch) -> tuple[Tensor, Tensor]:
            one = {key: value.unsqueeze(0) for key, value in example.items()}  # [1, ...] per field
            loss = functional_call(wrapper, params, (one,))[0]
            return loss, loss.detach()

        try:
            per_example_grads, losses = vmap(
                grad(example_loss, has_aux=True), in_dims=(None, 0), randomness="different"
            )(params, without_units(batch))
        except RuntimeError as error:
            if "vmap" not in str(error):
                raise
            raise RuntimeError(
                "the per_example engine traces the model with torch.func.vmap, which failed on a data-dependent "
                "branch (e.g. transformers' sdpa attention mask): use attn_implementation='eager' or clipping='ghost'"
            ) from error
        units = units_of(batch)
        if units is not None:  # a unit's gradient: the sum of its rows' [U, *shape]
            per_example_grads = {
                name: g.new_zeros((units.count, *g.shape[1:])).index_add_(0, units.unit, g)
                for name, g in per_example_grads.items()
            }
            losses = unit_sums(losses, units)
        with clipping_arithmetic(losses.device.type):  # IEEE float32 sums, whatever the matmul precision setting
            squared = [g.double().flatten(1).pow(2).sum(1) for g in per_example_grads.values()]  # each [B], float64
            norms = kept_gradient_norm(  # ≥ ‖c g‖ / c as the sum below forms it
                torch.stack(squared).sum(0).sqrt(),
                entries=sum(g[0].numel() for g in per_example_grads.values()),
                dtype=max((g.dtype for g in per_example_grads.values()), key=unit_roundoff),
            )
            keep = torch.isfinite(norms)  # a non-finite gradient: the example contributes nothing
            factors = torch.where(keep, self.factors(norms), 0.0)
            for name, param in trainable_parameters(self._module).items():
                g = per_example_grads[f"module.{name}"]  # [B, *param.shape]
                g = torch.where(keep.reshape((-1,) + (1,) * (g.dim() - 1)), g, 0.0)
                add_to_grad(param, torch.einsum("b,b...->...", factors.to(g.dtype), g))
                self._summed(param)
        return ClipStats(losses=losses.detach(), norms=norms.detach())
