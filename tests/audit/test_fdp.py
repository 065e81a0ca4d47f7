"""The one-run f-DP bound (μ̂ of Gaussian DP, read as ε̂ at δ), its guess plan, and its soundness by simulation."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution
from scipy import integrate, stats

from dplit.audit.bound import binomial_pmf, correct_guesses, epsilon_lower_bound
from dplit.audit.fdp import (
    dpsgd_mu,
    gdp_bound,
    gdp_delta,
    gdp_epsilon,
    gdp_least_probability,
    mu_lower_bound,
    refutes,
)  # fmt: skip
from dplit.audit.simulation import plan_counts, plan_guesses, simulate_white_box


def mu_hat(canaries: int, guesses: int, correct: int, level: float = 0.05) -> float:
    return float(mu_lower_bound(canaries=canaries, guesses=np.array(guesses), correct=np.array(correct), level=level))


# the bound


def test_one_guess_on_one_canary_refutes_exactly_the_mu_whose_best_accuracy_is_below_the_level() -> None:
    """One right guess on one canary refutes exactly the μ with Φ(μ/2) < τ.

    μ-GDP lets a single guess be right with probability at most Φ(μ/2): μ̂ = 2Φ⁻¹(τ), approached from below.
    """
    for level in (0.7, 0.9, 0.99):
        exact = 2 * stats.norm.ppf(level)
        got = mu_hat(1, 1, 1, level)
        assert exact - 1e-3 < got <= exact


def test_refuted_mu_form_an_interval_from_zero() -> None:
    mus = np.linspace(0, 3, 61)
    refuted = refutes(
        functools.partial(gdp_least_probability, mu=mus), canaries=1000, level=0.05,
        guesses=np.full(mus.shape, 200), correct=np.full(mus.shape, 180),
    )  # fmt: skip
    assert refuted[0] and not refuted[-1]
    assert (np.diff(refuted.astype(int)) <= 0).all()  # once consistent, consistent for every larger μ


def test_mu_hat_grows_with_right_guesses_and_with_confidence_spent() -> None:
    bounds = [mu_hat(1000, 200, v) for v in (110, 130, 150, 170, 200)]
    assert bounds == sorted(bounds) and bounds[0] < bounds[-1]
    assert mu_hat(1000, 200, 100) == 0.0  # half right refutes nothing
    assert mu_hat(1000, 200, 150, level=0.01) < mu_hat(1000, 200, 150, level=0.05)
    assert mu_hat(1000, 1000, 1000) > mu_hat(1000, 200, 200)  # more right guesses, more evidence


def test_a_lane_array_gives_the_same_bounds_as_one_lane_at_a_time() -> None:
    guesses, correct = np.array([50, 200, 1000, 10]), np.array([40, 170, 600, 10])
    together = mu_lower_bound(canaries=1000, guesses=guesses, correct=correct, level=0.05)
    alone = [mu_hat(1000, int(r), int(v)) for r, v in zip(guesses, correct, strict=True)]
    assert together.tolist() == alone


def test_the_search_settling_refuted_lanes_early_agrees_with_the_whole_walk() -> None:
    """mu_lower_bound's walk (only the walking lanes, refuted ones leaving early) decides as refutes' whole walk."""
    from dplit.audit.fdp import _gdp_lanes, _walk

    mus = np.linspace(0, 4, 33)  # [G]
    guesses = np.broadcast_to(np.array([1, 7, 60, 200])[:, None], (4, mus.size))  # [4, G]
    correct = np.broadcast_to(np.array([1, 5, 41, 150])[:, None], guesses.shape)  # [4, G]
    lane_mus = np.broadcast_to(mus, guesses.shape)
    whole = refutes(functools.partial(gdp_least_probability, mu=lane_mus), canaries=300, level=0.05, guesses=guesses,
                    correct=correct)  # fmt: skip
    settled = _walk(_gdp_lanes(lane_mus.reshape(-1)), canaries=300, guesses=guesses.reshape(-1),
                    correct=correct.reshape(-1), level=0.05, settle=True)  # fmt: skip
    assert whole.any() and not whole.all() and np.array_equal(settled.reshape(whole.shape), whole)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_gdp_privacy_profile_matches_numerical_integration_of_the_privacy_loss(mu: float) -> None:
    """δ(ε) = E_P[(1 − e^{ε − L})₊] with L = μX − μ²/2, X ~ N(μ, 1): integrated numerically, not from the formula."""
    for epsilon in (0.1, 1.0, 3.0):

        def integrand(x: float, epsilon: float = epsilon) -> float:
            return stats.norm.pdf(x, loc=mu) * max(0.0, 1 - math.exp(epsilon - (mu * x - mu**2 / 2)))

        integral, _ = integrate.quad(integrand, (epsilon + mu**2 / 2) / mu, math.inf, epsabs=1e-13)
        assert gdp_delta(epsilon, mu) == pytest.approx(integral, rel=1e-6, abs=1e-14)


@pytest.mark.parametrize(("sigma", "steps", "delta"), [(4.0, 20, 1e-5), (1.0, 1, 1e-6), (10.0, 100, 1e-7)])
def test_full_batch_dpsgd_epsilon_matches_the_pld_accountant(sigma: float, steps: int, delta: float) -> None:
    """T full-batch Gaussian steps are exactly √T/σ-GDP: its ε at δ equals dp-accounting's PLD of one Gaussian."""
    mu = dpsgd_mu(noise_multiplier=sigma, sample_rate=1.0, steps=steps)
    assert mu == pytest.approx(math.sqrt(steps) / sigma)
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma / math.sqrt(steps), sensitivity=1.0, value_discretization_interval=1e-4
    )
    assert gdp_epsilon(mu, delta) == pytest.approx(pld.get_epsilon_for_delta(delta), abs=2e-3)
    assert gdp_delta(gdp_epsilon(mu, delta), mu) >= delta  # ε̂ read from below: never overstated


