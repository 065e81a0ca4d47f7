"""The reference policy of preference tuning: a forward pass only, never trained, never clipped.

Two forms, chosen by the backbone:

* with peft adapters, the same backbone with every adapter switched off for the pass (what peft's
  ``PeftModel.disable_adapter()`` does; dplit injects adapters without a ``PeftModel``): no second copy. Every
  trainable parameter must then be an adapter's, or the base itself would move.
* without adapters, a frozen deep copy of the backbone taken before training, held outside the module's
  submodules: not in its ``state_dict`` (checkpoints, the weights' digest), not in ``parameters()`` (the
  optimizer, the clipping engines), every parameter ``requires_grad=False``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel

from dplit.privacy.weights_content import Gather, content_digest


def adapter_layers(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's peft adapter layers (``BaseTunerLayer``); none when peft is absent or unused."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    return [module for module in backbone.modules() if isinstance(module, BaseTunerLayer)]


def adapter_parameter_names(backbone: nn.Module) -> set[str]:
    """The names (in ``backbone``) of the parameters inside its adapter layers' adapter weights (``lora_A``, ...)."""
    layers = {id(module) for module in adapter_layers(backbone)}
    names: set[str] = set()
    for path, module in backbone.named_modules():
        if id(module) not in layers:
            continue
        for attribute in module.adapter_layer_names:  # type: ignore[attr-defined]
            holder = getattr(module, attribute, None)
            if isinstance(holder, nn.Module):
                names |= {f"{path}.{attribute}.{name}" for name, _ in holder.named_parameters()}
            elif isinstance(holder, nn.ParameterDict):  # pragma: no cover - a ParameterDict is an nn.Module
                names |= {f"{path}.{attribute}.{name}" for name in holder}
    return names


@contextmanager
def adapters_disabled(backbone: nn.Module) -> Iterator[None]:
    """Run ``backbone`` without its adapters inside the block (each layer's former state restored after)."""
    layers = adapter_layers(backbone)
    before = [layer._disable_adapters for layer in layers]  # type: ignore[attr-defined]
    try:
        for layer in layers:
            layer._disable_adapters = True  # type: ignore[attr-defined]
        yield
    finally:
        for layer, state in zip(layers, before, strict=True):
            layer._disable_adapters = state  # type: ignore[attr-defined]


class ReferencePolicy:
    """The frozen reference of a backbone: its adapters switched off, or a frozen copy (see the module's notes).

    Args:
        backbone: the trained causal LM, adapters already injected when there are any.

    Raises:
        ValueError: with adapters, when a trainable parameter is not an adapter's (naming it): the base would move.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        self.uses_adapters = bool(adapter_layers(backbone))
        self._copy: PreTrainedModel | None = None
        if self.uses_adapters:
            adapters = adapter_parameter_names(backbone)
            moving = [name for name, p in backbone.named_parameters() if p.requires_grad and name not in adapters]
            if moving:
                raise ValueError(
                    f"model.peft: DPO's reference is the base with the adapters off, but {moving[0]!r} is trained "
                    "too and would move it: set model.train_embeddings=false (and train no base weight beside peft)"
                )
            return
        frozen = copy.deepcopy(backbone)
        for param in frozen.parameters():
            param.requires_grad_(False)
        self._copy = frozen.eval()

    @property
    def copy(self) -> PreTrainedModel | None:
        """The frozen copy (``None`` with adapters: the backbone itself, adapters off, is the reference)."""
        return self._copy

    @contextmanager
    def active(self, backbone: PreTrainedModel) -> Iterator[PreTrainedModel]:
        """The model to run as the reference, under ``torch.no_grad`` (the copy follows ``backbone``'s device/dtype)."""
        with torch.no_grad():
            if self._copy is None:
                with adapters_disabled(backbone):
                    yield backbone
                return
            self._follow(backbone)
            yield self._copy

    def _follow(self, backbone: PreTrainedModel) -> None:
        """Move the copy to the backbone's device and floating dtype (Lightning moves only the module's submodules)."""
        model_param = next(backbone.parameters())
        copy_param = next(self._copy.parameters())  # type: ignore[union-attr]
        if (copy_param.device, copy_param.dtype) != (model_param.device, model_param.dtype):
            self._copy.to(device=model_param.device, dtype=model_param.dtype)  # type: ignore[union-attr]

    def digest(self, backbone: PreTrainedModel, *, gather: Gather | None = None) -> str:
        """The content digest of the reference's weights (with adapters: the backbone's non-adapter weights).

        Args:
            backbone: the trained causal LM.
            gather: the ranks' collective, when the weights are sharded (``DTensor`` s; every rank must call).
        """
        if self._copy is not None:
            return content_digest(dict(self._copy.state_dict()), gather=gather)
        return self.digest_of_state(backbone, dict(backbone.state_dict()), gather=gather)

    def digest_of_state(
        self, backbone: PreTrainedModel, state: dict[str, object], *, gather: Gather | None = None
    ) -> str:
        """:meth:`digest` from a full state dict of ``backbone`` (e.g. a sharded run's gathered checkpoint)."""
        if self._copy is not None:
            return self.digest(backbone, gather=gather)
        adapters = adapter_parameter_names(backbone)
        return content_digest({name: value for name, value in state.items() if name not in adapters}, gather=gather)
