"""The privacy ledger agrees with opacus' accountants, round-trips through state_dict, and refuses in one line.

What opacus cannot account for is refused (in one line naming the flag) before anything is computed.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import numpy as np
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.prv import Domain, PoissonSubsampledGaussianPRV, compute_safe_domain_size

from dplit.privacy.accounting import (
    PrivacyAccountant,
    calibrate_noise_multiplier,
    check_accountable,
    default_delta,
    limits,
    opacus_epsilon,
)


def _refusal(call: Any, **kwargs: Any) -> str:
    """The message of the ValueError ``call(**kwargs)`` raises, checked to be one line."""
    with pytest.raises(ValueError) as caught:
        call(**kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture
def no_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any ε is computed (PRV or RDP), so a refusal provably comes before any computation."""

    def forbidden(*_: object, **__: object) -> float:
        raise AssertionError("an accountant computation ran before the refusal")

    monkeypatch.setattr(opacus_epsilon, "prv_epsilon", forbidden)
    monkeypatch.setattr(opacus_epsilon, "rdp_epsilon", forbidden)


@pytest.mark.parametrize(("mechanism", "reference"), [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_equals_opacus_for_same_history(mechanism: str, reference: type) -> None:
    ledger = PrivacyAccountant(delta=1e-5, mechanism=mechanism)  # type: ignore[arg-type]
    opacus = reference()
    for _ in range(40):
        ledger.step(noise_multiplier=1.1, sample_rate=0.01)
        opacus.step(noise_multiplier=1.1, sample_rate=0.01)
    assert ledger.steps == 40
    assert ledger.epsilon() == pytest.approx(opacus.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_heterogeneous_history_equals_opacus_exactly(mechanism: str) -> None:
    history = [(1.0, 0.02, 5), (2.0, 0.05, 7), (0.7, 0.01, 3)]
    ledger = PrivacyAccountant(delta=1e-6, mechanism=mechanism)  # type: ignore[arg-type]
    ledger.load_state_dict({"delta": 1e-6, "mechanism": mechanism, "history": history})
    opacus = PRVAccountant() if mechanism == "prv" else RDPAccountant()
    opacus.history = list(history)
    assert ledger.epsilon() == opacus.get_epsilon(1e-6)


@pytest.mark.parametrize(
    ("history", "delta"),
    [([(1.1, 0.01, 40)], 1e-5), ([(1.0, 0.5, 100)], 1e-6), ([(0.8, 1.0, 10)], 1e-9), ([(3.0, 1e-4, 50000)], 1e-8)],
)
def test_predicted_prv_grid_is_opacus_domain(history: list[tuple[float, float, int]], delta: float) -> None:
    """The size the checks predict is the grid opacus 1.6 builds (catches a change in opacus' discretisation)."""
    steps, delta_error = sum(n for *_, n in history), delta / 1000
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    half_width = compute_safe_domain_size(prvs, [n for *_, n in history], 0.01, delta_error)
    domain = Domain.create_aligned(-half_width, half_width, 0.01 / np.sqrt(steps * np.log(12 / delta_error) / 2))
    assert opacus_epsilon.prv_grid(history, delta) == domain.size


def test_epsilon_with_extra_steps_does_not_record_them() -> None:
    ledger = PrivacyAccountant(delta=1e-5, mechanism="rdp")
    ledger.step(noise_multiplier=1.0, sample_rate=0.02)
    ahead = ledger.epsilon(extra_steps=1, noise_multiplier=1.0, sample_rate=0.02)
    assert ledger.steps == 1 and ahead > ledger.epsilon()
    ledger.step(noise_multiplier=1.0, sample_rate=0.02)
    assert ledger.epsilon() == pytest.approx(ahead)


def test_no_noise_is_infinite_epsilon_and_no_steps_is_zero() -> None:
    ledger = PrivacyAccountant(delta=1e-5)
    assert ledger.epsilon() == 0.0
    ledger.step(noise_multiplier=0.0, sample_rate=0.1)
    assert math.isinf(ledger.epsilon())
    check_accountable(mechanism="prv", sample_rate=0.1, steps=100, delta=1e-5, noise_multiplier=0.0)


def test_state_dict_round_trip_continues_the_ledger() -> None:
    first = PrivacyAccountant(delta=1e-6, mechanism="rdp")
    for sigma in (1.0, 1.0, 2.0):
        first.step(noise_multiplier=sigma, sample_rate=0.05)
    second = PrivacyAccountant(delta=1e-6, mechanism="rdp")
    second.load_state_dict(first.state_dict())
    assert second.steps == 3 and second.epsilon() == first.epsilon()
    with pytest.raises(ValueError, match="δ"):
        PrivacyAccountant(delta=1e-5, mechanism="rdp").load_state_dict(first.state_dict())


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_calibrated_sigma_meets_target_tightly(mechanism: str) -> None:
    sigma = calibrate_noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=0.02, steps=200, mechanism=mechanism)
    ledger = PrivacyAccountant(delta=1e-5, mechanism=mechanism)  # type: ignore[arg-type]
    epsilon = ledger.epsilon(extra_steps=200, noise_multiplier=sigma, sample_rate=0.02)
    assert 2.9 < epsilon <= 3.0


@pytest.mark.parametrize(
    ("mechanism", "target", "rate", "steps"),
    [
        ("prv", 1.0, 0.01, 1000),
        ("prv", 8.0, 0.05, 300),
        ("prv", 0.5, 1.0, 1),
        ("rdp", 1.0, 1.0, 10_000),  # full batch: σ ≈ 500, above calibration's first bracket
        ("rdp", 50.0, 0.1, 100),
    ],
)
def test_calibration_in_normal_ranges_spends_at_most_the_target(
    mechanism: str, target: float, rate: float, steps: int
) -> None:
    check_accountable(mechanism=mechanism, sample_rate=rate, steps=steps, delta=1e-6, target_epsilon=target)  # type: ignore[arg-type]
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=1e-6, sample_rate=rate, steps=steps, mechanism=mechanism, epsilon_tolerance=0.02
    )  # type: ignore[arg-type]
    check_accountable(mechanism=mechanism, sample_rate=rate, steps=steps, delta=1e-6, noise_multiplier=sigma)  # type: ignore[arg-type]
    epsilon = PrivacyAccountant(delta=1e-6, mechanism=mechanism).epsilon(  # type: ignore[arg-type]
        extra_steps=steps, noise_multiplier=sigma, sample_rate=rate
    )
    assert target - 0.02 <= epsilon <= target


@pytest.mark.parametrize(
    ("kwargs", "flag", "range_text"),
    [
        ({"mechanism": "gdp", "noise_multiplier": 1.0}, "DPStrategy.accountant", "'prv' or 'rdp'"),
        ({"delta": 0.5, "noise_multiplier": 1.0}, "DPStrategy.target_delta", "(0, 0.1]"),
        ({"delta": 0.99, "target_epsilon": 1.0, "mechanism": "rdp"}, "DPStrategy.target_delta", "(0, 0.1]"),
        ({"delta": 1e-13, "noise_multiplier": 1.0}, "DPStrategy.target_delta", "below 1e-12"),
        ({"sample_rate": 0.0, "noise_multiplier": 1.0}, "data.batch_size", "(0, 1]"),
        ({"noise_multiplier": 5000.0}, "DPStrategy.noise_multiplier", "(0, 1000]"),
        ({"noise_multiplier": math.nan, "mechanism": "rdp"}, "DPStrategy.noise_multiplier", "(0, 1000]"),
        ({"noise_multiplier": 1e-6}, "DPStrategy.noise_multiplier", "noise_multiplier ≥ "),
        ({"noise_multiplier": 1e-6, "steps": None}, "DPStrategy.noise_multiplier", "noise_multiplier ≥ "),
        ({"target_epsilon": 1e6}, "DPStrategy.target_epsilon", "(0, 100]"),
        ({"target_epsilon": 1e6, "mechanism": "rdp"}, "DPStrategy.target_epsilon", "(0, 100]"),
        ({"target_epsilon": 0.005}, "DPStrategy.target_epsilon", "not above 0.01"),
        ({"target_epsilon": 0.1, "mechanism": "rdp"}, "DPStrategy.target_epsilon", "not above 0.103"),
        ({"target_epsilon": 100.0, "steps": 100_000}, "DPStrategy.target_epsilon", "target_epsilon ≤ "),
        ({"target_epsilon": 1.0, "steps": None}, "DPStrategy.target_epsilon", "trainer.max_epochs"),
    ],
)
def test_check_accountable_refuses_in_one_line_naming_flag_and_range(
    kwargs: dict[str, Any], flag: str, range_text: str, no_accounting: None
) -> None:
    arguments = {"mechanism": "prv", "sample_rate": 0.01, "steps": 1000, "delta": 1e-5, **kwargs}
    message = _refusal(check_accountable, **arguments)
    assert flag in message and range_text in message


def test_smallest_noise_multiplier_named_is_accepted() -> None:
    plan = {"mechanism": "prv", "sample_rate": 0.01, "steps": 1000, "delta": 1e-5}
    message = _refusal(check_accountable, **plan, noise_multiplier=1e-6)
    match = re.search(r"noise_multiplier ≥ ([0-9.e+-]+)", message)
    assert match is not None
    smallest = float(match.group(1))
    check_accountable(**plan, noise_multiplier=smallest)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_multiplier"):
        check_accountable(**plan, noise_multiplier=smallest * 0.9)  # type: ignore[arg-type]


def test_accepted_inputs_pass() -> None:
    for mechanism in ("prv", "rdp"):
        check_accountable(mechanism=mechanism, sample_rate=0.01, steps=1000, delta=1e-5, noise_multiplier=1.0)  # type: ignore[arg-type]
        check_accountable(mechanism=mechanism, sample_rate=0.01, steps=None, delta=1e-5, noise_multiplier=1.0)  # type: ignore[arg-type]
        check_accountable(mechanism=mechanism, sample_rate=1.0, steps=0, delta=0.1, target_epsilon=8.0)  # type: ignore[arg-type]
    check_accountable(mechanism="rdp", sample_rate=0.01, steps=1000, delta=1e-13, noise_multiplier=1e-6)


def test_audit_cases_refuse_before_any_accounting(no_accounting: None) -> None:
    """Budgets no accountant can compute are refused by arithmetic and one RDP curve, never reaching one.

    target_epsilon 1e6 (opacus bisects toward σ → 0 and hangs) and noise_multiplier 1e-6 (PRV allocates 2 PiB).
    """
    message = _refusal(
        calibrate_noise_multiplier, target_epsilon=1e6, delta=1e-5, sample_rate=0.01, steps=1000, mechanism="prv"
    )
    assert "DPStrategy.target_epsilon" in message
    plan = {"mechanism": "prv", "sample_rate": 0.01, "steps": 1000, "delta": 1e-5}
    assert "DPStrategy.noise_multiplier" in _refusal(check_accountable, **plan, noise_multiplier=1e-6)
    ledger = PrivacyAccountant(delta=1e-5, mechanism="prv")
    message = _refusal(ledger.epsilon, extra_steps=1000, noise_multiplier=1e-6, sample_rate=0.01)
    assert "DPStrategy.accountant='prv'" in message and "accountant='rdp'" in message


def test_unreachable_target_names_what_to_change() -> None:
    """Opacus' "The privacy budget is too low." becomes a refusal naming the flags, after ≤ 3 ε evaluations."""
    message = _refusal(
        calibrate_noise_multiplier, target_epsilon=0.5, delta=1e-5, sample_rate=1.0, steps=100_000, mechanism="rdp"
    )
    assert "DPStrategy.target_epsilon=0.5 cannot be reached over 100000 steps at q=1" in message
    assert "trainer.max_epochs" in message and "data.batch_size" in message


def test_target_beyond_prv_grid_is_refused_with_the_largest_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "PRV_MAX_GRID", 200_000)  # a small limit keeps the test fast
    plan = {"delta": 1e-5, "sample_rate": 0.01, "steps": 1000, "mechanism": "prv"}
    check_accountable(**plan, target_epsilon=6.0)  # type: ignore[arg-type]  # passes the arithmetic bound
    message = _refusal(calibrate_noise_multiplier, **plan, target_epsilon=6.0)
    assert "DPStrategy.target_epsilon=6 is beyond DPStrategy.accountant='prv'" in message
    match = re.search(r"lower target_epsilon to ≤ ([0-9.]+)", message)
    assert match is not None and "accountant='rdp'" in message
    largest = float(match.group(1))
    sigma = calibrate_noise_multiplier(**plan, target_epsilon=largest)  # type: ignore[arg-type]
    assert PrivacyAccountant(delta=1e-5).epsilon(extra_steps=1000, noise_multiplier=sigma, sample_rate=0.01) <= largest


