"""White-box checks of the mechanism's scale: does each canary inclusion move its coordinate by C, the noise by σC?

The auditor reads every canary's coordinate of the released noisy sum on every step, in units of C. For a correct
mechanism, an included canary's reading has mean q (1 when sampled) above an excluded one's, whatever the real
examples add at that coordinate (canaries sit on random coordinates, in or out alike); and an excluded canary's
readings vary around their own mean by at least σ (the noise, plus whatever the real examples' gradients vary by).
A signal of k·C per inclusion (k ≠ 1) is a mechanism that scales or divides differently from what it claims (e.g.
by the realised batch size instead of q·N, or a gradient not clipped); a spread below σ is noise smaller than the
accountant counts. Both are tested at :data:`CHECK_LEVEL`, so a correct run fails either only once in 10⁴ audits.
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


def signal_check(reading_sums: Tensor, included: Tensor, *, steps: int, sample_rate: float) -> ScaleCheck:
    """Each inclusion's effect on its coordinate, in units of C: (mean reading in − out) / q, expected 1.

    The interval is Welch's, over canaries (each canary's mean reading over the steps is one draw), so the real
    examples' gradients at a coordinate, however correlated across steps, only widen it.

    Args:
        reading_sums: each canary's readings summed over the steps [m].
        included: whether each canary was in the run [m] (bool).
        steps: T, the readings per canary.
        sample_rate: q.
    """
    means = reading_sums.double() / steps  # [m]
    inside, outside = means[included], means[~included]
    difference = float(inside.mean() - outside.mean()) / sample_rate
    error = math.sqrt(float(inside.var()) / inside.numel() + float(outside.var()) / outside.numel()) / sample_rate
    half = float(stats.norm.isf(CHECK_LEVEL / 2)) * error
    low, high = difference - half, difference + half
    return ScaleCheck("signal per inclusion (× C)", difference, low, high, 1.0, low <= 1.0 <= high, "1")


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
    reading_sums: Tensor, reading_squares: Tensor, included: Tensor, *, steps: int, sample_rate: float,
    noise_multiplier: float,
) -> list[ScaleCheck]:  # fmt: skip
    """The checks that apply: the signal always (with canaries in and out), the noise when σ > 0 and T ≥ 2."""
    if included.all() or not included.any() or steps < 1:
        return []
    checks = [signal_check(reading_sums, included, steps=steps, sample_rate=sample_rate)]
    if noise_multiplier > 0 and steps >= 2:
        checks.append(noise_check(reading_sums, reading_squares, included, steps=steps,
                                  noise_multiplier=noise_multiplier))  # fmt: skip
    return checks
