"""Where DP-SGD's randomness comes from: the operating system's entropy, or an explicit seed on request.

The Gaussian noise and the Poisson batch membership are what hide each example; anyone who can regenerate
them can subtract them. So by default every generator is seeded with fresh bits from ``secrets`` (the OS
CSPRNG; 256 bits, every one of which starts the generator: :mod:`dplit.privacy.seeds`), independent of
``seed_everything`` and never stored, logged or checkpointed: the noise generator is
reseeded every step, so no two steps (and no resumed run) share a stream, and recovering one step's generator
state reveals nothing about another's. An explicit seed makes both streams reproducible for tests and
debugging, and therefore predictable by anyone who knows it: such a run must not be released.
"""

from __future__ import annotations

import secrets
import warnings

import torch

from dplit.privacy.refusal import DEFAULT_OWNER
from dplit.privacy.seeds import SEED_BITS, derive_seed, seeded_generator
from dplit.privacy.warnings import PrivacyWarning

PREDICTABLE_WARNING = (
    f"{DEFAULT_OWNER}.seed is set: the DP noise and the Poisson batch sampling are reproducible from the config, so "
    "anyone who knows the seed can remove the noise. The privacy guarantee does not hold: do not release this run "
    "or the model trained by it (leave seed unset for noise seeded from the operating system's entropy)"
)


class NoiseSource:
    """Seeds the sampling and noise generators: OS entropy by default, derived from ``seed`` when one is given.

    Args:
        seed: ``None`` (default) for secure seeds drawn from the OS; an integer for reproducible, PREDICTABLE
            streams (warns).
    """

    def __init__(self, *, seed: int | None = None) -> None:
        if seed is not None:
            warnings.warn(PREDICTABLE_WARNING, PrivacyWarning, stacklevel=3)
        self._seed = seed

    @property
    def secure(self) -> bool:
        """Whether the streams are seeded from OS entropy (unpredictable), rather than from an explicit seed."""
        return self._seed is None

    def describe(self) -> str:
        """What the privacy ledger records about the noise (never the seed itself)."""
        return "os_entropy" if self.secure else "explicit_seed (predictable: not private, do not release)"

    def seed(self, stream: str, *, steps: int) -> int:
        """A seed of 256 bits for ``stream`` after ``steps`` DP steps: fresh entropy, or from (seed, stream, steps)."""
        if self._seed is None:
            return secrets.randbits(SEED_BITS)
        return derive_seed(self._seed, stream, steps)

    def generator(self, stream: str, *, steps: int, device: torch.device) -> torch.Generator:
        """A generator on ``device`` seeded by :meth:`seed`, every bit of it (see :mod:`dplit.privacy.seeds`)."""
        return seeded_generator(self.seed(stream, steps=steps), device=device)

    def step_generator(self, rank: int, *, steps: int, device: torch.device) -> torch.Generator:
        """A fresh generator for the noise ``rank`` draws in the step after ``steps`` (each rank its own stream)."""
        return self.generator("noise" if rank == 0 else f"noise/rank{rank}", steps=steps, device=device)

    def count_noise(self, std: float, *, steps: int) -> float:
        """One draw of N(0, std²) for quantile clipping's count in the step after ``steps`` (its own stream)."""
        generator = self.generator("count", steps=steps, device=torch.device("cpu"))
        return float(torch.randn((), generator=generator, dtype=torch.float64)) * std
