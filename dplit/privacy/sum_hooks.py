"""The public hooks of a DP-SGD step: callables that see the flat clipped sum before the noise, or the noisy sum."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils.hooks import RemovableHandle

SumHook = Callable[[Any, Tensor], None]
"""``hook(dpsgd, flat_sum)``: may read ``flat_sum`` (every trainable parameter's entries, flat, in order); a hook
that writes to it changes what is released (only an audit's canaries, or its deliberately broken mechanisms, do)."""


class SumHooks:
    """An ordered set of :data:`SumHook` s, each removable through the handle :meth:`register` returns."""

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, SumHook] = OrderedDict()

    def register(self, hook: SumHook, *, prepend: bool = False) -> RemovableHandle:
        """Add ``hook`` last (or first, with ``prepend``); ``handle.remove()`` takes it out."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        if prepend:
            self._hooks.move_to_end(handle.id, last=False)
        return handle

    def __call__(self, dpsgd: Any, flat_sum: Tensor) -> None:
        """Call every hook in order with ``(dpsgd, flat_sum)``."""
        for hook in list(self._hooks.values()):
            hook(dpsgd, flat_sum)
