"""White-box checks of the mechanism's scale: does each canary inclusion move its coordinate by C, the noise by σC?

The auditor reads every canary's coordinate of the released noisy sum on every step, in units of C. For a correct
mechanism a sampled canary adds exactly 1 to that step's reading, whatever the real examples add there; and an
excluded canary's readings vary around their own mean by at least σ (the noise, plus whatever the real examples'
gradients vary by). A signal of k·C per inclusion (k ≠ 1) is a mechanism that scales or divides differently from
what it claims (e.g. by the realised batch size instead of q·N, or a gradient not clipped); a spread below σ is noise
smaller than the accountant counts.

The signal is measured where nothing else can move it. An included canary moves its own weight, and the real
examples' gradients at that coordinate may then push back, so included and excluded canaries drift apart over a
run: comparing their means would fail correct runs. With Poisson sampling the signal is the within-canary contrast
of the steps that sampled an included canary against those that did not (the draw is independent of everything
else at that step, so the contrast is exactly 1 for a correct mechanism; each canary's own level cancels); in full
batches, where every step samples it, it is the first step's included − excluded difference, read before any
update. Each check errs on a correct run with probability :data:`CHECK_LEVEL` (both together at most twice that).
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


def _signal(name: str, estimate: float, error: float) -> ScaleCheck:
    """A two-sided check that the signal per inclusion is 1, from an estimate and its standard error."""
    half = float(stats.norm.isf(CHECK_LEVEL / 2)) * error
    return ScaleCheck(name, estimate, estimate - half, estimate + half, 1.0, estimate - half <= 1 <= estimate + half, "1")


def first_step_signal(first: Tensor, included: Tensor, *, sample_rate: float) -> ScaleCheck:
    """(mean first reading of included − excluded canaries) / q: 1 before any update (Welch's interval)."""
    inside, outside = first[included].double(), first[~included].double()
    estimate = float(inside.mean() - outside.mean()) / sample_rate
    error = math.sqrt(float(inside.var()) / inside.numel() + float(outside.var()) / outside.numel()) / sample_rate
    return _signal("signal per inclusion, first step (× C)", estimate, error)


def sampled_contrast_signal(
    reading_sums: Tensor, reading_squares: Tensor, sampled_sums: Tensor, sampled_counts: Tensor, *, steps: int
) -> ScaleCheck:
    """Included canaries' readings on the steps that sampled them minus the steps that did not: 1 per inclusion.

    A regression on the sampled indicator with one level per canary: Σ_j (S_j − c_j·R_j/T) / Σ_j c_j(T − c_j)/T
    (R_j: canary j's readings summed, S_j: over its c_j sampled steps), its error from the pooled within-canary
    variance.

    Args:
        reading_sums: each included canary's readings summed over the steps [n].
        reading_squares: their squares summed [n].
        sampled_sums: the readings summed over the steps that sampled the canary [n].
        sampled_counts: how many steps sampled it [n].
        steps: T.
    """
    spread = sampled_counts * (steps - sampled_counts) / steps  # [n]
    estimate = float((sampled_sums - sampled_counts * reading_sums / steps).sum() / spread.sum())
    pooled = float((reading_squares - reading_sums**2 / steps).sum()) / (reading_sums.numel() * (steps - 1))
    return _signal("signal per inclusion, sampled − unsampled steps (× C)", estimate, math.sqrt(pooled / float(spread.sum())))


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
    first: Tensor | None, reading_sums: Tensor, reading_squares: Tensor, sampled_sums: Tensor, sampled_counts: Tensor,
    included: Tensor, *, steps: int, sample_rate: float, noise_multiplier: float,
) -> list[ScaleCheck]:  # fmt: skip
    """The checks the run's readings allow: the signal (with 2 canaries in and 2 out at least), the noise (σ > 0).

    The sampled contrast needs the draws (known where the canaries were added, rank 0) and steps that sampled and
    that skipped the canaries; otherwise the first step's difference serves.
    """
    inside = int(included.sum())
    if first is None or steps < 1 or min(inside, included.numel() - inside) < 2:
        return []
    counts = sampled_counts[included]
    if sample_rate < 1 and steps >= 2 and float((counts * (steps - counts)).sum()) > 0:
        checks = [sampled_contrast_signal(reading_sums[included], reading_squares[included], sampled_sums[included],
                                          counts, steps=steps)]  # fmt: skip
    else:
        checks = [first_step_signal(first, included, sample_rate=sample_rate)]
    if noise_multiplier > 0 and steps >= 2:
        checks.append(noise_check(reading_sums, reading_squares, included, steps=steps,
                                  noise_multiplier=noise_multiplier))  # fmt: skip
    return checks
