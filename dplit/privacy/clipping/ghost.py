"""Ghost clipping with book-keeping: exact per-example norms and the clipped sum from ONE backward pass.

During :meth:`GhostEngine.accumulate` every covered module (``nn.Linear``, HF ``Conv1D``, ``nn.Embedding``,
``nn.LayerNorm``) that owns a trainable parameter keeps its input and, through a tensor hook on its output,
the gradient of that output (:mod:`dplit.privacy.clipping.recorder`; under activation checkpointing the input comes
from the layer's replay in the backward pass, and the call is normed as soon as it is complete). The trainable parameters are switched to ``requires_grad=False`` for the pass,
so autograd computes activation gradients only. From each call's (input, output gradient) the layer rules
of :mod:`dplit.privacy.clipping.norms` give the per-example gradient in factorised form; :mod:`dplit.privacy.clipping.parameter_norms`
turns a parameter's uses (one, or several for tied weights and reused modules) into exact per-example
norms; and the clipped sum Σ_i c_i G_i is formed per use with one matmul or ``index_add_`` (Bu et al. 2023).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import dplit.privacy.clipping.norms.factors as factors_module
from dplit.privacy.clipping.engine import (
    Batch,
    ClippingEngine,
    ClipStats,
    PerExampleLoss,
    add_to_grad,
    trainable_parameters,
)
from dplit.privacy.clipping.norms import (
    NORM_RULES,
    ExampleGradient,
    FactoredGradient,
    GradientUse,
    NormRule,
    add_weighted_sum_,
    weighted_sum,
)
from dplit.privacy.clipping.norms.factors import batch_size, without_examples
from dplit.privacy.clipping.parameter_norms import (
    CHUNK_ELEMENTS,
    ParameterOwner,
    ParameterUseMonitor,
    TiedNorm,
    materialised_parameter_squared_norm,
    parameter_squared_norm,
    stacked_squared_norms,
)
from dplit.privacy.clipping.recorder import CallRecorder, ModuleCall, checkpointable
from dplit.privacy.clipping.rounding import clipping_arithmetic
from dplit.privacy.clipping.token_units import TokenUnits, relaid, token_units_of, unit_token_sums
from dplit.privacy.clipping.units import Units, grouped_use, unit_sums, units_of, without_units
from dplit.privacy.refusal import OWNER, SettingError

LAYER_ADVICE = (
    "freeze it, use a supported layer (Linear, Conv1D, Embedding, LayerNorm, RMSNorm), register a rule, or use the "
    "per_example engine"
)
ADAPTER_ADVICE = (
    "ghost clipping covers peft's LoRA on Linear and Conv1D layers: leave this layer out of model.peft's "
    "target_modules (model.train_embeddings trains the embedding itself), use peft.LoraConfig without use_dora, or "
    f"use {OWNER}.clipping=per_example"
)


@dataclass(frozen=True)
class Coverage:
    """Which covered module owns each trainable parameter.

    Attributes:
        parameters: trainable parameters by ``id``, with their names.
        owners: by parameter ``id``, the covered modules allowed to use it.
        modules: covered modules owning at least one trainable parameter, by ``id``, with name and rule.
        structure: what this coverage was computed from (see :func:`trainable_structure`); it holds the
            modules and parameters it names alive, so an equal structure later means the same objects.
        held: by (module ``id``, attribute), the ``id`` of the trainable parameter held there (see
            :meth:`parameter_key`).
        layers: the checkpointable layers (:func:`~dplit.privacy.clipping.recorder.checkpointable`), found once
            per coverage, not per micro-batch; whether one is checkpointed is read as it runs.
    """

    parameters: dict[int, tuple[str, nn.Parameter]]
    owners: dict[int, ParameterOwner]
    modules: dict[int, tuple[str, nn.Module, NormRule]]
    structure: tuple[tuple[str, int, str, int], ...] = ()
    held: dict[tuple[int, str], int] = field(default_factory=dict)
    layers: tuple[nn.Module, ...] = ()

    def parameter_key(self, module: nn.Module, attribute: str) -> int | None:
        """The ``id`` of the trainable parameter ``module`` holds as ``attribute`` (``None``: not a trainable one).

        From the structure the coverage was computed from, not from the module as it is now: FSDP2 swaps a sharded
        parameter for its gathered copy around forward and backward passes, and a use formed in the backward pass
        (under activation checkpointing) must still find its parameter.
        """
        return self.held.get((id(module), attribute))


def trainable_structure(module: nn.Module) -> tuple[tuple[str, int, str, int], ...]:
    """Every place a trainable parameter is held: (module name, module ``id``, attribute, parameter ``id``).

    Everything :meth:`GhostEngine.coverage` derives from the model's structure is a function of this (and of the
    module types, fixed per object), so an equal structure lets the coverage be reused. One walk over the modules
    and their own parameters; a parameter shared by several modules appears once per module (retying shows).
    """
    return tuple(
        (module_name, id(sub), attribute, id(param))
        for module_name, sub in module.named_modules()
        for attribute, param in sub._parameters.items()
        if param is not None and param.requires_grad
    )


class GhostEngine(ClippingEngine):
    """Per-example clipping without per-example gradients: one forward, one backward, exact norms.

    Every trainable parameter must belong to a module type with a rule in :mod:`dplit.privacy.clipping.norms` and
    be used only through the modules that own it (a weight shared by several covered modules, such as
    GPT-2's tied embedding and LM head, is exact through cross terms). Anything else is refused with a
    ``ValueError`` naming the parameter, by :meth:`validate` and by every :meth:`accumulate`.

    Assumes covered modules see batch-first inputs (dim 0 is the example; checked against the batch size).

    Args:
        module: the model whose trainable parameters are privatised.
        max_grad_norm: the clipping bound C.
        stability: automatic clipping's γ (each example scaled by C / (‖g_i‖ + γ)); ``None`` clips to C.
        tied_norm: for a parameter used more than once, ``"exact"`` (cross terms) or ``"bound"``
            (Σ of per-use norms: sound, over-clips).
        rules: norm rules by exact module type (default: :data:`dplit.privacy.clipping.norms.NORM_RULES`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        max_grad_norm: float,
        stability: float | None = None,
        tied_norm: TiedNorm = "exact",
        rules: Mapping[type[nn.Module], NormRule] | None = None,
    ) -> None:
        super().__init__(module, max_grad_norm=max_grad_norm, stability=stability)
        if tied_norm not in ("exact", "bound"):
            raise SettingError(f"tied_norm must be 'exact' or 'bound', got {tied_norm!r}")
        self._tied_norm: TiedNorm = tied_norm
        self._rules = dict(NORM_RULES if rules is None else rules)
        self._coverage: Coverage | None = None

    def check_parameters(self) -> None:
        """Refuse any trainable parameter whose module type has no rule for it (no forward needed)."""
        self.coverage()

    def coverage(self) -> Coverage:
        """Map trainable parameters to the covered modules owning them; refuse any parameter without a rule.

        Computed once and reused while :func:`trainable_structure` is unchanged (a parameter frozen or unfrozen,
        added, replaced or retied after setup recomputes it, so a new trainable parameter without a rule is still
        refused by name); what a module's own attributes decide (a replaced ``forward``, a rule's refusal) is
        checked again on every call.
        """
        structure = trainable_structure(self._module)
        cached = self._coverage
        if cached is not None and cached.structure == structure:
            for module_name, module, rule in cached.modules.values():
                if "forward" in vars(module) or rule.refusal(module) is not None:
                    names = cached.parameters
                    held = [names[id(p)][0] for p in module._parameters.values() if id(p) in names]
                    self._check_module_state(module_name, module, rule, held[0])
            return cached
        self._coverage = None  # a refusal below leaves no stale coverage behind
        self._coverage = self._compute_coverage(structure)
        return self._coverage

    def _compute_coverage(self, structure: tuple[tuple[str, int, str, int], ...]) -> Coverage:
        """The coverage of the model as it is now (one walk over its modules)."""
        parameters = {id(p): (name, p) for name, p in trainable_parameters(self._module).items()}
        owning: dict[int, set[int]] = {}
        modules: dict[int, tuple[str, nn.Module, NormRule]] = {}
        for module_name, module in self._module.named_modules():
            owned = [(name, p) for name, p in module.named_parameters(recurse=False) if id(p) in parameters]
            if not owned:
                continue
            rule = self._rule_for(module_name, module, [(parameters[id(p)][0], name) for name, p in owned])
            modules[id(module)] = (module_name, module, rule)
            for _, param in owned:
                owning.setdefault(id(param), set()).add(id(module))
        owners = {key: ParameterOwner(parameters[key][0], frozenset(ids)) for key, ids in owning.items()}
        held = {(module_id, attribute): key for _, module_id, attribute, key in structure if key in parameters}
        return Coverage(parameters, owners, modules, structure, held, checkpointable(self._module))

    def _rule_for(self, module_name: str, module: nn.Module, owned: list[tuple[str, str]]) -> NormRule:
        """The rule covering ``owned`` (full name, attribute name) parameters of ``module``, or refuse."""
        kind = type(module).__name__
        rule = self._rules.get(type(module))
        for full_name, attribute in owned:
            if rule is None or attribute not in rule.parameter_names:
                holder = self._layer_holding(module_name)
                advice = ADAPTER_ADVICE if "model.peft" in holder else LAYER_ADVICE
                raise SettingError(
                    f"trainable parameter {full_name!r} belongs to {module_name or 'the model'!r} of type {kind}"
                    f"{holder}, which has no ghost clipping rule for it; {advice}"
                )
        self._check_module_state(module_name, module, rule, owned[0][0])
        return rule

    @staticmethod
    def _check_module_state(module_name: str, module: nn.Module, rule: NormRule, parameter_name: str) -> None:
        """Refuse a covered module whose own attributes make its rule wrong (``parameter_name``: one it holds)."""
        kind = type(module).__name__
        if "forward" in vars(module):
            raise SettingError(
                f"trainable parameter {parameter_name!r} belongs to {module_name!r} ({kind}), whose forward was "
                "replaced on the instance: its norm rule describes the class's own forward, so the norms would be wrong"
            )
        reason = rule.refusal(module)
        if reason is not None:
            raise SettingError(f"trainable parameter {parameter_name!r} ({module_name!r}, {kind}): {reason}")

    def _layer_holding(self, module_name: str) -> str:
        """`` inside 'x' (pkg.Type)``: the nearest enclosing layer not from torch (e.g. a peft adapter layer)."""
        parts = module_name.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:depth])
            kind = type(self._module.get_submodule(name))
            if not kind.__module__.startswith("torch."):
                origin = ", an adapter of model.peft" if kind.__module__.startswith("peft.") else ""
                return f" inside {name!r} ({kind.__module__}.{kind.__qualname__}{origin})"
        return ""

    @property
    def tied_norm(self) -> TiedNorm:
        """How parameters used more than once are normed: ``"exact"`` or ``"bound"``."""
        return self._tied_norm

    def accumulate(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Add Σ_i c_i ∇ℓ_i to ``param.grad`` from one forward and one backward pass.

        With ``batch[UNIT_KEY]`` each privacy unit (user) is one example: its rows' gradients are added and
        clipped together, and the returned losses and norms are per unit. With ``batch[TOKEN_UNIT_KEY]`` (packed
        rows) each token's unit is one example: ``loss_fn`` returns per-token losses [B, T] and each unit's
        gradient is its tokens' (see :mod:`dplit.privacy.clipping.token_units`).
        """
        coverage = self.coverage()
        dtype = _norm_dtype(p for _, p in coverage.parameters.values())
        if _is_empty(batch):  # an empty (Poisson) micro-batch: nothing to run or clip
            for _, param in coverage.parameters.values():
                add_to_grad(param, torch.zeros_like(param))
                self._summed(param)
            empty = torch.zeros(0, dtype=dtype, device=next(iter(batch.values())).device)
            return ClipStats(losses=empty, norms=empty)
        units, tokens = _units(batch)
        losses, uses, recomputed = self._gradient_uses(
            loss_fn, without_units(batch), coverage, dtype, units=units, tokens=tokens
        )
        if tokens is not None:  # packed rows: the uses are already per unit
            losses = unit_token_sums(losses, tokens)
        if units is not None:  # a unit of several rows is one example: its rows' positions side by side
            losses = unit_sums(losses, units)
            uses = {key: [grouped_use(use, units) for use in parameter_uses] for key, parameter_uses in uses.items()}
        with clipping_arithmetic(losses.device.type):
            kept = dict(recomputed.kept)  # per-example gradients formed for a norm, reused for the sum
            normed = self._squared_norms(uses, kept, room=recomputed.room)
            per_parameter = [*recomputed.squared.values(), *normed.values()]  # each [B], float64, never below the truth
            if per_parameter:
                squared = torch.stack(per_parameter).sum(0)  # [P, B] -> [B]: one reduction, not P additions
            else:
                squared = losses.new_zeros(losses.shape[0], dtype=torch.float64)
            norms = squared.sqrt()
            keep = torch.isfinite(norms)  # a non-finite norm: the example contributes nothing (dp/dropped_examples)
            factors = torch.where(keep, self.factors(norms), 0.0).to(dtype)
            dropped = not bool(keep.all())
            for key, (_, param) in coverage.parameters.items():
                if key in kept:
                    _add_kept_clipped_sum(param, kept.pop(key), factors, keep if dropped else None)
                else:
                    parameter_uses = uses.get(key, [])
                    if dropped:
                        parameter_uses = [without_examples(use, keep) for use in parameter_uses]
                    _add_clipped_sum(param, parameter_uses, factors)
                self._summed(param)
        return ClipStats(losses=losses.detach(), norms=norms)

    def parameter_norms(self, loss_fn: PerExampleLoss, batch: Batch) -> dict[str, Tensor | None]:
        """Each trainable parameter's per-example gradient norm [B] by name (``None``: no covered layer used it).

        Leaves ``param.grad`` untouched; used to check the engine against autograd on the user's model. With
        ``batch[UNIT_KEY]`` the norms are per unit [U], as :meth:`accumulate` clips them.
        """
        coverage = self.coverage()
        dtype = _norm_dtype(p for _, p in coverage.parameters.values())
        units, tokens = _units(batch)
        losses, uses, recomputed = self._gradient_uses(
            loss_fn, without_units(batch), coverage, dtype, units=units, tokens=tokens
        )
        if units is not None:
            uses = {key: [grouped_use(use, units) for use in parameter_uses] for key, parameter_uses in uses.items()}
        with clipping_arithmetic(losses.device.type):
            squared = {**recomputed.squared, **self._squared_norms(uses)}
        return {name: squared[key].sqrt() if key in squared else None for key, (name, _) in coverage.parameters.items()}

    def _squared_norms(
        self, uses: dict[int, list[GradientUse]], kept: dict[int, Tensor] | None = None, room: int | None = None
    ) -> dict[int, Tensor]:
        """Each used parameter's per-example ‖G‖² [B] over all its uses, by parameter ``id``.

        Parameters used once through a materialised gradient of one shape (biases, norm scales: most of a
        transformer's parameters by count) are normed together, a stack at a time (:func:`stacked_squared_norms`).
        With ``kept``, a weight used once whose norm is taken of its materialised per-example gradients (cheaper
        than the Grams: T·r·c ≤ T²·(r + c)) leaves those gradients (in the factors' dtype) there, by ``id``, up to
        ``room`` elements in all: its clipped sum is then Σ_i c_i G_i over them, not a second product of
        the factors.
        """
        squared: dict[int, Tensor] = {}
        stacks: dict[tuple[Any, ...], list[list[int]]] = {}
        room = (KEPT_ELEMENTS if room is None else room) if kept is not None else 0
        for key, parameter_uses in uses.items():
            use = parameter_uses[0]
            values = use.values if isinstance(use, ExampleGradient) else None
            if len(parameter_uses) == 1 and values is not None and values.numel() <= CHUNK_ELEMENTS:
                batches = stacks.setdefault((values.shape, values.dtype, values.device), [[]])
                if (len(batches[-1]) + 1) * values.numel() > CHUNK_ELEMENTS:  # each float64 stack within the chunk
                    batches.append([])
                batches[-1].append(key)
            elif kept is not None and len(parameter_uses) == 1 and _keepable(use, room):
                squared[key], kept[key] = materialised_parameter_squared_norm(use)
                room -= kept[key].numel()
            else:
                squared[key] = parameter_squared_norm(parameter_uses, tied_norm=self._tied_norm)
        for batches in stacks.values():
            for keys in batches:
                stacked = stacked_squared_norms(torch.stack([uses[key][0].values for key in keys]))  # [P, B]
                squared.update(zip(keys, stacked.unbind(0), strict=True))
        return {key: squared[key] for key in uses}  # in the order of the uses

    def _gradient_uses(
        self,
        loss_fn: PerExampleLoss,
        batch: Batch,
        coverage: Coverage,
        dtype: torch.dtype,
        *,
        units: Units | None,
        tokens: TokenUnits | None = None,
    ) -> tuple[Tensor, dict[int, list[GradientUse]], RecomputedNorms]:
        """One forward and one backward (no weight gradients); each parameter's per-example uses by ``id``.

        Uses of calls recomputed under activation checkpointing are normed as they complete, in the backward pass
        (:class:`RecomputedNorms`, over ``units`` when given); the rest are returned. With ``tokens`` every use is
        per token unit already.
        """
        recomputed = RecomputedNorms(coverage, dtype, units=units, tokens=tokens)
        recorder = CallRecorder(on_complete=recomputed.take)
        params = [p for _, p in coverage.parameters.values()]
        try:
            with torch.enable_grad(), _weight_gradients_off(params), set_checkpoint_early_stop(False):
                losses, calls = self._forward(loss_fn, batch, coverage, recorder, per_token=tokens is not None)
                _check_gradients_recorded(calls)
                recorder.forward_done()
                recomputed.calls_per_module = recorder.calls_per_module()
                if losses.requires_grad:
                    losses.sum().backward()
        finally:
            recorder.remove_hooks()
        recorder.check_paired()
        with clipping_arithmetic(losses.device.type):
            return losses, _collect_uses(calls, coverage, dtype, tokens), recomputed

    def _forward(
        self, loss_fn: PerExampleLoss, batch: Batch, coverage: Coverage, recorder: CallRecorder, *, per_token: bool
    ) -> tuple[Tensor, list[ModuleCall]]:
        """Run ``loss_fn`` with covered modules recorded and every parameter use watched; check what ran.

        The parameter-use monitor watches the forward only; ``recorder`` keeps its hooks (checkpointing's replay).
        """
        names = {key: name for key, (name, _, _) in coverage.modules.items()}
        monitor = ParameterUseMonitor(coverage.owners, names)
        with ExitStack() as hooks:
            for _, module, _ in coverage.modules.values():
                handles = (
                    module.register_forward_pre_hook(monitor.enter),
                    module.register_forward_hook(monitor.exit, always_call=True),
                )
                for handle in handles:
                    hooks.callback(handle.remove)
            recorder.attach(coverage.modules.values(), coverage.layers)  # first, so the gradient is of the own output
            with monitor:
                losses = loss_fn(batch)
        if monitor.violations:
            raise SettingError("; ".join(monitor.violations))
        _check_batch_dims(losses, recorder.calls, per_token=per_token)
        return losses, recorder.calls


class RecomputedNorms:
    """Norms of the calls recomputed under activation checkpointing, formed as each completes in the backward pass.

    A recomputed call's weight used once whose norm materialises its per-example gradients (:func:`_keepable`) is
    normed at once (the same arithmetic and rounding slack as after the backward) and keeps those
    gradients for the clipped sum, so the call's input and output gradient go at once: LoRA's factors, whose
    recomputed inputs then never pile up. Its other uses (biases, norm scales, weights normed by their Grams) are
    kept as uses, for after the backward pass; a factored one still holds the input and the output gradient.

    Attributes:
        squared: per-example ‖G‖² [B] of the parameters normed here, by ``id``.
        kept: their per-example gradients [B, r, c] (in the factors' dtype), by ``id``.
        room: the per-example gradient elements still allowed (of :data:`KEPT_ELEMENTS`).
        calls_per_module: how many times each covered module ran (set after the forward).
    """

    def __init__(
        self, coverage: Coverage, dtype: torch.dtype, *, units: Units | None, tokens: TokenUnits | None = None
    ) -> None:
        self._coverage, self._dtype, self._units, self._tokens = coverage, dtype, units, tokens
        self.squared: dict[int, Tensor] = {}
        self.kept: dict[int, Tensor] = {}
        self.room = KEPT_ELEMENTS
        self.calls_per_module: Counter[int] = Counter()

    def take(self, call: ModuleCall) -> None:
        """Norm what can be normed of a complete recomputed call; keep its other uses; let its tensors go."""
        assert call.activation is not None
        with clipping_arithmetic(call.activation.device.type):
            found = _call_uses(call, self._coverage, self._dtype, self._tokens)
            in_call = Counter(key for key, _ in found)  # a parameter held under two attributes: two uses
            for key, use in found:
                grouped = grouped_use(use, self._units) if self._units is not None and in_call[key] == 1 else use
                if in_call[key] == 1 and self._used_once(key) and _keepable(grouped, self.room):
                    self.squared[key], self.kept[key] = materialised_parameter_squared_norm(grouped)
                    self.room -= self.kept[key].numel()
                else:
                    call.uses.append((key, use))
        call.activation, call.output_grad, call.reduced = None, None, True

    def _used_once(self, key: int) -> bool:
        """Whether the parameter ``key`` has exactly one use in this pass (one call of its only owner)."""
        return sum(self.calls_per_module[module] for module in self._coverage.owners[key].modules) == 1


def _is_empty(batch: Batch) -> bool:
    """Whether the batch holds no examples (every tensor has size 0 along dim 0)."""
    tensors = [value for value in batch.values() if isinstance(value, Tensor) and value.dim() > 0]
    return bool(tensors) and all(value.shape[0] == 0 for value in tensors)


def _units(batch: Batch) -> tuple[Units | None, TokenUnits | None]:
    """The batch's row units, or its token units (packed rows: the row units only keep rows together)."""
    tokens = token_units_of(batch)
    return (None, tokens) if tokens is not None else (units_of(batch), None)


def _check_batch_dims(losses: Tensor, calls: list[ModuleCall], *, per_token: bool = False) -> None:
    """Refuse per-batch (not per-example) losses and covered calls whose dim 0 is not the example."""
    if per_token and losses.dim() != 2:
        raise SettingError(f"packed rows: loss_fn must return per-token losses [B, T]; got {tuple(losses.shape)}")
    if not per_token and losses.dim() != 1:
        raise SettingError(f"loss_fn must return one loss per example, shape [B]; got shape {tuple(losses.shape)}")
    for call in calls:
        if not call.input_shape or call.input_shape[0] != losses.shape[0]:
            raise SettingError(
                f"{call.name!r} ({type(call.module).__name__}) received input of shape "
                f"{call.input_shape} for a batch of {losses.shape[0]} examples: ghost clipping needs "
                f"dim 0 to be the example (e.g. pass position_ids of shape [B, T], not [1, T])"
            )


def _check_gradients_recorded(calls: list[ModuleCall]) -> None:
    """Refuse covered calls made without autograd (e.g. reentrant gradient checkpointing): their gradient is unseen."""
    for call in calls:
        if not call.grad_enabled:
            raise SettingError(
                f"{call.name!r} ({type(call.module).__name__}) ran under torch.no_grad inside loss_fn (gradient "
                "checkpointing?): ghost clipping needs the gradient of every call of a trainable layer"
            )


def _collect_uses(
    calls: list[ModuleCall], coverage: Coverage, dtype: torch.dtype, tokens: TokenUnits | None = None
) -> dict[int, list[GradientUse]]:
    """Each trainable parameter's per-example (per token unit) gradient uses by parameter ``id``, from the calls."""
    uses: dict[int, list[GradientUse]] = {}
    for call in calls:
        for key, use in call.uses if call.reduced else _call_uses(call, coverage, dtype, tokens):
            uses.setdefault(key, []).append(use)
    return uses


def _call_uses(
    call: ModuleCall, coverage: Coverage, dtype: torch.dtype, tokens: TokenUnits | None = None
) -> list[tuple[int, GradientUse]]:
    """(parameter ``id``, per-example gradient use) of each trainable parameter one call used.

    None for a call without an output gradient: its output did not reach the loss. With ``tokens`` the call's input
    and output gradient are re-laid by unit first, so the uses are per unit.
    """
    activation, output_grad = call.activation, call.output_grad
    if activation is None or output_grad is None:
        return []
    if tokens is not None:
        activation, output_grad = relaid(activation, tokens), relaid(output_grad, tokens)
    if activation.is_floating_point() and activation.dtype != dtype:
        activation = activation.to(dtype)
    if output_grad.dtype != dtype:
        output_grad = output_grad.to(dtype)
    found = []
    for name, use in call.rule.gradients(call.module, activation, output_grad).items():
        key = coverage.parameter_key(call.module, name)
        if key is not None:
            found.append((key, use))
    return found


KEPT_ELEMENTS = 2**25
"""Most per-example gradient elements kept from the norms for the clipped sums of one micro-batch (128 MB in float32)."""


def _keepable(use: GradientUse, room: int) -> bool:
    """Whether ``use``'s norm materialises its per-example gradients, in one chunk, and they fit in ``room``."""
    if not isinstance(use, FactoredGradient) or not factors_module.prefers_materialising(use):
        return False
    size = batch_size(use)
    kept = size * use.left.width * use.right.width
    return kept <= room and size * use.positions * (use.left.width + use.right.width) <= CHUNK_ELEMENTS


def _add_kept_clipped_sum(param: nn.Parameter, gradients: Tensor, factors: Tensor, keep: Tensor | None) -> None:
    """Add Σ_i c_i G_i to ``param.grad`` from the per-example gradients G [B, r, c] the norm was taken of.

    ``keep`` [B] (when some example was dropped): its False examples are zeroed first (their G may be NaN or inf).
    """
    if keep is not None:
        gradients = torch.where(keep[:, None, None], gradients, 0.0)
    total = torch.einsum("b,brc->rc", factors.to(gradients.dtype), gradients)  # [r, c]
    add_to_grad(param, total.reshape(param.shape))


def _add_clipped_sum(param: nn.Parameter, uses: list[GradientUse], factors: Tensor) -> None:
    """Add Σ_i c_i G_i over all of a parameter's uses to its ``grad``, use by use (zeros when it was not used).

    Into an existing ``grad`` of the sums' dtype (DPSGD's GradientBuffer views, a second use, a later
    micro-batch) in place (``addmm_`` / ``index_add_``): no parameter-sized temporary and no extra pass over it.
    """
    for use in uses:
        grad = param.grad
        if grad is not None and grad.dtype == factors.dtype and grad.is_contiguous():
            add_weighted_sum_(grad, use, factors)
        else:
            add_to_grad(param, weighted_sum(use, factors).reshape(param.shape))  # no parameter-sized total
    if not uses and param.grad is None:
        add_to_grad(param, torch.zeros_like(param))


def _norm_dtype(parameters: Iterable[nn.Parameter]) -> torch.dtype:
    """float64 when any trainable parameter is float64, else float32 (also for bf16/fp16 weights)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in parameters) else torch.float32


@contextmanager
def _weight_gradients_off(parameters: list[nn.Parameter]) -> Iterator[None]:
    """Temporarily ``requires_grad=False`` so autograd skips weight gradients (the engine forms them)."""
    for param in parameters:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in parameters:
            param.requires_grad_(True)
