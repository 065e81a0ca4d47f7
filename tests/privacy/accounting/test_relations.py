"""ε under add/remove-one and replace-one (dp-accounting's PLD).

The issue's numbers for the shipped configs, an exact closed form at q = 1, agreement with dplit's PRV accountant,
and one-line refusals.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm
from torch.utils.data import DataLoader, TensorDataset

from dplit.privacy.accounting import PrivacyAccountant, calibrate_noise_multiplier, default_delta
from dplit.privacy.accounting.relations import epsilon_composed, epsilon_under, epsilons
from dplit.privacy.sampling import poisson_loader

# --- the shipped configs (issue 31 §4) ----------------------------------------------------------------------------


def _planned_history(
    rows: int, batch_size: int, epochs: int, target: float
) -> tuple[list[tuple[float, float, int]], float]:
    """The (σ, q, steps) history and δ a shipped config plans, as ``DPStrategy`` does.

    Lightning counts ``len(poisson_loader)`` batches per epoch (round(N / batch), not ceil), δ = N^-1.1, σ from
    dplit's own PRV calibration.
    """
    rate = batch_size / rows
    loader = DataLoader(TensorDataset(torch.zeros(rows)), batch_size=batch_size)
    steps = epochs * len(poisson_loader(loader, sample_rate=rate, num_replicas=1, rank=0, seed=0))
    delta = default_delta(rows)
    sigma = calibrate_noise_multiplier(target_epsilon=target, delta=delta, sample_rate=rate, steps=steps)
    return [(sigma, rate, steps)], delta


# The issue quotes replace-one ε to 2 decimals (±0.005), and calibration may land the PRV ε anywhere in
# [target − 0.01, target], which moves σ and so ε by a few thousandths more: 0.01 covers both. Measured (σ, ε):
# SST-2 201 steps σ = 0.5502 → 8.623; QNLI 312 steps σ = 0.6248 → 9.163; SST-2 ε = 3 σ = 0.7728 → 3.465.
# (With ceil(N / batch) steps they would be 8.630, 9.180, 3.476: the issue's numbers confirm round().)
@pytest.mark.parametrize(
    ("rows", "batch_size", "epochs", "target", "replace_one"),
    [
        pytest.param(67_349, 1000, 3, 8.0, 8.62, id="sst2-eps8"),
        pytest.param(104_743, 2000, 6, 8.0, 9.16, id="qnli-eps8"),
        pytest.param(67_349, 1000, 3, 3.0, 3.47, id="sst2-eps3"),
    ],
)
def test_shipped_configs_match_the_issue(
    rows: int, batch_size: int, epochs: int, target: float, replace_one: float
) -> None:
    history, delta = _planned_history(rows, batch_size, epochs, target)
    measured = epsilons(history, delta=delta)
    assert measured["replace_one"] == pytest.approx(replace_one, abs=0.01)
    # add/remove: the PLD sits at or below the calibrated PRV ε (≤ target), within PRV's ε error (0.01) + 0.0025
    assert target - 0.0225 <= measured["add_remove"] <= target


def test_sst2_add_remove_matches_the_card() -> None:
    history, delta = _planned_history(67_349, 1000, 3, 8.0)
    assert epsilon_under("add_remove", history, delta=delta) == pytest.approx(7.98, abs=0.01)  # measured 7.984


# --- an independent number: q = 1 is one Gaussian mechanism ------------------------------------------------------


def _analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of a Gaussian mechanism with μ = sensitivity / std at δ.

    The root of the exact δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang 2018, Theorem 8).
    """

    def excess(epsilon: float) -> float:
        return norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2) - delta

    return 0.0 if excess(0.0) <= 0 else brentq(excess, 0.0, 700.0, xtol=1e-12)