def test_poisson_dpsgd_mu_is_the_central_limit_approximation_and_none_without_noise() -> None:
    assert dpsgd_mu(noise_multiplier=1.0, sample_rate=0.05, steps=60) == pytest.approx(
        0.05 * math.sqrt(60 * (math.e - 1))
    )
    assert dpsgd_mu(noise_multiplier=0.0, sample_rate=1.0, steps=5) == math.inf


# the plan and the score


def test_the_plan_is_reproducible_and_its_ceiling_is_all_guesses_right() -> None:
    kwargs = {"canaries": 400, "noise_multiplier": 2.0, "sample_rate": 1.0, "steps": 16, "delta": 1e-6,
              "confidence": 0.95, "seed": 3, "simulations": 4}  # fmt: skip
    plan = plan_guesses(**kwargs)
    assert plan == plan_guesses(**kwargs)
    assert plan.k_plus in plan_counts(400) and plan.k_minus in plan_counts(400)
    guesses = plan.k_plus + plan.k_minus
    assert plan.ceiling_mu == mu_hat(400, guesses, guesses)
    assert 0 < plan.expected_mu <= plan.ceiling_mu and plan.expected_epsilon == gdp_epsilon(plan.expected_mu, 1e-6)


def test_a_cached_plan_is_the_plan_computed_afresh_and_cannot_be_changed_by_a_caller() -> None:
    kwargs = {"canaries": 200, "noise_multiplier": 1.5, "sample_rate": 1.0, "steps": 4, "delta": 1e-5,
              "confidence": 0.9, "simulations": 3}  # fmt: skip
    plan = plan_guesses(**kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.k_plus = 0  # type: ignore[misc]
    assert plan_guesses(**kwargs) is plan  # the second audit of the same claim reuses it
    plan_guesses.cache_clear()
    assert plan_guesses(**kwargs) == plan


def test_a_pmf_is_a_new_tensor_each_call() -> None:
    """binomial_pmf caches its binomial coefficients: a caller writing to a pmf changes no later one."""
    first = binomial_pmf(50, 0.3)
    expected = first.clone()
    first.mul_(0)
    assert torch.equal(binomial_pmf(50, 0.3), expected)
    assert float(expected.sum()) == pytest.approx(1.0)


def test_without_noise_the_plan_shows_nearly_the_most_m_canaries_can_show() -> None:
    """Full batches, σ = 0: every included canary is seen at every step, so all m guesses can be right."""
    plan = plan_guesses(canaries=1000, noise_multiplier=0.0, sample_rate=1.0, steps=5, delta=1e-7, confidence=0.95,
                        seed=0, simulations=2)  # fmt: skip
    most = gdp_epsilon(mu_hat(1000, 1000, 1000), 1e-7)
    assert plan.expected_epsilon >= 0.9 * most


def test_without_noise_under_poisson_sampling_the_plan_keeps_a_margin_for_runs_that_include_fewer() -> None:
    """The quickstart's noise-off audit (q = 0.05, 60 steps, σ = 0): 4.6% of included canaries are never sampled.

    Guessing at the number a typical run samples (the median's choice) loses a third of ε̂ in the runs that sample a
    few fewer; the plan must show nearly its ceiling in every run, not only in the typical one.
    """
    plan = plan_guesses(canaries=1000, noise_multiplier=0.0, sample_rate=0.05, steps=60, delta=1e-7, confidence=0.95)
    generator = torch.Generator().manual_seed(7)
    shown = []
    for _ in range(20):
        scores, included = simulate_white_box(
            canaries=1000, noise_multiplier=0.0, sample_rate=0.05, steps=60, generator=generator
        )
        bound = gdp_bound(scores, included, k_plus=plan.k_plus, k_minus=plan.k_minus, delta=1e-7, confidence=0.95)
        shown.append(bound.epsilon)
    assert min(shown) >= 0.95 * plan.ceiling_epsilon, (plan, shown)
    assert plan.ceiling_epsilon >= 0.9 * gdp_epsilon(mu_hat(1000, 500, 500), 1e-7)


def test_the_white_box_score_is_the_log_likelihood_ratio_of_the_gaussian_mixture() -> None:
    from dplit.audit.canaries import white_box_step_score

    x = torch.linspace(-3, 4, 15, dtype=torch.float64)
    for q, sigma in ((0.05, 1.3), (0.5, 0.7), (1.0, 2.0)):
        score = white_box_step_score(x, noise_multiplier=sigma, sample_rate=q)
        inside = np.log((1 - q) * stats.norm.pdf(x.numpy(), 0, sigma) + q * stats.norm.pdf(x.numpy(), 1, sigma))
        expected = inside - stats.norm.logpdf(x.numpy(), 0, sigma)
        assert np.allclose(score.numpy(), expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(white_box_step_score(x, noise_multiplier=0.0, sample_rate=0.1), x)


def test_without_noise_a_sampled_canary_outranks_an_excluded_one_whose_coordinate_the_data_push_around() -> None:
    """σ = 0, q < 1: each coordinate's readings are scored at their own robust level and spread, not summed."""
    from dplit.audit.canaries import GradientCanaries

    generator = torch.Generator().manual_seed(3)
    steps = 60
    sampled_at = torch.tensor([[5, 6, 40], [30, -1, -1], [-1, -1, -1], [12, -1, -1], [-1, -1, -1]])  # [5, ≤ 3]
    data = 0.3 * torch.randn(steps, generator=generator, dtype=torch.float64)  # [T]: the examples' gradients there
    pushed = data.clone()
    pushed[[15, 16]] += 0.75  # the data push this coordinate up by 3/4 of one C, twice
    drift = torch.stack([torch.zeros(steps), torch.zeros(steps), torch.zeros(steps), data, pushed]).double()  # [5, T]
    canaries = GradientCanaries(coordinates=torch.arange(5), included=torch.tensor([True, True, False, True, False]),
                                norm=1.0)  # fmt: skip
    for step in range(steps):
        reading = drift[:, step] + (sampled_at == step).any(dim=1).double()  # [5]
        canaries.observe(reading, clip_bound=1.0, noise_multiplier=0.0, sample_rate=0.05)
    scores = canaries.scores
    assert scores[0] > scores[1] > scores[2]  # no data at the coordinate: by the number of inclusions
    assert scores[3] > scores[4]  # sampled once beats pushed twice by the data
    assert canaries.reading_sums[4] > canaries.reading_sums[3]  # the plain sum ranks the excluded one higher
    assert torch.equal(scores, canaries.scores)  # reading the scores changes nothing


def test_without_noise_canaries_sampled_in_most_steps_keep_their_rank() -> None:
    """A level read from the smallest readings: a canary in most steps never ties with an excluded one."""
    from dplit.audit.canaries import noiseless_scores

    inclusions = torch.zeros(20, 3, dtype=torch.float64)  # [T, 3]: in 11 of 20 steps (the median is 1), in 1, out
    inclusions[:11, 0], inclusions[4, 1] = 1, 1
    scores = noiseless_scores(inclusions, sample_rate=0.3)
    assert scores[0] > scores[1] > scores[2]
    short = noiseless_scores(inclusions[:5], sample_rate=0.6)  # too few steps for a level: the plain sum
    assert torch.equal(short, inclusions[:5].sum(dim=0))


# soundness: the exact Gaussian mechanism, simulated


def false_positives(true_mu: float, trials: int = 200) -> tuple[int, int]:
    """How often each analysis at 95% overstates ``trials`` exact Gaussian mechanisms of ``true_mu``.

    m = 1000, full batches: μ̂ > μ (f-DP) and ε̂ > ε(μ) at δ = 1e-5 ((ε, δ), with one pair fixed in advance, the
    case the grid's Bonferroni only makes more conservative).
    """
    canaries, steps, delta = 1000, 10, 1e-5
    sigma = math.sqrt(steps) / true_mu
    plan = plan_guesses(canaries=canaries, noise_multiplier=sigma, sample_rate=1.0, steps=steps, delta=delta,
                        confidence=0.95, seed=12345, simulations=4)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    true_epsilon = gdp_epsilon(true_mu, delta)
    fdp = eps_delta = 0
    for _ in range(trials):
        scores, included = simulate_white_box(
            canaries=canaries, noise_multiplier=sigma, sample_rate=1.0, steps=steps, generator=generator
        )
        bound = gdp_bound(scores, included, k_plus=plan.k_plus, k_minus=plan.k_minus, delta=delta, confidence=0.95)
        fdp += bound.mu > true_mu
        right = correct_guesses(scores, included, k_plus=plan.k_plus, k_minus=plan.k_minus)
        eps_delta += epsilon_lower_bound(canaries=canaries, guesses=plan.k_plus + plan.k_minus, correct=right,
                                         delta=delta, confidence=0.95) > true_epsilon  # fmt: skip
    return fdp, eps_delta


@pytest.mark.slow
def test_both_bounds_overstate_an_exact_gaussian_mechanism_at_most_five_percent_of_the_time() -> None:
    fdp, eps_delta = false_positives(1.0)
    assert fdp <= 10 and eps_delta <= 10, (fdp, eps_delta)


def test_the_soundness_check_can_fail_it_sees_an_understated_truth() -> None:
    """The same count against a truth stated at a quarter of the real μ: nearly every trial overstates it."""
    canaries, steps = 1000, 10
    sigma = math.sqrt(steps) / 2.0
    generator = torch.Generator().manual_seed(1)
    over = 0
    for _ in range(10):
        scores, included = simulate_white_box(
            canaries=canaries, noise_multiplier=sigma, sample_rate=1.0, steps=steps, generator=generator
        )
        over += gdp_bound(scores, included, k_plus=100, k_minus=100, delta=1e-5, confidence=0.95).mu > 0.5
    assert over >= 9
