"""The white-box scale checks: an inclusion moves its coordinate by C, the noise is at least σC."""

from __future__ import annotations

import torch

from dplit.audit.calibration import noise_check, scale_checks, signal_check


def readings(*, canaries: int = 2000, steps: int = 20, sample_rate: float = 0.5, sigma: float = 2.0,
             signal: float = 1.0, noise: float = 1.0, data_std: float = 0.0, seed: int = 0):  # fmt: skip
    """Readings (in units of C) of a mechanism adding ``signal`` per inclusion and ``noise``·σ noise.

    The real examples add a level of their own at each coordinate that drifts over the steps with std ``data_std``.
    """
    generator = torch.Generator().manual_seed(seed)
    included = torch.rand(canaries, generator=generator) < 0.5  # [m]
    sampled = included & (torch.rand(steps, canaries, generator=generator) < sample_rate)  # [T, m]
    base = torch.randn(canaries, generator=generator, dtype=torch.float64) * 0.3  # [m]: a coordinate's own level
    drift = torch.randn(steps, canaries, generator=generator, dtype=torch.float64) * data_std  # [T, m]
    noisy = torch.randn(steps, canaries, generator=generator, dtype=torch.float64) * sigma * noise  # [T, m]
    values = signal * sampled.double() + base + drift + noisy  # [T, m]
    return values.sum(0), (values**2).sum(0), included


def test_a_correct_mechanism_passes_both_checks_even_with_the_data_moving_the_coordinates() -> None:
    sums, squares, included = readings(data_std=0.5)
    checks = scale_checks(sums, squares, included, steps=20, sample_rate=0.5, noise_multiplier=2.0)
    assert [check.passed for check in checks] == [True, True]
    assert abs(checks[0].measured - 1) < 0.2 and checks[1].measured >= 1


def test_a_signal_scaled_by_the_realised_batch_fails_the_signal_check() -> None:
    sums, squares, included = readings(signal=64 / 564, noise=64 / 564)
    check = signal_check(sums, included, steps=20, sample_rate=0.5)
    assert not check.passed and check.high < 0.5 and "FAILED" in check.line()


def test_an_unclipped_canary_fails_the_signal_check() -> None:
    sums, _, included = readings(signal=10.0)
    assert not signal_check(sums, included, steps=20, sample_rate=0.5).passed


def test_half_the_noise_fails_the_noise_check() -> None:
    sums, squares, included = readings(noise=0.5)
    check = noise_check(sums, squares, included, steps=20, noise_multiplier=2.0)
    assert not check.passed and 0.45 < check.measured < 0.55


def test_no_noise_or_one_step_skips_the_noise_check_and_one_sided_membership_skips_both() -> None:
    sums, squares, included = readings()
    assert len(scale_checks(sums, squares, included, steps=20, sample_rate=0.5, noise_multiplier=0.0)) == 1
    assert len(scale_checks(sums, squares, included, steps=1, sample_rate=0.5, noise_multiplier=2.0)) == 1
    everyone = torch.ones_like(included)
    assert scale_checks(sums, squares, everyone, steps=20, sample_rate=0.5, noise_multiplier=2.0) == []