# k steps at q = 1 compose to one Gaussian with μ = √k/σ (add/remove: sensitivity C) or 2√k/σ (replace-one: 2C).
# PLD is an upper bound (pessimistic rounding): never below the exact ε, and above it by at most 2e-3 on a 1e-3
# grid (measured ≤ 6.3e-4 at 3,000 steps, ≤ 3e-6 at ≤ 10 steps; the error grows with the number of convolutions).
_EXACT_TOLERANCE = 2e-3


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
@pytest.mark.parametrize(
    ("sigma", "steps", "delta"),
    [(1.0, 1, 1e-5), (0.5, 1, 1e-3), (2.0, 10, 1e-5), (5.0, 100, 1e-6), (20.0, 3000, 1e-5)],
)
def test_q1_matches_the_analytic_gaussian(relation: str, sigma: float, steps: int, delta: float) -> None:
    sensitivity = 1.0 if relation == "add_remove" else 2.0
    exact = _analytic_gaussian_epsilon(sensitivity * math.sqrt(steps) / sigma, delta)
    measured = epsilon_under(relation, [(sigma, 1.0, steps)], delta=delta)  # type: ignore[arg-type]
    assert exact - 1e-9 <= measured <= exact + _EXACT_TOLERANCE


@pytest.mark.parametrize(("relation", "sensitivity"), [("add_remove", 1.0), ("replace_one", 2.0)])
def test_segments_compose_heterogeneously(relation: str, sensitivity: float) -> None:
    """Segments (σ_i, 1, k_i) compose to one Gaussian with μ = sensitivity · sqrt(Σ k_i / σ_i²)."""
    history = [(2.0, 1.0, 10), (5.0, 1.0, 50), (0.8, 1.0, 1)]
    mu = sensitivity * math.sqrt(sum(steps / sigma**2 for sigma, _, steps in history))
    exact = _analytic_gaussian_epsilon(mu, 1e-5)
    measured = epsilon_under(relation, history, delta=1e-5)  # type: ignore[arg-type]
    assert exact - 1e-9 <= measured <= exact + _EXACT_TOLERANCE


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_splitting_a_segment_changes_nothing(relation: str) -> None:
    whole = epsilon_under(relation, [(0.6, 0.02, 300)], delta=1e-6)  # type: ignore[arg-type]
    split = epsilon_under(relation, [(0.6, 0.02, 100), (0.6, 0.02, 200)], delta=1e-6)  # type: ignore[arg-type]
    assert split == pytest.approx(whole, abs=1e-6)  # measured 3e-8


# --- against dplit's own (PRV) accountant -----------------------------------------------------------------------

# opacus' PRV ε is an upper estimate within its eps_error (0.01) of the truth, the PLD one within ≈ 0.002 above it:
# they differ by at most 0.0125 (measured +0.009 to +0.011 here; design.md §6: within +0.0125 on a 96-point grid).


@pytest.mark.parametrize(
    ("sigma", "rate", "steps", "delta"),
    [(0.55, 0.0148, 201, 4.88e-6), (1.0, 0.01, 1000, 1e-5), (0.8, 0.05, 300, 1e-6), (2.0, 0.1, 500, 1e-5)],
)
def test_add_remove_agrees_with_dplit_prv(sigma: float, rate: float, steps: int, delta: float) -> None:
    ledger = PrivacyAccountant(delta=delta, mechanism="prv")
    ledger.load_state_dict({**ledger.state_dict(), "history": [(sigma, rate, steps)]})
    prv = ledger.epsilon()
    pld = epsilon_under("add_remove", [(sigma, rate, steps)], delta=delta)
    assert -0.0025 <= prv - pld <= 0.0125


