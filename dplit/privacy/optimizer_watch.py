"""Every optimizer step on weights that keep a privacy history is seen, whoever runs it and whatever optimizer.

One global post-step hook (torch's ``register_optimizer_step_post_hook``) tells each watched module's history that
an optimizer stepped on its parameters; the history counts a step that no DP step announced as non-private. So a
step of the trainer's own optimizer, of a callback's, or of a plain loop outside any fit, is on the record.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

_WATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_HANDLE: list[RemovableHandle] = []


def watch_optimizer_steps(module: nn.Module) -> None:
    """Count every optimizer step on ``module``'s parameters in its privacy history (idempotent)."""
    _WATCHED.add(module)
    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_post_hook(_stepped))


def _stepped(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for module in list(_WATCHED):
        if any(id(param) in stepped for param in module.parameters()):
            module.privacy_history.optimizer_stepped()  # type: ignore[attr-defined]
