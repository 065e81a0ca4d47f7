"""The white-box scale checks: an inclusion moves its coordinate by C, the noise is at least σC."""

from __future__ import annotations

import pytest
import torch

from dplit.audit.calibration import ROUNDING, first_step_signal, noise_check, scale_checks


def readings(*, canaries: int = 2000, steps: int = 20, sample_rate: float = 0.5, sigma: float = 2.0,
             signal: float = 1.0, noise: float = 1.0, data_std: float = 0.0, feedback: float = 0.0,
             seed: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """Readings (in units of C) of a mechanism adding ``signal`` per inclusion and ``noise``·σ noise.

    The real examples add a level of their own at each coordinate that drifts over the steps with std ``data_std``,
    and push back on the weight's displacement: the update moves the weight by minus the reading, and the data's
    gradient there is ``feedback`` times the displacement (so included canaries drift apart from excluded ones).
    """
    generator = torch.Generator().manual_seed(seed)
    included = torch.rand(canaries, generator=generator) < 0.5  # [m]
    level = torch.randn(canaries, generator=generator, dtype=torch.float64) * 0.3  # [m]: a coordinate's own level
    weight = torch.zeros(canaries, dtype=torch.float64)  # [m]: displacement from the start
    totals = {key: torch.zeros(canaries, dtype=torch.float64) for key in ("sums", "squares", "contrast", "contrast2")}
    first = None
    for step in range(steps):
        sampled = included & (torch.rand(canaries, generator=generator) < sample_rate)  # [m]
        drift = torch.randn(canaries, generator=generator, dtype=torch.float64) * data_std  # [m]
        noisy = torch.randn(canaries, generator=generator, dtype=torch.float64) * sigma * noise  # [m]
        reading = signal * sampled.double() + level + drift + feedback * weight + noisy  # [m]
        weight -= reading
        first = reading if first is None else first
        earlier = totals["sums"] / step if step else torch.zeros_like(reading)
        term = (sampled.double() - sample_rate) * (reading - earlier)
        totals["contrast"] += term
        totals["contrast2"] += term**2
        totals["sums"] += reading
        totals["squares"] += reading**2
    return {"first": first, **totals, "included": included, "contrast_steps": steps}


def checks(data: dict, *, steps: int = 20, sample_rate: float = 0.5, sigma: float = 2.0) -> list:
    return scale_checks(data["first"], data["sums"], data["squares"], data["contrast"], data["contrast2"],
                        data["included"], steps=steps, contrast_steps=data["contrast_steps"], sample_rate=sample_rate,
                        noise_multiplier=sigma)  # fmt: skip


def test_a_correct_mechanism_passes_both_checks_even_with_the_data_moving_the_coordinates() -> None:
    data = readings(data_std=0.5)
    signal, noise = checks(data)
    assert signal.passed and noise.passed and "sampled contrast" in signal.name
    assert abs(signal.measured - 1) < 0.2 and noise.measured >= 1


@pytest.mark.parametrize("sample_rate", [0.3, 1.0])
def test_feedback_from_the_data_does_not_fail_a_correct_mechanism(sample_rate: float) -> None:
    """Data pushing the canaries' weights back does not fail a correct mechanism's signal check.

    Included canaries' mean reading over the run falls well below the excluded ones' + q, yet the signal checks
    (sampled contrast, first step) see exactly 1 per inclusion.
    """
    data = readings(canaries=10_000, steps=40, sample_rate=sample_rate, sigma=1.0, feedback=0.05)
    inside, outside = data["included"], ~data["included"]
    drifted = float(data["sums"][inside].mean() - data["sums"][outside].mean()) / 40 / sample_rate
    assert drifted < 0.9  # comparing whole-run means would fail this correct mechanism
    signal, noise = checks(data, steps=40, sample_rate=sample_rate, sigma=1.0)
    assert signal.passed and noise.passed, (signal.line(), noise.line())


def test_a_signal_scaled_by_the_realised_batch_fails_both_checks() -> None:
    signal, noise = checks(readings(signal=64 / 564, noise=64 / 564))
    assert not signal.passed and signal.high < 0.5 and "FAILED" in signal.line()
    assert not noise.passed


def test_an_unclipped_canary_fails_the_signal_check_in_full_batches_too() -> None:
    data = readings(signal=10.0, sample_rate=1.0)
    assert not first_step_signal(data["first"], data["included"], sample_rate=1.0).passed
    assert not checks(readings(signal=10.0))[0].passed


def test_half_the_noise_fails_the_noise_check() -> None:
    data = readings(noise=0.5)
    check = noise_check(data["sums"], data["squares"], data["included"], steps=20, noise_multiplier=2.0)
    assert not check.passed and 0.45 < check.measured < 0.55


def test_without_noise_draws_or_enough_canaries_fewer_checks_run() -> None:
    data = readings()
    assert len(checks(data, sigma=0.0)) == 1  # no noise claimed: the signal only
    assert len(checks(data, steps=1)) == 1  # one step: no noise spread to read
    unknown = {**data, "contrast_steps": 0}  # not rank 0: the draws are unknown
    assert "first step" in checks(unknown)[0].name
    one_out = {**data, "included": torch.ones_like(data["included"]).index_fill_(0, torch.tensor([0]), False)}
    assert checks(one_out) == []  # a single excluded canary has no spread: no check rather than NaN


def test_strong_pushback_in_a_short_run_does_not_fail_the_sampled_contrast() -> None:
    """The case a review found: q = 0.5, T = 20, the data pulling a weight back by half its displacement each step."""
    failures = 0
    for seed in range(20):
        data = readings(canaries=500, steps=20, sample_rate=0.5, sigma=0.5, feedback=0.5, seed=seed)
        failures += not checks(data, sample_rate=0.5, sigma=0.5)[0].passed
    assert failures == 0


def test_few_canaries_widen_the_interval_and_exact_readings_keep_a_rounding_margin() -> None:
    generator = torch.Generator().manual_seed(3)
    few_in, many_in = torch.arange(6) < 3, torch.arange(6000) < 3000
    few = first_step_signal(torch.randn(6, generator=generator, dtype=torch.float64) + few_in, few_in, sample_rate=1.0)
    many = first_step_signal(torch.randn(6000, generator=generator, dtype=torch.float64) + many_in, many_in,
                             sample_rate=1.0)  # fmt: skip
    normal_ratio = (1 / 3) ** 0.5 / (1 / 3000) ** 0.5  # what the widths' ratio would be with normal quantiles, ≈ 32
    assert (few.high - few.low) / (many.high - many.low) > 3 * normal_ratio  # t with ~4 d.o.f. at 10⁻⁴ is far wider
    exact = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64) * (1 - 1e-7)  # float32 rounding of C, no noise
    check = first_step_signal(exact, exact > 0.5, sample_rate=1.0)
    assert check.passed and check.high - check.low == pytest.approx(2 * ROUNDING)
