"""What ghost clipping records of each covered module call: its input and its output gradient, checkpointing included.

In the forward pass every call of a covered module keeps its input and, through a tensor hook on its output, gets
the gradient of that output in the backward pass. Under activation checkpointing (a transformers
``GradientCheckpointingLayer`` with ``gradient_checkpointing`` on, in training, with autograd on) the layer's
forward runs a second time inside the backward pass, to recompute what it saved. A call inside such a layer does
not keep its first input (that would keep alive the very activations checkpointing drops): it takes its input from
the replay, matched to its own first call (same shape, dtype and sampled values), and counts
once. When a call holds both its input and its output gradient it is *complete*, and ``on_complete`` may reduce it
at once (the engine forms small per-example gradients and lets both tensors go), so the recomputed inputs do not
pile up either. A call whose gradient arrives without a recomputed input is refused by name after the backward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer

from dplit.privacy.clipping.norms import NormRule

REPLAY_TOLERANCE = 1e-5
"""Largest relative difference between a first and a recomputed input at the sampled places."""
FINGERPRINT_SAMPLES = 256
"""How many evenly spaced elements of an input its fingerprint holds (a replay must give the same there)."""


@dataclass(frozen=True, eq=False)
class Fingerprint:
    """What a replayed input must match: the first input's shape, dtype, sampled values, sum and norm (float64)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sample: Tensor

    @classmethod
    def of(cls, activation: Tensor) -> Fingerprint:
        """The fingerprint of ``activation`` (a copy, not a view).

        At most :data:`FINGERPRINT_SAMPLES` evenly spaced values, then the whole input's sum (NaN left out: a
        padding row may hold it) and Euclidean norm, each over √n (on the scale of one value).
        """
        flat = activation.detach().reshape(-1)  # [n]: a view of a contiguous input (a copy of any other)
        step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        values = flat if flat.is_floating_point() else flat.double()
        root = max(1.0, flat.numel()) ** 0.5
        whole = torch.stack([values.nansum(), torch.linalg.vector_norm(values)]).double() / root  # [2], no sync
        sample = torch.cat([flat[::step][:FINGERPRINT_SAMPLES].double(), whole])  # a new tensor: holds no input
        return cls(tuple(activation.shape), activation.dtype, sample)

    def matches(self, other: Fingerprint) -> bool:
        """Same shape and dtype, and the same values at the sampled places (NaN where NaN)."""
        return all_match([(self, other)])


def all_match(pairs: list[tuple[Fingerprint, Fingerprint]]) -> bool:
    """Whether each pair matches (same shape, dtype and sampled values), compared at once: one device sync."""
    if not pairs:
        return True
    if any((first.shape, first.dtype) != (second.shape, second.dtype) for first, second in pairs):
        return False
    first = torch.cat([a.sample for a, _ in pairs])  # [S]: every pair's samples, one after another
    second = torch.cat([b.sample for _, b in pairs])  # [S]
    scales = torch.stack([a.sample.nan_to_num(0.0, 0.0, 0.0).abs().amax() if a.sample.numel() else first.new_zeros(())
                          for a, _ in pairs])  # fmt: skip
    counts = torch.tensor([a.sample.numel() for a, _ in pairs], device=first.device)
    slack = REPLAY_TOLERANCE * (second.abs() + scales.repeat_interleave(counts))  # rtol·|b| + atol of its pair
    close = (first == second) | ((first - second).abs() <= slack)  # equal infinities too (inf − inf is NaN)
    both_nan = first.isnan() & second.isnan()
    return bool((close | both_nan).all())


@dataclass(eq=False)  # identity: calls hold tensors
class ModuleCall:
    """One call of a covered module: its input and, after the backward pass, its output gradient.

    Attributes:
        input_shape: the input's shape (also when the input itself is not kept).
        recomputed: the call ran inside a checkpointed layer: ``activation`` is the replay's, ``None`` until then.
        reduced: ``on_complete`` took what it needs; ``activation`` and ``output_grad`` were let go.
        uses: what ``on_complete`` left of a reduced call: (parameter ``id``, its per-example gradient use).
    """

    name: str
    module: nn.Module
    rule: NormRule
    activation: Tensor | None
    grad_enabled: bool
    input_shape: tuple[int, ...] = ()
    output_grad: Tensor | None = None
    recomputed: bool = False
    reduced: bool = False
    uses: list[tuple[int, Any]] = field(default_factory=list)
    fingerprint: Fingerprint | None = field(default=None, repr=False)