@pytest.mark.parametrize("rate", [0.001, 0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("sigma", [0.6, 1.0, 3.0])
def test_replace_one_is_never_below_add_remove(sigma: float, rate: float) -> None:
    measured = epsilons([(sigma, rate, 50)], delta=1e-5)
    assert measured["replace_one"] >= measured["add_remove"] > 0


def test_a_long_history_is_fast() -> None:
    started = time.perf_counter()
    epsilons([(0.7, 0.004, 1000), (0.55, 0.0148, 2000)], delta=1e-6)
    assert time.perf_counter() - started < 5.0  # measured ≈ 0.3 s for both relations on 2 cores


# --- segments each under its own relation (issue 49 §3) ---------------------------------------------------------

_MIXED = [(1.0, 0.1, 20), (0.8, 0.05, 30), (1.5, 0.2, 10)]


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_one_relation_throughout_is_epsilon_under_that_relation(relation: str) -> None:
    composed = epsilon_composed([(relation, *segment) for segment in _MIXED], delta=1e-5)  # type: ignore[misc]
    assert composed == pytest.approx(epsilon_under(relation, _MIXED, delta=1e-5), abs=1e-9)  # type: ignore[arg-type]


def test_mixed_relations_at_q1_are_one_gaussian_with_each_segments_sensitivity() -> None:
    """At q = 1: μ² = Σ k_i (s_i / σ_i)², s = 1 (add/remove, C) or 2 (replace-one, 2C), in either order."""
    segments = [("replace_one", 2.0, 1.0, 10), ("add_remove", 5.0, 1.0, 50), ("add_remove", 0.8, 1.0, 1)]
    mu = math.sqrt(
        sum(steps * ((2.0 if rel == "replace_one" else 1.0) / sigma) ** 2 for rel, sigma, _, steps in segments)
    )
    exact = _analytic_gaussian_epsilon(mu, 1e-5)
    for order in (segments, segments[::-1]):
        measured = epsilon_composed(order, delta=1e-5)  # type: ignore[arg-type]
        assert exact - 1e-9 <= measured <= exact + _EXACT_TOLERANCE


def test_a_replace_one_segment_lies_between_all_add_remove_and_all_replace_one() -> None:
    """One user-level segment under an example-level claim costs more than add/remove, less than all replace-one."""
    mixed = epsilon_composed([("replace_one", *_MIXED[0]), *[("add_remove", *s) for s in _MIXED[1:]]], delta=1e-5)  # type: ignore[misc]
    bounds = epsilons(_MIXED, delta=1e-5)
    assert bounds["add_remove"] + 0.05 < mixed < bounds["replace_one"] - 0.05


def test_composed_edges_and_refusals() -> None:
    assert epsilon_composed([], delta=1e-5) == 0.0
    assert epsilon_composed([("add_remove", 1.0, 0.1, 3), ("replace_one", 0.0, 0.1, 1)], delta=1e-5) == math.inf
    for segments, names in [
        ([("substitution", 1.0, 0.1, 3)], "segments[0]: relation"),
        ([("add_remove", 1.0, 0.1)], "segments[0] must be a (relation, sigma, q, steps)"),
        ([("add_remove", 1.0, 0.1, 0)], "segments[0]: steps"),
        ([("add_remove", 1.0, 0.1, 3), ("replace_one", 1.0, 1.5, 3)], "segments[1]: sample rate q"),
        ([1.0], "segments[0] must be"),
    ]:
        with pytest.raises(ValueError) as caught:
            epsilon_composed(segments, delta=1e-5)  # type: ignore[arg-type]
        assert "\n" not in str(caught.value) and names in str(caught.value)


# --- edges and refusals -----------------------------------------------------------------------------------------


def test_no_noise_is_infinite_and_no_steps_is_free() -> None:
    assert epsilon_under("replace_one", [(1.0, 0.01, 10), (0.0, 0.01, 1)], delta=1e-5) == math.inf
    assert epsilon_under("add_remove", [(0.0, 1.0, 1)], delta=1e-5) == math.inf
    assert epsilon_under("add_remove", [], delta=1e-5) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"relation": "substitution"}, "relation"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"history": [(1.0, 0.01)]}, "history[0]"),
        ({"history": [(1.0, 0.01, 10), (-1.0, 0.01, 10)]}, "history[1]: noise multiplier"),
        ({"history": [(float("inf"), 0.01, 10)]}, "sigma"),
        ({"history": [(1.0, 0.0, 10)]}, "sample rate q"),
        ({"history": [(1.0, 1.5, 10)]}, "sample rate q"),
        ({"history": [(1.0, float("nan"), 10)]}, "sample rate q"),
        ({"history": [(1.0, 0.01, 0)]}, "steps"),
        ({"history": [(1.0, 0.01, 2.5)]}, "steps"),
        ({"history": [(1.0, 0.01, True)]}, "steps"),
        ({"value_discretization_interval": 0.0}, "value_discretization_interval"),
    ],
)
def test_nonsense_is_refused_in_one_line(kwargs: dict[str, Any], names: str) -> None:
    call: dict[str, Any] = {"relation": "add_remove", "history": [(1.0, 0.01, 10)], "delta": 1e-5, **kwargs}
    relation, history = call.pop("relation"), call.pop("history")
    with pytest.raises(ValueError) as caught:
        epsilon_under(relation, history, **call)
    message = str(caught.value)
    assert "\n" not in message and names in message
