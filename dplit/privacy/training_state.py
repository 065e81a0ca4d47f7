"""State that a training forward would change from private data without noise: refused before and during training.

DP-SGD privatises the gradient step and nothing else. A module that writes its own parameters or buffers in
the forward (``nn.Embedding(max_norm=...)`` renormalises looked-up rows in place, batch norm updates running
statistics that checkpoints save) or that mixes examples through batch statistics releases private data with
no noise, outside every gradient check. :func:`refuse_state_writing_modules` names such modules at setup;
:class:`StateWriteGuard` catches any other in-place write (by the tensors' version counters) around each step.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm


def state_writing_reason(module: nn.Module) -> str | None:
    """Why ``module``'s training forward writes state from, or mixes, examples; ``None`` when it does not."""
    if isinstance(module, _BatchNorm):
        return "batch normalisation mixes the examples of a batch in train mode and updates running statistics"
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        return "track_running_stats=True updates running statistics from the training data"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
        return "max_norm renormalises the looked-up rows of the weight in place in every forward"
    return None


def refuse_state_writing_modules(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the first module whose training forward writes state or mixes examples."""
    for name, module in model.named_modules():
        reason = state_writing_reason(module)
        if reason is not None:
            raise ValueError(
                f"module {name or 'the model'!r} ({type(module).__name__}) cannot be trained with DP-SGD: {reason}, "
                "so private data would change the model with no noise; replace it (e.g. LayerNorm, max_norm=None)"
            )


class StateWriteGuard:
    """Detects in-place writes to a model's parameters and buffers between :meth:`arm` and :meth:`check`.

    Uses the tensors' version counters, which every in-place operation (``no_grad`` ones included) advances.

    Args:
        model: the model being trained.
    """

    def __init__(self, model: nn.Module) -> None:
        self._tensors = [*model.named_parameters(), *model.named_buffers()]
        self._versions: list[int] = []

    def arm(self) -> None:
        """Record every tensor's version."""
        self._versions = [tensor._version for _, tensor in self._tensors]

    def check(self) -> None:
        """Raise ``ValueError`` naming the first tensor written in place since :meth:`arm`."""
        for (name, tensor), version in zip(self._tensors, self._versions, strict=True):
            if tensor._version != version:
                raise ValueError(
                    f"{name!r} was written in place during a training forward: private data would change it with "
                    "no noise, so DP-SGD refuses this model (remove the in-place update, or freeze and drop the state)"
                )