def test_opacus_cannot_compute_epsilon_is_translated() -> None:
    ledger = PrivacyAccountant(delta=0.99, mechanism="prv")  # a ledger opened without check_accountable
    with pytest.raises(ValueError) as caught:
        ledger.epsilon(extra_steps=1000, noise_multiplier=1.0, sample_rate=0.01)
    message = str(caught.value)
    assert "\n" not in message and "opacus: Cannot compute epsilon" in message
    assert "DPStrategy.target_delta ≤ 0.1" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            ValueError(
                "Floating point errors will dominate for such small values of delta. Increase delta or reduce domain size."
            ),
            "raise DPStrategy.target_delta",
        ),
        (RuntimeError("Discrete mean differs significantly from continuous mean."), "DPStrategy.accountant='rdp'"),
        (RuntimeError("Cannot compute epsilon"), "DPStrategy.target_delta ≤ 0.1"),
        (MemoryError(), "MemoryError"),
    ],
)
def test_other_opacus_errors_are_translated_in_epsilon_and_calibration(
    error: BaseException, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*_: object) -> float:
        raise error

    monkeypatch.setattr(opacus_epsilon, "prv_epsilon", failing)
    ledger = PrivacyAccountant(delta=1e-5, mechanism="prv")
    message = _refusal(ledger.epsilon, extra_steps=10, noise_multiplier=1.0, sample_rate=0.01)
    assert "DPStrategy.accountant='prv' cannot compute ε for 10 steps at σ=1, q=0.01" in message and expected in message
    message = _refusal(calibrate_noise_multiplier, target_epsilon=3.0, delta=1e-5, sample_rate=0.02, steps=200)
    assert expected in message


def test_rdp_order_warnings_are_not_shown() -> None:
    ledger = PrivacyAccountant(delta=1e-5, mechanism="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        large = ledger.epsilon(extra_steps=10, noise_multiplier=1000.0, sample_rate=0.01)  # "largest alpha"
        small = ledger.epsilon(extra_steps=10, noise_multiplier=0.01, sample_rate=0.01)  # "smallest alpha"
    assert 0 < large < small


def test_calibration_arguments() -> None:
    with pytest.raises(ValueError, match="epsilon_tolerance"):
        calibrate_noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=0.02, steps=200, epsilon_tolerance=0)
    assert "DPStrategy.target_epsilon" in _refusal(
        calibrate_noise_multiplier, target_epsilon=-1.0, delta=1e-5, sample_rate=0.02, steps=200
    )


def test_default_delta_and_bad_arguments() -> None:
    assert default_delta(1000) == pytest.approx(1000**-1.1)
    with pytest.raises(ValueError, match="empty"):
        default_delta(0)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant(delta=1e-5, mechanism="gdp")  # type: ignore[arg-type]
