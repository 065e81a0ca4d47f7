"""``dplit audit``: the one-run ε lower bound, its canaries, and that it catches deliberately broken DP mechanisms.

The runs use the quickstart model in the regime where a one-run audit has most power: full batches (q = 1, 64
synthetic rows, :data:`STEPS` steps), δ = 1e-7, fixed noise and auditor seeds. The broken mechanisms are in
``tests/helpers/audit_mechanisms.py`` and reach the audit through ``--trainer.strategy.class_path``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dplit.audit.bound import audit_bound, binomial_pmf, epsilon_lower_bound, guess_counts, p_value
from dplit.audit.canaries import GradientCanaries, InputCanaries
from dplit.audit.command import AUDIT_FILE, verdict
from dplit.cli.audit import audit_main
from dplit.privacy.warnings import PrivacyWarning
from tests.helpers.commands import CONFIGS, TINY_LLAMA, lm_args
from tests.helpers.executable import dplit_executable, run_dplit_in_process, user_environment
from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY


STEPS = 5
"""Full-batch steps of an audit run. In full batches every statistic the audit draws on depends on the steps only
through μ = √T/σ (a canary's score is affine in the sum of its T readings: mean T, std √T·σ), and the accountant
fixes μ from the claimed ε (T full-batch Gaussian steps are exactly √T/σ-GDP), so T = 5 gives the f-DP and (ε, δ)
bounds the power of T = 20 at a quarter of the training. The first-step signal check only gains (σ halves); the
noise check keeps (T − 1)·(canaries out) ≥ 1,900 degrees of freedom, where a halved σ reads 0.5 against an interval
within ±7% of it."""


def full_batch_args(tmp_path: Path, *extra: str) -> list[str]:
    """The quickstart model on 64 synthetic rows, every row in every one of :data:`STEPS` steps, δ = 1e-7, seeds fixed."""
    return [
        "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0", "--trainer.max_epochs", str(STEPS),
        "--data.synthetic_train_size", "64", "--data.synthetic_val_size", "20", "--data.batch_size", "64",
        "--trainer.strategy.init_args.target_delta", "1e-7", "--trainer.strategy.init_args.seed", "0",
        "--audit.seed", "0", *extra,
    ]  # fmt: skip


def epsilon(value: float) -> list[str]:
    return ["--trainer.strategy.init_args.target_epsilon", str(value)]


NO_NOISE = ["--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "0"]


def broken(name: str) -> list[str]:
    return ["--trainer.strategy.class_path", f"tests.helpers.audit_mechanisms.{name}"]


# the bound


def exact_tail(trials: int, probability: Fraction, at_least: int) -> Fraction:
    return sum(
        (
            math.comb(trials, k) * probability**k * (1 - probability) ** (trials - k)
            for k in range(at_least, trials + 1)
        ),
        Fraction(0),
    )


def test_binomial_pmf_matches_the_exact_formula() -> None:
    pmf = binomial_pmf(12, 0.3)
    exact = [math.comb(12, k) * 0.3**k * 0.7 ** (12 - k) for k in range(13)]
    assert torch.allclose(pmf, torch.tensor(exact, dtype=torch.float64), rtol=1e-12, atol=0)
    assert binomial_pmf(5, 1.0).tolist() == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize(("guesses", "correct", "eps"), [(10, 8, 0.5), (20, 20, 2.0), (15, 3, 0.0), (30, 25, 1.3)])
def test_pure_dp_p_value_is_the_binomial_tail(guesses: int, correct: int, eps: float) -> None:
    accuracy = Fraction(1) / (1 + Fraction(math.exp(-eps)))
    expected = float(exact_tail(guesses, accuracy, correct))
    got = p_value(canaries=100, guesses=guesses, correct=correct, epsilon=eps, delta=0.0)
    assert got == pytest.approx(min(expected, 1.0), rel=1e-10)


def test_approximate_dp_p_value_adds_the_papers_delta_term() -> None:
    m, r, v, eps, delta = 200, 12, 10, 0.7, 1e-4
    accuracy = Fraction(1) / (1 + Fraction(math.exp(-eps)))
    pmf = [math.comb(r, k) * accuracy**k * (1 - accuracy) ** (r - k) for k in range(r + 1)]
    alpha = max(sum(pmf[v - j] for j in range(1, i + 1)) / i for i in range(1, v + 1))  # max_i P[v-i ≤ B < v] / i
    expected = exact_tail(r, accuracy, v) + alpha * Fraction(delta) * 2 * m
    assert p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=delta) == pytest.approx(
        float(expected), rel=1e-10
    )


@pytest.mark.parametrize("guesses", [100, 1000])
def test_all_guesses_correct_gives_the_papers_closed_form(guesses: int) -> None:
    p = 0.05 ** (1 / guesses)  # 95% confidence: ε̂ = ln(p / (1 − p))
    bound = epsilon_lower_bound(canaries=guesses, guesses=guesses, correct=guesses, delta=0.0, confidence=0.95)
    assert bound == pytest.approx(math.log(p / (1 - p)), abs=2e-5)
    assert bound <= math.log(p / (1 - p))  # never overstated


def test_the_bound_grows_with_correct_guesses_and_shrinks_with_delta_and_confidence() -> None:
    bounds = [
        epsilon_lower_bound(canaries=1000, guesses=200, correct=v, delta=1e-6, confidence=0.95)
        for v in (110, 130, 150, 170)
    ]
    assert bounds[0] < bounds[1] < bounds[2] < bounds[3]
    assert epsilon_lower_bound(canaries=1000, guesses=200, correct=100, delta=0.0, confidence=0.95) == 0.0
    loose = epsilon_lower_bound(canaries=1000, guesses=200, correct=150, delta=1e-4, confidence=0.95)
    sure = epsilon_lower_bound(canaries=1000, guesses=200, correct=150, delta=1e-6, confidence=0.99)
    assert loose < bounds[2] and sure < bounds[2]


def test_guesses_are_chosen_from_a_grid_fixed_in_advance_with_bonferroni() -> None:
    assert guess_counts(1000) == [0, 10, 20, 50, 100, 200, 500]
    included = torch.arange(1000) % 2 == 0
    separated = audit_bound(included.double(), included, delta=0.0, confidence=0.95)
    assert separated.choices == 48 and separated.correct == separated.k_plus + separated.k_minus == 1000
    bonferroni = epsilon_lower_bound(canaries=1000, guesses=1000, correct=1000, delta=0.0, confidence=1 - 0.05 / 48)
    assert separated.epsilon == pytest.approx(bonferroni)
    shuffled = audit_bound(
        torch.randn(1000, generator=torch.Generator().manual_seed(0)), included, delta=0.0, confidence=0.95
    )
    assert shuffled.epsilon < 0.3


# the canaries


def test_gradient_canaries_are_distinct_coordinates_added_with_norm_c_when_sampled() -> None:
    canaries = GradientCanaries.place(50, size=60, norm=0.5, generator=torch.Generator().manual_seed(1))
    assert canaries.coordinates.unique().numel() == 50 and 0 < int(canaries.included.sum()) < 50
    total = torch.zeros(60, dtype=torch.float64)
    sampled = canaries.add_sampled(total, sample_rate=1.0, generator=torch.Generator().manual_seed(2))
    assert sampled == int(canaries.included.sum()) and total.sum() == pytest.approx(0.5 * sampled)
    assert torch.equal(total[canaries.coordinates] > 0, canaries.included)
    canaries.observe(total, clip_bound=0.5, noise_multiplier=0.0, sample_rate=1.0)  # readings in units of C
    assert torch.equal(canaries.scores, canaries.included.double()) and canaries.steps == 1
    assert torch.equal(canaries.reading_sums, canaries.included.double())
    assert torch.equal(canaries.reading_squares, canaries.included.double())
    none = canaries.add_sampled(torch.zeros(60), sample_rate=0.0, generator=torch.Generator().manual_seed(3))
    assert none == 0
    with pytest.raises(ValueError, match="audit.canaries=61 exceeds the 60 trainable coordinates"):
        GradientCanaries.place(61, size=60, norm=1.0, generator=torch.Generator())


def test_input_canaries_are_random_tokens_and_only_included_ones_are_trained() -> None:
    canaries = InputCanaries.for_classifier(
        40, vocab_size=9, num_classes=3, length=5, generator=torch.Generator().manual_seed(0)
    )
    trained = canaries.training_set()
    assert len(trained) == int(canaries.included.sum()) and 0 < len(trained) < 40  # type: ignore[arg-type]
    assert all(len(row["input_ids"]) == 5 and 0 <= row["label"] < 3 for row in trained)  # type: ignore[attr-defined]
    lm = InputCanaries.for_language_model(4, vocab_size=9, length=3, generator=torch.Generator().manual_seed(0))
    assert lm.training_set()[0]["loss_mask"] == [1, 1, 1]


# the audit run


def read_report(tmp_path: Path) -> dict:
    [path] = tmp_path.rglob(AUDIT_FILE)
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("claimed", [1.0, 4.0])
def test_correct_dp_is_not_refuted(claimed: float, tmp_path: Path) -> None:
    """Through ``dplit audit``'s own entry point (in this process): it passes, exits 0 and prints its verdict.

    20 steps here, not :data:`STEPS`: ε̂ > 0 at ε = 1 depends on the plan's guesses, which its simulations (seeded,
    their draws depending on T) choose. Simulated with the audit's own code over 300 seeds, the T = 20 plan shows
    ε̂ = 0 in 13% of correct runs, the T = 5 plan in 22%: kept at the stronger one.
    """
    args = full_batch_args(tmp_path, *epsilon(claimed), "--trainer.max_epochs", "20")
    result = run_dplit_in_process("audit", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_report(tmp_path)
    line = (f"empirical ε ≥ {report['epsilon_lower_bound']:.3f} at 95% confidence (fdp; claimed ε = "
            f"{report['claimed_epsilon']:.3f};")  # fmt: skip
    assert line in result.stdout + result.stderr
    assert report["claimed_epsilon"] == pytest.approx(claimed, rel=0.01) and report["steps"] == 20
    assert 0 < report["epsilon_lower_bound"] <= report["claimed_epsilon"] and not report["violation"]
    assert report["sample_rate"] == 1.0 and report["mode"] == "white_box" and report["canaries"] == 1000
    assert report["eps_delta"]["epsilon"] <= report["fdp"]["epsilon"] == report["epsilon_lower_bound"]
    assert report["fdp"]["mu"] <= report["claimed_mu"] and report["claimed_mu_is"] == "exact (√T/σ)"
    assert 0 < report["plan"]["expected_epsilon"] < report["plan"]["ceiling_epsilon"]
    assert [check["passed"] for check in report["checks"]] == [True, True]
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent)).Reload()
    [logged] = events.Scalars("audit/epsilon_lower_bound")
    assert logged.value == pytest.approx(report["epsilon_lower_bound"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:PRIVACY AUDIT FAILED")  # expected: the mechanism is broken on purpose
@pytest.mark.filterwarnings("ignore:DPStrategy.noise_multiplier=0")
@pytest.mark.parametrize(
    ("name", "extra"), [("no noise", NO_NOISE), ("no clipping", [*broken("NoClipping"), *epsilon(1.0)])]
)
def test_noise_or_clipping_off_is_caught(name: str, extra: list[str], tmp_path: Path) -> None:
    try:
        report = audit_main(full_batch_args(tmp_path, *extra), lm=False)
    except SystemExit as stop:  # a violation of the claimed ε
        assert stop.code == 3
        report = read_report(tmp_path)
    assert report["epsilon_lower_bound"] >= 3.0, name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:DPStrategy.noise_multiplier=0")
def test_without_noise_in_poisson_batches_the_audit_shows_what_its_guesses_can_show(tmp_path: Path) -> None:
    """The quickstart's sampling (q = 0.05, 60 steps) on 400 rows, m = 1000: every planned guess right.

    About 4.6% of the included canaries are never sampled; the plan (k₊ = 400 of about 477 sampled) leaves a margin
    for runs that include fewer, and the score reads past the real examples' gradients at the canary coordinates.
    """
    args = [*full_batch_args(tmp_path, *NO_NOISE), "--data.synthetic_train_size", "400", "--data.batch_size", "20",
            "--trainer.max_epochs", "3", "--audit.canaries", "1000"]  # fmt: skip
    report = audit_main(args, lm=False)
    assert report["sample_rate"] == pytest.approx(0.05) and report["steps"] == 60
    assert report["fdp"]["correct"] == report["fdp"]["k_plus"] + report["fdp"]["k_minus"] > 0, report["fdp"]
    assert report["fdp"]["epsilon"] >= 0.95 * report["plan"]["ceiling_epsilon"]


@pytest.mark.slow
def test_half_the_noise_is_caught_by_the_fdp_bound_with_ten_thousand_canaries(tmp_path: Path) -> None:
    """Ten thousand canaries at claimed ε = 1 (μ = 0.211), :data:`STEPS` full-batch steps.

    The audit's own simulation and bound over 300 seeds (the noise × 0.5 or × 1 at the claimed σ): at T = 5 its plan
    (k₊ = k₋ = 500) catches halved noise in 298 of 300 runs (μ̂ 0.279 ± 0.023, z = 2.9 above the claimed μ) and
    refutes a correct run in none (μ̂ 0.121 ± 0.024, z = −3.7); at T = 20 its plan (100, 200) caught 285 of 300
    (μ̂ 0.279 ± 0.039, z = 1.7) and refuted one (z = −2.6). Fewer steps cost nothing here: T = 5's choice of guesses
    is the better one. The runs' seeds are fixed, so the outcome is reproducible either way.
    """
    honest = audit_main(full_batch_args(tmp_path / "honest", "--audit.canaries", "10000", *epsilon(1.0)), lm=False)
    with pytest.raises(SystemExit), pytest.warns(PrivacyWarning, match="PRIVACY AUDIT FAILED"):
        audit_main(
            full_batch_args(tmp_path / "half", "--audit.canaries", "10000", *broken("HalfNoise"), *epsilon(1.0)),
            lm=False,
        )
    half = read_report(tmp_path / "half")
    assert honest["epsilon_lower_bound"] < half["claimed_epsilon"] < half["epsilon_lower_bound"] and half["violation"]
    assert half["analysis"] == "fdp" and half["fdp"]["epsilon"] == half["epsilon_lower_bound"]
    assert [check["passed"] for check in half["checks"]] == [True, False]  # the signal is right, the noise is half
    assert [check["passed"] for check in honest["checks"]] == [True, True]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:PRIVACY AUDIT FAILED")
def test_dividing_by_the_realised_batch_size_fails_the_signal_check(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        audit_main(full_batch_args(tmp_path, *broken("RealisedBatchDivisor"), *epsilon(4.0)), lm=False)
    report = read_report(tmp_path)
    signal, noise = report["checks"]  # the whole released sum shrinks by 64 / (64 + canaries sampled)
    assert stop.value.code == 3 and not report["violation"] and not signal["passed"] and not noise["passed"]


def test_a_delta_too_large_for_any_bound_is_warned_about(tmp_path: Path) -> None:
    args = full_batch_args(tmp_path, "--trainer.strategy.init_args.target_delta", "null", "--trainer.max_epochs", "1")
    with pytest.warns(UserWarning, match=r"2·m·δ = .* so the bound will be 0"):  # δ = 64^-1.1, 2·m·δ ≈ 2.1
        report = audit_main([*args, "--audit.canaries", "100", "--audit.analysis", "eps_delta"], lm=False)
    assert report["epsilon_lower_bound"] == 0.0 and report["delta"] == pytest.approx(64**-1.1)


@pytest.mark.slow
def test_black_box_canaries_join_the_training_rows(tmp_path: Path) -> None:
    report = audit_main(full_batch_args(tmp_path, "--audit.mode", "black_box", "--audit.canaries", "100"), lm=False)
    assert report["mode"] == "black_box" and report["dataset_size"] == 64 + report["canaries_included"]
    assert 0 < report["canaries_included"] < 100 and report["epsilon_lower_bound"] <= report["claimed_epsilon"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["white_box", "black_box"])
def test_lm_audit_on_a_tiny_llama(mode: str, tmp_path: Path) -> None:
    args = lm_args(
        tmp_path, "--model.config", TINY_LLAMA, "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0"
    )
    report = audit_main([*args, "--audit.mode", mode, "--audit.canaries", "200", "--audit.seed", "0"], lm=True)
    rows = 200 + (report["canaries_included"] if mode == "black_box" else 0)
    assert report["dataset_size"] == rows and report["steps"] == math.ceil(rows / 20) and report["mode"] == mode
    assert report["claimed_epsilon"] <= 8.0
    assert report["epsilon_lower_bound"] <= report["claimed_epsilon"]


@pytest.mark.slow
def test_the_executable_prints_the_verdict_and_catches_a_canary_whose_clipping_is_skipped_loudly(
    tmp_path: Path,
) -> None:
    """The real ``dplit`` executable on a broken mechanism: its verdict, one loud warning, exit 3, no traceback.

    (A correct run's exit 0 and verdict line: test_correct_dp_is_not_refuted, through the same entry point.)
    """
    environment = {**user_environment(), "PYTHONPATH": str(ROOT)}
    bug = subprocess.run(
        [dplit_executable(), "audit", *full_batch_args(tmp_path, *broken("UnclippedCanaries"), *epsilon(1.0))],
        capture_output=True, text=True, timeout=600, check=False, env=environment,
    )  # fmt: skip
    warnings = [line for line in bug.stderr.splitlines() if line.startswith("dplit: WARNING: PRIVACY AUDIT FAILED")]
    assert bug.returncode == 3 and len(warnings) == 1 and "Traceback" not in bug.stderr, bug.stderr[-3000:]
    report = read_report(tmp_path)
    assert report["violation"] and report["epsilon_lower_bound"] > 2 * report["claimed_epsilon"]
    line = (f"empirical ε ≥ {report['epsilon_lower_bound']:.3f} at 95% confidence (fdp; claimed ε = "
            f"{report['claimed_epsilon']:.3f};")  # fmt: skip
    assert line in bug.stdout + bug.stderr


@pytest.mark.slow
def test_a_normal_run_runs_no_audit_code(tmp_path: Path) -> None:
    script = (
        "import sys\nfrom dplit.cli.lightning_cli import run_cli\nfrom tests.helpers.commands import quickstart_args, steps\n"
        f"cli = run_cli(['fit', *quickstart_args(__import__('pathlib').Path({str(tmp_path)!r}), *steps(1))])\n"
        "assert type(cli.trainer.strategy).__name__ == 'DPStrategy', type(cli.trainer.strategy)\n"
        "assert not [name for name in sys.modules if name.startswith('dplit.audit')], 'audit code imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
        env=user_environment(),
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_the_audit_benchmark_runs_and_tabulates(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.audit", "--smoke", "--output", str(tmp_path)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False, env=user_environment()
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["mode"] for row in results["runs"]] == ["white_box", "black_box"]
    assert all("report" in row for row in results["runs"]), results["runs"]
    reports = [row["report"] for row in results["runs"]]
    assert all(report["canaries"] == 100 for report in reports) and reports[0]["sample_rate"] == 1.0
    assert reports[1]["dataset_size"] == 64 + reports[1]["canaries_included"]
    table = (tmp_path / "table.md").read_text()
    white, black = reports
    row = (f"| {white['claimed_epsilon']:.2f} | {white['fdp']['epsilon']:.2f} | {white['eps_delta']['epsilon']:.2f} | "
           f"{white['plan']['expected_epsilon']:.2f} | {white['plan']['ceiling_epsilon']:.2f} | "
           f"{black['fdp']['epsilon']:.2f} | {black['eps_delta']['epsilon']:.2f} |")  # fmt: skip
    assert row in table


QUANTILE = ["--trainer.strategy.init_args.clip_mode", "quantile", "--trainer.strategy.init_args.clip_learning_rate",
            "0.2"]  # fmt: skip


@pytest.mark.slow
def test_an_audit_of_quantile_clipping_sees_canaries_at_each_steps_bound(tmp_path: Path) -> None:
    """Canaries of norm C_t, in the noisy count; read in units of C_t with σ_eff: a correct run passes everything."""
    report = audit_main(full_batch_args(tmp_path, *QUANTILE, *epsilon(4.0)), lm=False)
    assert report == read_report(tmp_path)  # what audit_main returns is what it wrote
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    assert ledger["clip_mode"] == "quantile" and ledger["clip_bound"] != 1.0  # C_t moved
    assert not report["violation"] and [check["passed"] for check in report["checks"]] == [True, True]
    assert report["noise_multiplier"] < ledger["gradient_noise_multiplier"]  # the audit read σ_eff, not σ


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:PRIVACY AUDIT FAILED")
def test_half_the_noise_under_quantile_clipping_is_caught(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        audit_main(full_batch_args(tmp_path, *QUANTILE, *broken("HalfNoise"), *epsilon(4.0)), lm=False)
    report = read_report(tmp_path)
    assert stop.value.code == 3 and not report["checks"][1]["passed"]  # the noise is half of σ_eff·C_t


@pytest.mark.slow
def test_an_audit_of_user_level_dp_samples_its_canaries_as_users(tmp_path: Path) -> None:
    """Each canary is one more user: sampled at the users' rate q = batch / users, a Dirac of norm C when included."""
    users = ["--data.synthetic_train_size", "200", "--data.batch_size", "10", "--data.privacy_unit", "user",
             "--data.max_rows_per_user", "4", "--trainer.max_epochs", "2", *epsilon(4.0)]  # fmt: skip
    report = audit_main(full_batch_args(tmp_path, *users), lm=False)
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    assert ledger["privacy_unit"] == "user" and ledger["users"] < 200
    assert report["sample_rate"] == pytest.approx(10 / ledger["users"]) and report["mode"] == "white_box"
    assert 0 <= report["epsilon_lower_bound"] <= report["claimed_epsilon"] and not report["violation"]


@pytest.mark.parametrize(("ceiling", "says"), [(3.0, True), (9.0, False)])
def test_the_verdict_says_when_no_outcome_could_refute_the_claim(ceiling: float, says: bool) -> None:
    """Canaries whose every guess right shows less than the claimed ε: 'not refuted' means nothing (issue 50)."""
    report = {
        "claimed_epsilon": 8.0, "epsilon_lower_bound": 0.5, "confidence": 0.95, "analysis": "fdp", "mode": "white_box",
        "canaries": 1000, "steps": 40, "delta": 1e-5, "claimed_curve_refuted": False, "checks": [],
        "fdp": {"mu": 0.1, "epsilon": 0.5}, "eps_delta": {"epsilon": 0.4},
        "plan": {"expected_mu": 0.2, "expected_epsilon": 1.0, "ceiling_mu": 0.9, "ceiling_epsilon": ceiling},
    }  # fmt: skip
    line = verdict(report)[1]
    assert ("no outcome of this audit could refute it" in line) is says, line


def test_the_audit_sections_help_is_each_fields_docstring() -> None:
    """AuditSettings documents each field once, under it; ``dplit audit --help`` shows that text."""
    result = run_dplit_in_process("audit", "--help")
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())
    assert "m, the number of canaries (each in the run with probability 1/2)" in help_text
    assert "The confidence of the lower bound ε̂, in (0, 1)" in help_text
