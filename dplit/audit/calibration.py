"""White-box checks of the mechanism's scale: does each canary inclusion move its coordinate by C, the noise by σC?

The auditor reads every canary's coordinate of the released noisy sum on every step, in units of C. For a correct
mechanism a sampled canary adds exactly 1 to that step's reading, whatever the real examples add there; and an
excluded canary's readings vary around their own mean by at least σ (the noise, plus whatever the real examples'
gradients vary by). A signal of k·C per inclusion (k ≠ 1) is a mechanism that scales or divides differently from
what it claims (e.g. by the realised batch size instead of q·N, or a gradient not clipped); a spread below σ is noise
smaller than the accountant counts.

The signal is measured where nothing else can move it. An included canary moves its own weight, and the real
examples' gradients at that coordinate may then push back, so included and excluded canaries drift apart over a
run: comparing their means would fail correct runs. With Poisson sampling the signal is each included canary's
contrast Σ_t (s_t − q)(x_t − mean of its readings before t): the draw s_t is independent of everything else at
step t, and the centre is fixed before it, so the contrast has mean exactly q(1 − q) per step for a correct
mechanism, whatever the model did before; in full batches, where every step samples it, the signal is the first
step's included − excluded difference, read before any update. Intervals use Student-t quantiles. Each check errs
on a correct run with probability :data:`CHECK_LEVEL` (both together at most twice that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats
from torch import Tensor

CHECK_LEVEL = 1e-4
"""The false-alarm probability of each check on a correct run."""


@dataclass(frozen=True)
class ScaleCheck:
    """One check's measurement, its interval at 1 − :data:`CHECK_LEVEL`, and whether the claim stands."""

    name: str
    measured: float
    low: float
    high: float
    expected: float
    passed: bool
    meaning: str

    def line(self) -> str:
        """The check as one line of the audit's output."""
        verdict = "ok" if self.passed else "FAILED"
        return (f"{self.name}: {self.measured:.3f} (interval [{self.low:.3f}, {self.high:.3f}], "
                f"a correct mechanism gives {self.meaning}): {verdict}")  # fmt: skip


ROUNDING = 1e-4
"""The least half-width of a signal interval: without noise or data at the coordinates the readings are exact up to
float32 rounding of C."""


def _signal(name: str, estimate: float, error: float, freedom: float) -> ScaleCheck:
    """A two-sided check that the signal per inclusion is 1, from an estimate, its standard error and its d.o.f."""
    half = max(float(stats.t.isf(CHECK_LEVEL / 2, max(freedom, 1.0))) * error, ROUNDING)
    return ScaleCheck(name, estimate, estimate - half, estimate + half, 1.0, estimate - half <= 1 <= estimate + half, "1")


def first_step_signal(first: Tensor, included: Tensor, *, sample_rate: float) -> ScaleCheck:
    """(mean first reading of included − excluded canaries) / q: 1 before any update (Welch's interval)."""
    inside, outside = first[included].double(), first[~included].double()
    estimate = float(inside.mean() - outside.mean()) / sample_rate
    shares = [float(group.var()) / group.numel() for group in (inside, outside)]
    error = math.sqrt(sum(shares)) / sample_rate
    spread = sum(share**2 / max(group.numel() - 1, 1) for share, group in zip(shares, (inside, outside), strict=True))
    freedom = sum(shares) ** 2 / spread if spread > 0 else 1.0  # Welch-Satterthwaite
    return _signal("signal per inclusion, first step (× C)", estimate, error, freedom)


def sampled_contrast_signal(contrast_sums: Tensor, contrast_squares: Tensor, *, steps: int, sample_rate: float) -> ScaleCheck:
    """Each included canary's sampled-vs-earlier contrast over q(1 − q) per step: 1 per inclusion.

    The terms (s_t − q)(x_t − mean of earlier readings) are martingale differences around q(1 − q), so the error is
    √Σ terms² over q(1 − q) per step and canary.

    Args:
        contrast_sums: each included canary's Σ_t of its terms [n].
        contrast_squares: each included canary's Σ_t of its squared terms [n].
        steps: the steps whose draws were known.
        sample_rate: q (< 1).
    """
    scale = sample_rate * (1 - sample_rate) * contrast_sums.numel() * steps
    estimate = float(contrast_sums.sum()) / scale
    error = math.sqrt(float(contrast_squares.sum())) / scale
    return _signal("signal per inclusion, sampled contrast (× C)", estimate, error, contrast_sums.numel() * steps - 1)


def noise_check(
    reading_sums: Tensor, reading_squares: Tensor, included: Tensor, *, steps: int, noise_multiplier: float
) -> ScaleCheck:
    """The excluded canaries' spread over the steps, in units of σC: at least 1 for a correct mechanism.

    Their readings, centred on each canary's own mean, are noise plus the real examples' varying gradients at that
    coordinate: under the claim the pooled variance is at least σ², so ν·s²/σ² has a χ²_ν lower tail (ν = canaries
    out × (T − 1)); a measured ratio below its lower end refutes the claimed noise.

    Args:
        reading_sums: each canary's readings summed over the steps [m].
        reading_squares: each canary's squared readings summed over the steps [m].
        included: whether each canary was in the run [m] (bool).
        steps: T (≥ 2).
        noise_multiplier: σ the run claims (> 0).
    """
    sums, squares = reading_sums[~included].double(), reading_squares[~included].double()
    freedom = sums.numel() * (steps - 1)
    pooled = float((squares - sums**2 / steps).sum()) / freedom
    ratio = math.sqrt(pooled) / noise_multiplier
    low = ratio * math.sqrt(freedom / float(stats.chi2.isf(CHECK_LEVEL, freedom)))
    high = ratio * math.sqrt(freedom / float(stats.chi2.ppf(CHECK_LEVEL, freedom)))
    return ScaleCheck("noise std (× σC)", ratio, low, high, 1.0, high >= 1.0, "≥ 1")


def scale_checks(
    first: Tensor | None, reading_sums: Tensor, reading_squares: Tensor, contrast_sums: Tensor,
    contrast_squares: Tensor, included: Tensor, *, steps: int, contrast_steps: int, sample_rate: float,
    noise_multiplier: float,
) -> list[ScaleCheck]:  # fmt: skip
    """The checks the run's readings allow: the signal (with 2 canaries in and 2 out at least), the noise (σ > 0).

    The sampled contrast needs q < 1 and the draws (known where the canaries were added, rank 0); otherwise the
    first step's difference serves.
    """
    inside = int(included.sum())
    if first is None or steps < 1 or min(inside, included.numel() - inside) < 2:
        return []
    if sample_rate < 1 and contrast_steps > 0 and float(contrast_squares[included].sum()) > 0:
        checks = [sampled_contrast_signal(contrast_sums[included], contrast_squares[included], steps=contrast_steps,
                                          sample_rate=sample_rate)]  # fmt: skip
    else:
        checks = [first_step_signal(first, included, sample_rate=sample_rate)]
    if noise_multiplier > 0 and steps >= 2:
        checks.append(noise_check(reading_sums, reading_squares, included, steps=steps,
                                  noise_multiplier=noise_multiplier))  # fmt: skip
    return checks