class CallRecorder:
    """Forward hooks on covered modules (and on checkpointed layers) for one forward and backward pass.

    Args:
        on_complete: called with each call recomputed under checkpointing once it holds its input and its
            output gradient (in the backward pass); it may set ``call.reduced`` and drop both tensors.
    """

    def __init__(self, on_complete: Callable[[ModuleCall], None] | None = None) -> None:
        self.calls: list[ModuleCall] = []
        self._on_complete = on_complete
        self._hooks = ExitStack()
        self._checkpointing: list[bool] = []  # per checkpointable layer running now: is its forward checkpointed
        self._pending: dict[int, list[ModuleCall]] = {}
        self._unchecked: list[tuple[ModuleCall, Fingerprint]] = []
        self._replaying = False

    def attach(self, modules: Iterable[tuple[str, nn.Module, NormRule]], layers: Iterable[nn.Module]) -> None:
        """Record ``modules`` (name, module, rule) and watch the checkpointable ``layers`` (see :func:`checkpointable`)."""
        for layer in layers:
            self._hooks.callback(layer.register_forward_pre_hook(self._enter_layer).remove)
            self._hooks.callback(layer.register_forward_hook(self._exit_layer, always_call=True).remove)
        for name, module, rule in modules:
            hook = partial(self._record, name, rule)
            handle = module.register_forward_hook(hook, with_kwargs=True, prepend=True)  # first: the module's output
            self._hooks.callback(handle.remove)

    def forward_done(self) -> None:
        """The forward pass is over: a covered module's forward from now on is checkpointing's replay."""
        self._replaying = True

    def remove_hooks(self) -> None:
        """Remove every hook this recorder placed."""
        self._hooks.close()

    def check_paired(self) -> None:
        """After the backward pass: refuse a replay unlike its first input, or a gradient without its replay.

        The replays of modules run once are compared here, all at once.
        """
        checks = [(call.fingerprint, replayed) for call, replayed in self._unchecked if call.fingerprint is not None]
        if not all_match(checks):
            wrong = next(call for call, replayed in self._unchecked if not all_match([(call.fingerprint, replayed)]))
            raise ValueError(_replay_differs(wrong))
        for call in self.calls:
            if call.recomputed and call.output_grad is not None and call.activation is None and not call.reduced:
                raise ValueError(
                    f"{call.name!r} ({type(call.module).__name__}) ran inside an activation-checkpointed layer whose "
                    "forward was not replayed in the backward pass, so its gradient cannot be paired with its input: "
                    "set model.gradient_checkpointing=false"
                )

    def calls_per_module(self) -> Counter[int]:
        """How many times each covered module (by ``id``) ran in the forward pass."""
        return Counter(id(call.module) for call in self.calls)

    def _enter_layer(self, layer: nn.Module, *args: Any) -> None:
        """Forward pre-hook of a checkpointable layer: note whether its forward is checkpointed this time."""
        checkpointed = bool(layer.gradient_checkpointing and layer.training and torch.is_grad_enabled())
        self._checkpointing.append(checkpointed)

    def _exit_layer(self, layer: nn.Module, *args: Any) -> None:
        """Forward hook of a checkpointable layer."""
        self._checkpointing.pop()

    def _record(
        self, name: str, rule: NormRule, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Tensor | None:
        """Forward hook: keep the input (or, inside a checkpointed layer, wait for its replay); hook the output."""
        activation = args[0] if args else next(iter(kwargs.values()))
        if self._replaying:
            self._take_replayed(module, activation)
            return _graph_start(output) if torch.is_grad_enabled() and isinstance(output, Tensor) else None
        call = ModuleCall(name, module, rule, activation.detach(), torch.is_grad_enabled(), tuple(activation.shape))
        if any(self._checkpointing) and call.grad_enabled:  # recomputed in the backward pass: do not keep it now
            call.recomputed, call.fingerprint, call.activation = True, Fingerprint.of(activation), None
            self._pending.setdefault(id(module), []).append(call)
        self.calls.append(call)
        if not call.grad_enabled:
            return None
        if not isinstance(output, Tensor):
            raise ValueError(f"{name!r} ({type(module).__name__}) returned {type(output).__name__}, not a Tensor")
        output = _graph_start(output)
        output.register_hook(partial(self._store_output_grad, call))
        return output

    def _take_replayed(self, module: nn.Module, activation: Tensor) -> None:
        """Give a waiting call of ``module`` its recomputed input: the one whose first input it matches.

        With one call waiting (a module run once) the check waits for :meth:`check_paired`, with the others (one
        comparison, no device sync per call); a module run more than once (a layer called twice, whose replays
        come in reverse order) is matched now. The replay of a call that kept its own input (under a checkpoint
        this recorder did not see) is ignored.
        """
        waiting = self._pending.get(id(module))
        if not waiting:
            return
        replayed = Fingerprint.of(activation)
        if len(waiting) == 1:
            call = waiting.pop()
            self._unchecked.append((call, replayed))
        else:
            call = next((c for c in waiting if c.fingerprint is not None and c.fingerprint.matches(replayed)), None)
            if call is None:
                raise ValueError(_replay_differs(waiting[0]))
            waiting.remove(call)
        call.activation = activation.detach()
        self._complete(call)

    def _store_output_grad(self, call: ModuleCall, grad: Tensor) -> None:
        """Tensor hook: the gradient of the loss sum with respect to a covered module's output."""
        call.output_grad = grad.detach()
        if call.recomputed:
            self._complete(call)

    def _complete(self, call: ModuleCall) -> None:
        """Hand a recomputed call that holds both tensors to ``on_complete``."""
        if call.activation is not None and call.output_grad is not None and self._on_complete is not None:
            self._on_complete(call)


def _graph_start(output: Tensor) -> Tensor:
    """``output``, or, when nothing upstream is trained (e.g. an embedding), a fresh node that starts the graph."""
    if output.requires_grad:
        return output
    return output.detach().requires_grad_().clone()  # a non-leaf, so later in-place ops stay legal


def _replay_differs(call: ModuleCall) -> str:
    """The one-line refusal of a replayed input that differs from the first (no value of it: it is private)."""
    return (
        f"{call.name!r} ({type(call.module).__name__}): the input recomputed by activation checkpointing differs from "
        "the first forward's, so ghost clipping cannot pair it; set model.gradient_checkpointing=false"
    )


def checkpointable(model: nn.Module) -> tuple[nn.Module, ...]:
    """The layers of ``model`` whose forward transformers can checkpoint (``GradientCheckpointingLayer``)."""
    return tuple(module for module in model.modules() if isinstance(module, GradientCheckpointingLayer))
