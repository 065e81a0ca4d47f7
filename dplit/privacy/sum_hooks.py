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
        self.running = False
        """True while the hooks run (a hook may then do what only a hook may, e.g. :meth:`DPSGD.count_units`)."""

    def register(self, hook: SumHook, *, prepend: bool = False) -> RemovableHandle:
        """Add ``hook`` last (or first, with ``prepend``); ``handle.remove()`` takes it out."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        if prepend:
            self._hooks.move_to_end(handle.id, last=False)
        return handle

    def __call__(self, dpsgd: Any, flat_sum: Tensor) -> None:
        """Call every hook in order with ``(dpsgd, flat_sum)``, :attr:`running` meanwhile."""
        self.running = True
        try:
            for hook in list(self._hooks.values()):
                hook(dpsgd, flat_sum)
        finally:
            self.running = False
