"""Layer rules and factorised-gradient algebra against per-example gradients from autograd, in float64."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.norms import (
    NORM_RULES,
    DenseFactor,
    ExampleGradient,
    FactoredGradient,
    GradientUse,
    IndexFactor,
    NormRule,
    factor_gram,
    inner_product,
    materialise,
    squared_norm,
    weighted_sum,
)
from dplit.privacy.clipping.norms.factors import prefers_materialising
from dplit.privacy.clipping.parameter_norms import (
    CHUNK_ELEMENTS,
    CPU_CHUNK_ELEMENTS,
    ParameterOwner,
    ParameterUseMonitor,
    default_chunk_elements,
    materialised_parameter_squared_norm,
    parameter_squared_norm,
    stacked_squared_norms,
)
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients

DOUBLE = torch.float64


def close(actual: Tensor, expected: Tensor) -> bool:
    """Agreement to 1e-10 relative to the largest entry."""
    return actual.shape == expected.shape and bool((actual - expected).abs().max() <= 1e-10 * expected.abs().max())


def layer_cases() -> list[tuple[str, nn.Module, Tensor]]:
    """(id, float64 module, batch-first input) for every rule, including odd input ranks and padding."""
    torch.manual_seed(0)
    ids = torch.tensor([[1, 4, 4, 0, 2], [0, 0, 3, 3, 3], [2, 2, 2, 2, 2]])  # duplicates and padding_idx 0
    return [
        ("linear-2d", nn.Linear(5, 3), torch.randn(4, 5)),
        ("linear-3d", nn.Linear(5, 3), torch.randn(4, 6, 5)),
        ("linear-4d", nn.Linear(5, 3, bias=False), torch.randn(2, 3, 2, 5)),
        ("conv1d", Conv1D(7, 4), torch.randn(3, 6, 4)),
        ("embedding", nn.Embedding(6, 4, padding_idx=0), ids),
        ("embedding-1d", nn.Embedding(6, 4), torch.tensor([5, 1, 5])),
        ("layer-norm", nn.LayerNorm(4), torch.randn(3, 5, 4)),
        ("layer-norm-2d-shape", nn.LayerNorm((2, 3), bias=False), torch.randn(2, 4, 2, 3)),
    ]


def uses_and_grads(module: nn.Module, inputs: Tensor) -> tuple[dict[str, GradientUse], dict[str, Tensor]]:
    """The rule's uses for loss_i = ⟨R_i, module(x_i)⟩, and per-example gradients [B, *shape] by autograd."""
    module = module.double()
    inputs = inputs.double() if inputs.is_floating_point() else inputs
    weights = torch.randn_like(module(inputs))  # R, shaped like the output
    params = dict(module.named_parameters())
    per_example = [
        torch.autograd.grad((module(inputs[i : i + 1]) * weights[i : i + 1]).sum(), list(params.values()))
        for i in range(inputs.shape[0])
    ]
    expected = {name: torch.stack([g[k] for g in per_example]) for k, name in enumerate(params)}  # [B, *shape]
    uses = NORM_RULES[type(module)].gradients(module, inputs, weights)
    return {name: uses[name] for name in params}, expected


@pytest.mark.parametrize(("name", "module", "inputs"), layer_cases(), ids=[case[0] for case in layer_cases()])
def test_rule_gives_per_example_gradients(name: str, module: nn.Module, inputs: Tensor) -> None:
    uses, expected = uses_and_grads(module, inputs)
    factors = torch.rand(inputs.shape[0], dtype=DOUBLE)
    for param, use in uses.items():
        grads = expected[param]
        assert close(materialise(use).reshape(grads.shape), grads)
        assert close(squared_norm(use), grads.flatten(1).pow(2).sum(1))
        assert close(inner_product(use, use), grads.flatten(1).pow(2).sum(1))  # the Gram ("ghost") route
        assert close(weighted_sum(use, factors).reshape(grads.shape[1:]), torch.einsum("b,b...->...", factors, grads))


def random_factor(kind: str, size: int, positions: int, width: int) -> DenseFactor | IndexFactor:
    """A random dense [B, T, n] or index [B, T] factor with repeated indices."""
    if kind == "dense":
        return DenseFactor(torch.randn(size, positions, width, dtype=DOUBLE))
    return IndexFactor(torch.randint(0, width, (size, positions)), width)


def dense(factor: DenseFactor | IndexFactor) -> Tensor:
    """The factor's vectors [B, T, n]."""
    if isinstance(factor, DenseFactor):
        return factor.values
    return nn.functional.one_hot(factor.indices, factor.width).to(DOUBLE)


