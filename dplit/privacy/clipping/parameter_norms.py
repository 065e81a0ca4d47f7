"""Parameters used more than once in a forward: exact norms through cross terms, and detection of hidden uses.

A parameter shared by several covered modules (GPT-2's ``lm_head.weight is transformer.wte.weight``) or a
module called several times gives each example the gradient G = Σ_k G_k over its uses, so

    ‖G‖² = Σ_k ‖G_k‖² + 2 Σ_{k<l} ⟨G_k, G_l⟩,

with every cross term computed from the factors (design §3), never from a per-example V×d matrix. A use
outside the module that owns the parameter (``F.linear(h, wte.weight)``) would be invisible to the
per-layer rules, so :class:`ParameterUseMonitor` watches every torch call of a forward and reports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dplit.privacy.clipping.norms.factors import (
    DenseFactor,
    ExampleGradient,
    FactoredGradient,
    GradientUse,
    arithmetic_terms,
    batch_size,
    concatenate,
    example_slice,
    example_subset,
    inner_product,
    live_positions,
    materialised_norm,
    squared_norm,
    sum_dtype,
    summed_positions,
    triangle_bound,
)
from dplit.privacy.clipping.rounding import materialised_rigorous_norm, rigorous_norm, unit_roundoff

TiedNorm = Literal["exact", "bound"]


def _kind(use: GradientUse) -> tuple[Any, ...]:
    """Uses of the same kind can be joined into one: factored ones along positions, materialised ones summed."""
    if not isinstance(use, FactoredGradient):
        return ("example",)
    return tuple((type(f), f.width) for f in (use.left, use.right))


def _join(group: list[GradientUse]) -> GradientUse:
    """One use equal to the sum of ``group``'s (all of one kind)."""
    if len(group) == 1:
        return group[0]
    if isinstance(group[0], FactoredGradient):
        return concatenate(group)
    return ExampleGradient(torch.stack([use.values for use in group]).sum(0))  # [K, B, *shape] -> [B, *shape]


def _joined(uses: Sequence[GradientUse]) -> list[GradientUse]:
    """The uses with all uses of the same kind joined into one."""
    groups: dict[tuple[Any, ...], list[GradientUse]] = {}
    for use in uses:
        groups.setdefault(_kind(use), []).append(use)
    return [_join(group) for group in groups.values()]


CHUNK_ELEMENTS = 2**25
"""Largest float64 copy (elements) of one use's factors made at a time while computing norms (256 MB)."""

CPU_CHUNK_ELEMENTS = 2**19
"""On a CPU, the largest float64 copy of a use's factors (4 MB) made at a time: still in the cache when its Grams read
it (at GPT-2's shapes, B = 16, T = 128, a quarter less CPU time than copying the whole batch first;
``python -m bench.norm_price --parts chunks``). The same float64 arithmetic per example, so the same bound."""


def parameter_squared_norm(
    uses: Sequence[GradientUse], *, tied_norm: TiedNorm = "exact", chunk_elements: int | None = None
) -> Tensor:
    """Per-example squared norm [B] (float64) of one parameter over all its uses, never below the true one.

    Computed in float64, a chunk of examples at a time, with the rigorous rounding slack of
    :mod:`dplit.privacy.clipping.rounding`, so the bound holds in floating point (crafted cancelling examples included).

    Args:
        uses: the parameter's uses (at least one), all for the same batch.
        tied_norm: ``"exact"`` includes every cross term ⟨G_k, G_l⟩; ``"bound"`` returns (Σ_k ‖G_k‖)², the
            triangle-inequality bound, which can only over-clip.
        chunk_elements: the largest float64 copy of the factors made at a time (default: :data:`CHUNK_ELEMENTS`,
            on a CPU at most :data:`CPU_CHUNK_ELEMENTS`); it changes how many examples share one copy, not the
            arithmetic of any example.
    """
    if tied_norm == "bound" and len(uses) > 1:
        parts = [parameter_squared_norm([use], chunk_elements=chunk_elements).sqrt() for use in uses]
        return torch.stack(parts).sum(0).square()
    limit = default_chunk_elements(uses[0]) if chunk_elements is None else chunk_elements
    squared, bound = _computed_squared_norms(uses, chunk_elements=limit)
    norm = rigorous_norm(
        squared,
        bound,
        terms=max(arithmetic_terms(use) for use in uses),
        positions=sum(summed_positions(use) for use in uses),
        sum_dtype=max((sum_dtype(use) for use in uses), key=unit_roundoff),
    )
    return norm.square()


