"""The privacy ledger agrees with opacus' accountants and round-trips through state_dict."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from dplit.privacy.accountant import PrivacyAccountant, calibrate_noise_multiplier, default_delta


@pytest.mark.parametrize(("mechanism", "reference"), [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_equals_opacus_for_same_history(mechanism: str, reference: type) -> None:
    ledger = PrivacyAccountant(delta=1e-5, mechanism=mechanism)  # type: ignore[arg-type]
    opacus = reference()
    for _ in range(40):
        ledger.step(noise_multiplier=1.1, sample_rate=0.01)
        opacus.step(noise_multiplier=1.1, sample_rate=0.01)
    assert ledger.steps == 40
    assert ledger.epsilon() == pytest.approx(opacus.get_epsilon(1e-5), rel=1e-9)


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


def test_default_delta_and_bad_arguments() -> None:
    assert default_delta(1000) == pytest.approx(1000**-1.1)
    with pytest.raises(ValueError, match="empty"):
        default_delta(0)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant(delta=1e-5, mechanism="gdp")  # type: ignore[arg-type]