@pytest.mark.parametrize("first", ["dense", "index"])
@pytest.mark.parametrize("second", ["dense", "index"])
def test_factor_gram_and_weighted_sum_all_kinds(first: str, second: str) -> None:
    torch.manual_seed(1)
    a, b = random_factor(first, 3, 4, 5), random_factor(second, 3, 6, 5)
    expected = torch.einsum("btn,bsn->bts", dense(a), dense(b))
    assert close(factor_gram(a, b, DOUBLE), expected)
    use = FactoredGradient(a, random_factor(second, 3, 4, 7))
    factors = torch.rand(3, dtype=DOUBLE)
    full = torch.einsum("btr,btc->brc", dense(use.left), dense(use.right))
    assert close(weighted_sum(use, factors), torch.einsum("b,brc->rc", factors, full))


def test_cross_terms_of_mixed_uses_are_exact_and_bound_is_above() -> None:
    torch.manual_seed(2)
    uses: list[GradientUse] = [
        FactoredGradient(random_factor("index", 2, 5, 8), random_factor("dense", 2, 5, 3)),  # embedding lookup
        FactoredGradient(random_factor("dense", 2, 4, 8), random_factor("dense", 2, 4, 3)),  # tied linear head
        FactoredGradient(random_factor("dense", 2, 1, 8), random_factor("dense", 2, 1, 3)),  # same kind again
        FactoredGradient(random_factor("index", 2, 2, 8), random_factor("dense", 2, 2, 3)),  # second lookup
        ExampleGradient(torch.randn(2, 8, 3, dtype=DOUBLE)),  # a materialised use
    ]
    total = torch.stack([materialise(use) for use in uses]).sum(0)  # [B, 8, 3]
    exact = parameter_squared_norm(uses, tied_norm="exact")
    bound = parameter_squared_norm(uses, tied_norm="bound")
    assert close(exact, total.flatten(1).pow(2).sum(1))
    per_use = torch.stack([materialise(use).flatten(1).norm(dim=1) for use in uses]).sum(0)
    assert close(bound, per_use.square())
    assert (bound >= exact).all()
    assert close(parameter_squared_norm(uses[:1]), squared_norm(uses[0]))


@pytest.mark.parametrize("tied", [False, True], ids=["one-use", "tied"])
def test_float64_chunks_change_no_norm_and_the_cpu_default_chunks_wide_uses(tied: bool) -> None:
    torch.manual_seed(4)
    wide = FactoredGradient(random_factor("dense", 6, 9, 40), random_factor("dense", 6, 9, 30))
    uses: list[GradientUse] = [wide]
    if tied:
        uses.append(FactoredGradient(random_factor("index", 6, 5, 40), random_factor("dense", 6, 5, 30)))
    total = torch.stack([materialise(use) for use in uses]).sum(0)  # [B, 40, 30], the brute-force gradients
    whole = parameter_squared_norm(uses, chunk_elements=2**25)  # one chunk of all six examples
    assert (whole >= total.flatten(1).pow(2).sum(1)).all() and close(whole, total.flatten(1).pow(2).sum(1))
    for elements in (1, 700, 1400):  # one, one, and two examples per float64 copy
        assert torch.equal(parameter_squared_norm(uses, chunk_elements=elements), whole)
    assert (
        default_chunk_elements(wide) == CPU_CHUNK_ELEMENTS < CHUNK_ELEMENTS
    )  # the default on a CPU: cache-sized copies


def test_ghost_or_materialise_by_cost() -> None:
    def use(positions: int, rows: int, cols: int) -> FactoredGradient:
        return FactoredGradient(random_factor("dense", 1, positions, rows), random_factor("dense", 1, positions, cols))

    assert not prefers_materialising(use(2, 4, 5))  # T·r·c = 40 > T²·(r + c) = 36: Grams
    assert prefers_materialising(use(3, 4, 5))  # 60 ≤ 81: materialise ([B, r, c] no bigger than the factors)
    assert prefers_materialising(use(4, 4, 5))  # also no bigger than the two Grams (2·16 ≥ 20)
    wide = use(5, 20, 30)
    assert not prefers_materialising(wide)
    assert close(squared_norm(wide), materialise(wide).flatten(1).pow(2).sum(1))  # Grams = the materialised norm
    for tall in (use(30, 4, 5), use(30, 5, 4)):  # materialised as G or Gᵀ (narrower factor first): the same norm
        assert prefers_materialising(tall)
        assert close(squared_norm(tall), materialise(tall).flatten(1).pow(2).sum(1))
    lookup = FactoredGradient(random_factor("index", 1, 40, 4), random_factor("dense", 1, 40, 2))
    assert not prefers_materialising(lookup)  # never a per-example vocabulary-sized matrix