def _computed_squared_norms(uses: Sequence[GradientUse], *, chunk_elements: int) -> tuple[Tensor, Tensor]:
    """The computed ‖Σ_k G_k‖² [B] and the triangle bound Σ_k Σ_t ‖u_t‖‖v_t‖ [B], in float64, a chunk at a time.

    Examples are grouped by how many of their positions are live (:func:`length_groups`): each group's Grams span
    its own longest live stretch, not the batch's T (a packed unit's T_u², not the row's T², when units differ in
    length), exactly, since the positions left out add nothing. The rounding slack is then taken by the caller
    for the untrimmed T, an upper bound of what each group summed. At most ``chunk_elements`` float64 elements of
    the factors are copied at a time.
    """
    size = batch_size(uses[0])
    width = max(_elements_per_example(use) for use in uses)
    step = max(1, chunk_elements // max(1, width))
    groups = length_groups(uses)
    if len(groups) == 1 and groups[0][1] == [_positions_of(use) for use in uses]:  # nothing to leave out
        squared, bound = [], []
        for start in range(0, size, step):
            chunk = [example_slice(use, start, start + step) for use in uses]  # float64
            squared.append(_exact_squared_norm(chunk))
            bound.append(_triangle_bounds(chunk))
        if len(squared) == 1:  # one chunk (the usual case): no copy
            return squared[0], bound[0]
        return torch.cat(squared), torch.cat(bound)
    device = _device_of(uses[0])
    squared_all = torch.zeros(size, dtype=torch.float64, device=device)
    bound_all = torch.zeros(size, dtype=torch.float64, device=device)
    for index, positions in groups:
        for start in range(0, index.numel(), step):
            part = index[start : start + step]
            chunk = [example_subset(use, part, kept) for use, kept in zip(uses, positions, strict=True)]
            squared_all[part] = _exact_squared_norm(chunk)
            bound_all[part] = _triangle_bounds(chunk)
    return squared_all, bound_all


def length_groups(uses: Sequence[GradientUse]) -> list[tuple[Tensor, list[int]]]:
    """Examples grouped by their live length (of the longest of ``uses``, to within a factor of two).

    Returns:
        (examples [b], each use's positions to keep for them), one pair per group, longest group first.
    """
    live = torch.stack([live_positions(use) for use in uses])  # [K, B]
    longest = live.amax(0)  # [B]
    classes = torch.ceil(torch.log2(longest.clamp(min=1).double())).long()  # [B]: lengths in (2^(k-1), 2^k]
    groups = []
    for value in torch.unique(classes, sorted=True).flip(0).tolist():
        index = (classes == value).nonzero().flatten()
        kept = [max(int(count), 1) for count in live[:, index].amax(1).tolist()]
        groups.append((index, kept))
    return groups


def _positions_of(use: GradientUse) -> int:
    """The positions of a factored use (1 for a materialised one, as :func:`live_positions` counts it)."""
    return use.positions if isinstance(use, FactoredGradient) else 1


def _device_of(use: GradientUse) -> torch.device:
    if isinstance(use, ExampleGradient):
        return use.values.device
    factor = use.left
    return factor.values.device if isinstance(factor, DenseFactor) else factor.indices.device


def _triangle_bounds(chunk: Sequence[GradientUse]) -> Tensor:
    """Σ_k of each use's triangle bound [b]."""
    bounds = [triangle_bound(use) for use in chunk]
    return bounds[0] if len(bounds) == 1 else torch.stack(bounds).sum(0)


def materialised_parameter_squared_norm(use: FactoredGradient) -> tuple[Tensor, Tensor]:
    """``parameter_squared_norm([use])`` of one use that prefers materialising, all examples at once.

    Also returns the per-example gradients Ĝ [B, r, c] it was computed from, formed in the factors' dtype by one
    ``bmm`` (no float64 copy of the factors): the clipped sum is then formed from exactly what was normed, and
    :func:`~dplit.privacy.clipping.rounding.materialised_rigorous_norm` bounds both ‖Ĝ‖ and the true ‖G‖.
    """
    computed, gradients = materialised_norm(use)  # [B] float64, [B, r, c] in the factors' dtype
    norm = materialised_rigorous_norm(
        computed,
        triangle_bound(use),
        entries=use.left.width * use.right.width,
        positions=use.positions,
        dtype=sum_dtype(use),
    )
    return norm.square(), gradients


def stacked_squared_norms(values: Tensor) -> Tensor:
    """``parameter_squared_norm([ExampleGradient(values[p])])`` for every p at once: [P, B] (float64).

    For parameters used once through a materialised gradient (biases, norm scales) of one shape, stacked
    ``values`` [P, B, *shape]: the same float64 arithmetic and rounding slack, element by element, in a
    handful of operations for all P instead of a dozen per parameter (on a GPU, one launch each, not P).
    """
    flat = values.flatten(2).double()  # [P, B, *shape] -> [P, B, D] float64
    squared = flat.pow(2).sum(2)  # [P, B]
    bound = flat.norm(dim=2)  # the triangle bound of a materialised use: its own norm
    use = ExampleGradient(values[0])
    norm = rigorous_norm(
        squared, bound, terms=arithmetic_terms(use), positions=summed_positions(use), sum_dtype=sum_dtype(use)
    )
    return norm.square()


def default_chunk_elements(use: GradientUse) -> int:
    """The default float64 chunk of ``use``'s device: cache-sized on a CPU, :data:`CHUNK_ELEMENTS` elsewhere."""
    if isinstance(use, ExampleGradient):
        device = use.values.device
    else:
        factor = use.left
        device = factor.values.device if isinstance(factor, DenseFactor) else factor.indices.device
    return min(CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS) if device.type == "cpu" else CHUNK_ELEMENTS


def _elements_per_example(use: GradientUse) -> int:
    """Elements of one example's factors (or materialised gradient)."""
    if isinstance(use, ExampleGradient):
        return use.values[0].numel()
    sizes = [f.values[0].numel() if isinstance(f, DenseFactor) else f.indices[0].numel() for f in (use.left, use.right)]
    return sum(sizes)


def _exact_squared_norm(uses: Sequence[GradientUse]) -> Tensor:
    """‖Σ_k G_k‖² [B] as computed from the uses (all of one chunk): per-use norms plus every cross term."""
    if len(uses) == 1:
        return squared_norm(uses[0])
    joined = _joined(uses)
    total = sum(squared_norm(use) for use in joined)
    for k, first in enumerate(joined):
        for second in joined[k + 1 :]:
            total = total + 2 * inner_product(first, second)
    return total


@dataclass(frozen=True)
class ParameterOwner:
    """A trainable parameter's name and the covered modules (by ``id``) allowed to use it."""

    name: str
    modules: frozenset[int]


_NO_GRADIENT_PATH = frozenset(
    {torch.Tensor.detach, torch.Tensor.requires_grad_, torch.Tensor.data.__get__, torch.Tensor.grad.__get__}
)
"""Calls on a parameter that return a tensor through which no gradient reaches the parameter."""


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors inside nested tuples, lists and dicts."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class ParameterUseMonitor(TorchFunctionMode):
    """Records every torch call that uses a watched parameter outside a covered module owning it.

    Covered modules announce themselves with :meth:`enter` / :meth:`exit` (forward pre/post hooks). A call
    is a *use* when it receives the parameter (or a view of it) and returns a tensor; ``detach`` and friends
    are not uses.

    Args:
        owners: by parameter ``id``, its name and the covered modules that own it.
        module_names: by module ``id``, the covered modules' names (for messages).
    """

    def __init__(self, owners: Mapping[int, ParameterOwner], module_names: Mapping[int, str]) -> None:
        super().__init__()
        self._owners = owners
        self._module_names = module_names
        self._stack: list[int] = []
        self.violations: list[str] = []

    def enter(self, module: nn.Module, *args: Any) -> None:
        """Forward pre-hook: ``module`` starts running."""
        self._stack.append(id(module))

    def exit(self, module: nn.Module, *args: Any) -> None:
        """Forward hook: ``module`` finished."""
        self._stack.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``func`` and note any watched parameter it used outside its owners.

        Runs for every torch call of the forward (thousands), so the common case is one flat pass over the
        arguments with no allocation: only a call that received a watched parameter looks at its result.
        """
        result = func(*args, **kwargs) if kwargs else func(*args)
        owners = self._owners
        found: list[ParameterOwner] | None = None
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, Tensor):
                owner = owners.get(id(value))
                if owner is None:
                    base = value._base
                    owner = None if base is None else owners.get(id(base))
                if owner is not None:
                    found = [owner] if found is None else [*found, owner]
            elif isinstance(value, (tuple, list, dict)):
                nested = [owner for tensor in _tensors(value) if (owner := self._owner_of(tensor)) is not None]
                if nested:
                    found = nested if found is None else [*found, *nested]
        if found is None or func in _NO_GRADIENT_PATH or not any(True for _ in _tensors(result)):
            return result
        current = self._stack[-1] if self._stack else None
        for owner in found:
            if current not in owner.modules:
                self._note(owner, func, current)
        return result

    def _owner_of(self, tensor: Tensor) -> ParameterOwner | None:
        """The watched parameter ``tensor`` is, or is a view of (a view cached before the forward)."""
        owner = self._owners.get(id(tensor))
        if owner is None and tensor._base is not None:
            owner = self._owners.get(id(tensor._base))
        return owner

    def _note(self, owner: ParameterOwner, func: Any, current: int | None) -> None:
        """Record one violation (once per parameter)."""
        if any(message.startswith(f"parameter {owner.name!r}") for message in self.violations):
            return
        where = f"inside {self._module_names[current]!r}" if current is not None else "outside its module"
        self.violations.append(
            f"parameter {owner.name!r} is used by {getattr(func, '__name__', func)} {where}: ghost clipping "
            "only sees uses through the covered modules that own it, so its per-example norm would be "
            "under-counted; call the owning module instead (e.g. lm_head(h), not F.linear(h, embedding.weight))"
        )
