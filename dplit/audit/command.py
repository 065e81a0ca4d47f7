"""``dplit audit`` and ``dplit lm audit``: one DP training run with canaries, then ε̂ from their scores."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import ConcatDataset, DataLoader
from typing_extensions import override

from dplit.audit.bound import AuditBound, audit_bound
from dplit.audit.calibration import ScaleCheck, scale_checks
from dplit.audit.canaries import InputCanaries
from dplit.audit.claimed_curve import claimed_least_probability, epsilon_at_least
from dplit.audit.fdp import GdpBound, dpsgd_mu, gdp_bound, refutes
from dplit.audit.simulation import GuessPlan, plan_guesses
from dplit.audit.strategy import CanaryDPStrategy
from dplit.backbone.isolation import isolation_refusal
from dplit.flag_types import OpenUnitNumber, check, number_type
from dplit.strategy import DPStrategy

AUDIT_FILE = "audit.json"
CANARY_LENGTH = 32
"""Tokens in a black-box canary (fewer when ``data.max_length`` is smaller)."""
BOUNDS = {
    "fdp": "Mahloujifar, Melis & Chaudhuri 2025 (arXiv 2410.22235), f-DP with the Gaussian curve G_μ; ε̂ is ε of "
    "μ̂-GDP at δ",
    "eps_delta": "Steinke, Nasr & Jagielski 2023 (arXiv 2305.08846), (ε, δ) theorem, exact binomial tails",
}
SELECTIONS = {
    "fdp": "one (k₊, k₋) fixed before any score is seen: the best mean μ̂ on simulated correct runs of the claimed "
    "σ, q, steps (no Bonferroni needed)",
    "eps_delta": "best (k₊, k₋) of a grid fixed in advance (0, 1, 2, 5, 10, 20, 50% of m), Bonferroni-adjusted",
}


CanaryCount = number_type("CanaryCount", integer=True, minimum=2)
"""m, a number of canaries: an integer ≥ 2."""
AuditMode = Literal["white_box", "black_box"]
Analysis = Literal["fdp", "eps_delta"]


@dataclass(frozen=True)
class AuditSettings:
    """The ``audit`` section of ``dplit audit``, checked when the settings are made (one line naming the flag)."""

    canaries: CanaryCount = 1000
    """m, the number of canaries (each in the run with probability 1/2)."""

    mode: AuditMode = "white_box"
    """``"white_box"`` (gradient canaries, scored on every step's noisy sum) or ``"black_box"`` (random-token training
    examples, scored by minus their loss under the final model)."""

    analysis: Analysis = "fdp"
    """``"fdp"`` (the one-run f-DP analysis of Mahloujifar et al. 2025 with the Gaussian trade-off curve: μ̂, and ε̂
    at the run's δ) or ``"eps_delta"`` (the (ε, δ) analysis of Steinke et al. 2023). Both are computed and reported;
    this one decides the verdict."""

    confidence: OpenUnitNumber = 0.95
    """The confidence of the lower bound ε̂, in (0, 1)."""

    seed: int | None = None
    """Seeds the canaries and which are included (the auditor's own randomness); drawn and recorded if unset."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "canaries", check(self.canaries, CanaryCount, flag="audit.canaries"))
        object.__setattr__(self, "confidence", check(self.confidence, OpenUnitNumber, flag="audit.confidence"))
        for field, kind in (("mode", AuditMode), ("analysis", Analysis)):
            choices = get_args(kind)
            if getattr(self, field) not in choices:
                raise ValueError(
                    f"audit.{field}={getattr(self, field)!r}: expected one of {', '.join(map(repr, choices))}"
                )
        _check_power(self.canaries, self.confidence)
        if self.seed is None:
            object.__setattr__(self, "seed", secrets.randbits(31))


def _check_power(canaries: int, confidence: float) -> None:
    """Refuse a canary count whose every guess right could still be chance at ``confidence``: no claim is refutable.

    Guessing m canaries' membership at random gets all of them right with probability 2^-m; while that is at least
    1 − confidence, no outcome rejects even ε = 0, so the audit would end "not refuted" whatever the mechanism does.
    """
    if 2.0**-canaries >= 1 - confidence:
        least = math.floor(math.log2(1 / (1 - confidence))) + 1
        raise ValueError(
            f"audit.canaries={canaries} cannot refute any claim at {100 * confidence:g}% confidence: all {canaries} "
            f"guesses right happen by chance with probability 2^-{canaries} = {2.0**-canaries:.3g}; use at least "
            f"{least} (the default 1000; thousands to refute an ε of several units)"
        )


FAILED = (
    "PRIVACY AUDIT FAILED: {reasons}. This is evidence of a bug in the DP mechanism (noise, sampling, clipping, "
    "normalisation or accounting): do not trust this configuration's guarantee"
)


def failures(report: dict[str, Any]) -> list[str]:
    """Why the audit fails: the claim refuted, and every white-box scale check that failed (none: it passes)."""
    percent = f"{100 * report['confidence']:g}%"
    if not report["violation"]:
        reasons = []
    elif report["analysis"] == "fdp":
        reasons = [
            f"the canary guesses refute the claimed mechanism's trade-off curve at {percent} confidence "
            f"(ε ≥ {report['epsilon_lower_bound']:.3f} as μ-GDP, claimed ε = {report['claimed_epsilon']:.3f})"
        ]
    else:
        reasons = [f"the measured lower bound ε ≥ {report['epsilon_lower_bound']:.3f} exceeds the claimed ε = "
                   f"{report['claimed_epsilon']:.3f} at {percent} confidence"]  # fmt: skip
    failed = [check["line"] for check in report["checks"] if not check["passed"]]
    if failed:
        reasons.append("the released sums do not scale as the claimed mechanism's do (" + "; ".join(failed) + ")")
    accounting = report["accounting_check"]
    if accounting is not None and not accounting["passed"]:
        reasons.append(f"the claimed ε = {report['claimed_epsilon']:.4f} is below {accounting['epsilon_at_least']:.4f}, "
                       "the least ε of the run's σ, q and steps (dp-accounting's optimistic PLD): the accountant "
                       "understates ε")  # fmt: skip
    return reasons


def verdict(report: dict[str, Any]) -> list[str]:
    """The audit's lines: ``empirical ε ≥ X (μ ≥ M) at 95% confidence; a correct run shows ≈ E, at most U …``."""
    claimed = report["claimed_epsilon"]
    shown = "∞ (no noise)" if claimed is None else f"{claimed:.3f}"
    fdp, plan = report["fdp"], report["plan"]
    lines = [
        f"empirical ε ≥ {report['epsilon_lower_bound']:.3f} at {100 * report['confidence']:g}% confidence "
        f"({report['analysis']}; claimed ε = {shown}; {report['mode']}, m = {report['canaries']}, "
        f"{report['steps']} steps)",
        f"f-DP: μ ≥ {fdp['mu']:.3f} (ε ≥ {fdp['epsilon']:.3f} at δ = {report['delta']:.3g}); the claimed mechanism's "
        f"own curve {'IS' if report['claimed_curve_refuted'] else 'is not'} refuted; a correct run is expected to show "
        f"μ ≈ {plan['expected_mu']:.3f} (ε ≈ {plan['expected_epsilon']:.3f}"
        f"{', to a white-box auditor' if report['mode'] == 'black_box' else ''}); these guesses could show at most "
        f"μ = {plan['ceiling_mu']:.3f} (ε = {plan['ceiling_epsilon']:.3f}{_powerless(plan, claimed)}); (ε, δ) analysis: "
        f"ε ≥ {report['eps_delta']['epsilon']:.3f}",
    ]
    return lines + [check["line"] for check in report["checks"]]


def _powerless(plan: dict[str, Any], claimed: float | None) -> str:
    """``", below the claimed ε: no outcome could refute it"`` when the guesses' ceiling is under the claim."""
    if claimed is not None and plan["ceiling_epsilon"] < claimed:
        return ", below the claimed ε: no outcome of this audit could refute it (more canaries would)"
    return ""


def run_audit(
    trainer: Trainer, model: LightningModule, data: Any, settings: AuditSettings, *, lm: bool
) -> dict[str, Any]:
    """Train once with the canaries, compute ε̂, write ``audit.json`` and log ``audit/epsilon_lower_bound``."""
    strategy = trainer.strategy
    if not isinstance(strategy, DPStrategy):
        raise TypeError("dplit audit audits DP-SGD: set trainer.strategy to dplit.strategy.DPStrategy")
    trainer.callbacks.append(PowerCheck(settings))
    checks: list[ScaleCheck] = []
    if settings.mode == "white_box":
        assert isinstance(strategy, CanaryDPStrategy)
        trainer.fit(model, datamodule=data)
        claim = ClaimedMechanism.of(strategy)
        canaries = strategy.canaries
        scores, included = canaries.scores, canaries.included
        checks = scale_checks(
            canaries.first_readings, canaries.reading_sums, canaries.reading_squares, canaries.contrast_sums,
            canaries.contrast_squares, included, steps=canaries.steps, contrast_steps=canaries.contrast_steps,
            sample_rate=claim.sample_rate, noise_multiplier=claim.gradient_noise_multiplier,
        )  # fmt: skip
    else:
        _check_isolation(model, data)
        inputs = _input_canaries(data, settings, lm=lm)
        trainer.fit(model, train_dataloaders=_with_canaries(data, inputs), val_dataloaders=data.val_dataloader())
        claim = ClaimedMechanism.of(strategy)
        model.eval()
        scores = inputs.scores(
            model.per_example_loss, data.collate_fn, batch_size=data.eval_batch_size, device=model.device
        )
        included = inputs.included
    plan = _plan(claim, settings)
    fdp = gdp_bound(scores, included, k_plus=plan.k_plus, k_minus=plan.k_minus, delta=claim.delta,
                    confidence=settings.confidence)  # fmt: skip
    eps_delta = audit_bound(scores, included, delta=claim.delta, confidence=settings.confidence)
    report = _report(strategy, claim, settings, fdp=fdp, eps_delta=eps_delta, plan=plan, checks=checks,
                     included=int(included.sum()), claim_refuted=_claim_refuted(claim, fdp, settings))  # fmt: skip
    _record(trainer, report)
    return report


@dataclass(frozen=True)
class ClaimedMechanism:
    """What the audited run claims to have released, read once from its strategy after training."""

    noise_multiplier: float
    """σ, the accounted noise multiplier (0: no noise). Under quantile clipping the gradient's σ_eff is larger, but
    C_t moves with the noisy count, so only σ is claimed for everything released."""
    gradient_noise_multiplier: float
    """σ of the gradient's noise in units of C (σ_eff under quantile clipping): what a canary's reading carries."""
    sample_rate: float
    """q (1: full batches)."""
    steps: int
    """T, the steps accounted."""
    delta: float
    epsilon: float
    """The accountant's ε for the run (∞ without noise)."""

    @classmethod
    def of(cls, strategy: DPStrategy) -> ClaimedMechanism:
        """The claim of a trained ``strategy``."""
        accountant = strategy.accountant
        assert accountant is not None
        return cls(
            noise_multiplier=strategy.noise_multiplier or 0.0,
            gradient_noise_multiplier=strategy.dpsgd.gradient_noise_multiplier,
            sample_rate=float(strategy.dpsgd.sample_rate or 1.0), steps=accountant.steps, delta=accountant.delta,
            epsilon=accountant.epsilon(),
        )  # fmt: skip


def _plan(claim: ClaimedMechanism, settings: AuditSettings) -> GuessPlan:
    """The f-DP guesses, chosen on correct runs of the claimed mechanism simulated before any score is read."""
    return plan_guesses(
        canaries=settings.canaries, noise_multiplier=claim.gradient_noise_multiplier, sample_rate=claim.sample_rate,
        steps=claim.steps, delta=claim.delta, confidence=settings.confidence,
    )  # fmt: skip


def _claim_refuted(claim: ClaimedMechanism, fdp: GdpBound, settings: AuditSettings) -> bool:
    """Whether the f-DP guesses refute the claimed mechanism's own curve (σ, q, T) at the stated confidence."""
    if claim.noise_multiplier <= 0:  # no noise: nothing is claimed
        return False
    curve = claimed_least_probability(noise_multiplier=claim.noise_multiplier, sample_rate=claim.sample_rate,
                                      steps=claim.steps)  # fmt: skip
    refuted = refutes(curve, canaries=settings.canaries, guesses=np.array([fdp.k_plus + fdp.k_minus]),
                      correct=np.array([fdp.correct]), level=1 - settings.confidence)  # fmt: skip
    return bool(refuted[0])


ACCOUNTING_SLACK = 1e-3
"""Relative room for the discretisation of dp-accounting's optimistic estimate."""


def _accounting_check(claim: ClaimedMechanism) -> dict[str, Any] | None:
    """The claimed ε against the least ε of the run's σ, q and steps (``None`` without noise)."""
    if claim.noise_multiplier <= 0 or not math.isfinite(claim.epsilon):
        return None
    least = epsilon_at_least(noise_multiplier=claim.noise_multiplier, sample_rate=claim.sample_rate,
                             steps=claim.steps, delta=claim.delta)  # fmt: skip
    return {"epsilon_at_least": least, "passed": claim.epsilon >= least * (1 - ACCOUNTING_SLACK)}


class PowerCheck(Callback):
    """Warns before the first step (δ is known once DPStrategy has started) when 2·m·δ ≥ 1 − confidence.

    Only the (ε, δ) analysis has that δ term (the f-DP analysis uses δ only to read μ̂ as ε̂).

    Then no outcome could refute any ε. Lightning calls callbacks' ``on_train_start`` before the strategy's, so the
    check runs at the first epoch's start.

    Args:
        settings: the audit's settings (the number of canaries m and the confidence).
    """

    def __init__(self, settings: AuditSettings) -> None:
        self._settings = settings
        self._checked = False

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        accountant = getattr(trainer.strategy, "accountant", None)
        if self._checked or accountant is None or self._settings.analysis != "eps_delta":
            return
        self._checked = True
        term = 2 * self._settings.canaries * accountant.delta
        if term >= 1 - self._settings.confidence:
            rank_zero_warn(
                f"2·m·δ = {term:.3g} ≥ 1 − confidence = {1 - self._settings.confidence:.3g}, so the bound will be "
                "0 whatever the guesses: lower trainer.strategy.init_args.target_delta or audit.canaries"
            )


def _input_canaries(data: Any, settings: AuditSettings, *, lm: bool) -> InputCanaries:
    generator = torch.Generator().manual_seed(settings.seed)
    length = min(int(data.max_length), CANARY_LENGTH)
    if lm:
        return InputCanaries.for_language_model(
            settings.canaries, vocab_size=data.vocab_size, length=length, generator=generator
        )
    return InputCanaries.for_classifier(
        settings.canaries, vocab_size=data.vocab_size, num_classes=data.num_classes, length=length,
        generator=generator,
    )  # fmt: skip


def _with_canaries(data: Any, canaries: InputCanaries) -> DataLoader:
    """The training rows plus the included canaries, batched as the datamodule batches its training rows.

    DPStrategy Poisson-samples the rows; with ``data.packing=true`` each sampled batch (canaries included, each its
    own document) is packed as the fit packs it (the datamodule's ``train_collate_fn``).
    """
    data.prepare_data()
    data.setup("fit")
    rows = ConcatDataset([data.dataset("train"), canaries.training_set()])
    collate = getattr(data, "train_collate_fn", data.collate_fn)
    return DataLoader(rows, batch_size=data.batch_size, shuffle=True, collate_fn=collate)


def _check_isolation(model: LightningModule, data: Any) -> None:
    """Refuse packing with a model that cannot isolate documents (the fit on loaders skips the module's own check)."""
    packing = bool(getattr(data, "hparams", {}).get("packing"))
    refusal = isolation_refusal(model.backbone) if packing and hasattr(model, "backbone") else None
    if refusal is not None:
        raise ValueError(refusal)


def _report(
    strategy: DPStrategy, claim: ClaimedMechanism, settings: AuditSettings, *, fdp: GdpBound, eps_delta: AuditBound,
    plan: GuessPlan, checks: list[ScaleCheck], included: int, claim_refuted: bool,
) -> dict[str, Any]:  # fmt: skip
    claimed = claim.epsilon
    headline = fdp.epsilon if settings.analysis == "fdp" else eps_delta.epsilon
    claimed_mu = dpsgd_mu(noise_multiplier=claim.gradient_noise_multiplier, sample_rate=claim.sample_rate,
                          steps=claim.steps)  # fmt: skip
    return {
        "epsilon_lower_bound": headline,
        "analysis": settings.analysis,
        "claimed_epsilon": claimed if math.isfinite(claimed) else None,
        "delta": claim.delta,
        "confidence": settings.confidence,
        "violation": claim_refuted if settings.analysis == "fdp" else headline > claimed,
        "claimed_curve_refuted": claim_refuted,
        "accounting_check": _accounting_check(claim),
        "claimed_curve": "exact G_μ, μ = √T/σ"
        if claim.sample_rate >= 1
        else "dp-accounting PLD of the Poisson-subsampled Gaussian (σ, q, T), pessimistic, read from below",
        "mode": settings.mode,
        "canaries": settings.canaries,
        "canaries_included": included,
        "fdp": {**vars(fdp), "bound": BOUNDS["fdp"], "selection": SELECTIONS["fdp"]},
        "eps_delta": {**vars(eps_delta), "bound": BOUNDS["eps_delta"], "selection": SELECTIONS["eps_delta"]},
        "plan": vars(plan),
        "claimed_mu": claimed_mu if math.isfinite(claimed_mu) else None,
        "claimed_mu_is": "exact (√T/σ)" if claim.sample_rate >= 1 else "CLT approximation q·√(T(e^{1/σ²} − 1))",
        "checks": [{**vars(check), "line": check.line()} for check in checks],
        "steps": claim.steps,
        "noise_multiplier": strategy.noise_multiplier,
        "max_grad_norm": strategy.max_grad_norm,
        "sample_rate": strategy.dpsgd.sample_rate,
        "dataset_size": strategy.dpsgd.dataset_size,
        "seed": settings.seed,
    }


def _record(trainer: Trainer, report: dict[str, Any]) -> None:
    """Write ``audit.json`` beside the logs and log ``audit/epsilon_lower_bound`` (rank 0)."""
    if not trainer.is_global_zero:
        return
    folder = Path(trainer.log_dir or trainer.default_root_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / AUDIT_FILE).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    for logger in trainer.loggers:
        metrics = {"audit/epsilon_lower_bound": report["epsilon_lower_bound"], "audit/mu_lower_bound": report["fdp"]["mu"],
                   "audit/expected_epsilon": report["plan"]["expected_epsilon"]}  # fmt: skip
        logger.log_metrics(metrics, step=trainer.global_step)
        logger.finalize("success")