def test_monitor_flags_only_gradient_carrying_uses_outside_owners() -> None:
    layer = nn.Linear(2, 2)
    owners = {id(layer.weight): ParameterOwner("layer.weight", frozenset({id(layer)}))}
    monitor = ParameterUseMonitor(owners, {id(layer): "layer"})
    layer.register_forward_pre_hook(monitor.enter)
    layer.register_forward_hook(monitor.exit, always_call=True)
    with monitor:
        layer(torch.randn(1, 2))
        _ = layer.weight.shape, layer.weight.dtype, layer.weight.detach(), layer.weight.data
    assert monitor.violations == []
    with monitor:
        _ = layer.weight.T
    assert len(monitor.violations) == 1 and "'layer.weight'" in monitor.violations[0]


class Scale(nn.Module):
    """y = x ⊙ s: a module type without a built-in rule."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def scale_gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict[str, GradientUse]:
    """s: Σ_t g_t ⊙ x_t [B, d]."""
    return {"scale": ExampleGradient((output_grad * activation).flatten(1, -2).sum(1))}  # [B, T, d] -> [B, d]


def test_custom_rule_through_engine_rules_option() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    rules = {**NORM_RULES, Scale: NormRule(("scale",), scale_gradients)}
    batch = {"x": torch.randn(5, 2, 3, dtype=DOUBLE)}

    def loss_fn(b: dict[str, Tensor]) -> Tensor:
        return model(b["x"]).pow(2).sum((1, 2))

    with pytest.raises(ValueError, match=r"'1\.scale'.*Scale"):
        GhostEngine(model, max_grad_norm=0.1).accumulate(loss_fn, batch)
    engine = GhostEngine(model, max_grad_norm=0.1, rules=rules)
    grads = per_example_gradients(model, loss_fn, batch)
    stats = engine.accumulate(loss_fn, batch)
    assert close(stats.norms, gradient_norms(grads))
    expected = clipped_sum(grads, 0.1)
    for name, param in model.named_parameters():
        assert close(param.grad, expected[name])


@pytest.mark.parametrize("shape", [(5,), (2, 3)])
def test_stacked_squared_norms_equal_each_parameter_own(shape: tuple[int, ...]) -> None:
    torch.manual_seed(3)
    values = torch.randn(4, 3, *shape)  # [P, B, *shape] float32, as the uses of four biases of one shape
    values[1, 2] = 0.0  # an example with no gradient
    stacked = stacked_squared_norms(values)
    assert stacked.shape == (4, 3) and stacked.dtype == DOUBLE
    for p in range(4):
        own = parameter_squared_norm([ExampleGradient(values[p])])
        assert torch.equal(stacked[p], own)
        assert (own >= values[p].double().flatten(1).pow(2).sum(1)).all()  # never below the true squared norm


@pytest.mark.parametrize(("rows", "cols"), [(4, 5), (5, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, DOUBLE])
def test_materialised_norm_keeps_the_gradients_it_was_taken_of(rows: int, cols: int, dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    exact = FactoredGradient(random_factor("dense", 3, 30, rows), random_factor("dense", 3, 30, cols))
    use = FactoredGradient(DenseFactor(exact.left.values.to(dtype)), DenseFactor(exact.right.values.to(dtype)))
    assert prefers_materialising(use)
    squared, gradients = materialised_parameter_squared_norm(use)
    assert gradients.shape == (3, rows, cols) and gradients.dtype == dtype  # in the parameter's layout and dtype
    truth = materialise(FactoredGradient(DenseFactor(use.left.values.double()), DenseFactor(use.right.values.double())))
    assert torch.allclose(gradients.double(), truth, rtol=1e-5, atol=1e-5)
    true_squared = truth.flatten(1).pow(2).sum(1)
    assert (squared >= true_squared).all()  # never below the true norm of these factors ...
    assert (squared >= gradients.double().flatten(1).pow(2).sum(1)).all()  # ... nor below what the sum is formed of
    assert (squared <= true_squared * (1 + 1e-4)).all()  # and tight
    if dtype == DOUBLE:
        assert close(gradients, materialise(use))
        assert close(squared, parameter_squared_norm([use]))  # as the float64 route without keeping them
