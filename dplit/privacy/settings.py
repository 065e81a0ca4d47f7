"""DPSGDSettings: every DP-SGD knob, one docstring per field, validated once when the settings are made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dplit.numbers import is_finite_number, range_text
from dplit.privacy.accounting import DELTA_MAX, Mechanism

CLIPPING_ENGINES = ("ghost", "per_example")
TIED_NORMS = ("exact", "bound")
ACCOUNTANTS = ("prv", "rdp")
FLAG_OWNER = "DPStrategy"
"""Where a user sets these knobs (``trainer.strategy.init_args.<field>``): every refusal names ``DPStrategy.<field>``."""


@dataclass(frozen=True)
class DPSGDSettings:
    """The knobs of one DP-SGD run (Abadi et al. 2016, Algorithm 1, with Poisson sampling).

    Every value is checked when the settings are made, so a bad config fails before any data is read, in one line
    naming ``DPStrategy.<field>``.
    """

    max_grad_norm: float
    """C: every example's gradient is clipped to norm ≤ C, and the noise's standard deviation is σ·C (the initial
    C_0 under ``clip_mode: quantile``; the update's scale under ``clip_mode: automatic``)."""

    clip_mode: Literal["fixed", "quantile", "automatic"] = "fixed"
    """``"fixed"``: C = ``max_grad_norm``; ``"quantile"``: C follows a quantile of the norms, estimated privately
    (Andrew et al. 2021); ``"automatic"``: every gradient scaled by C / (‖g‖ + γ), nothing to tune (Bu et al.
    2023). See :mod:`dplit.privacy.clip_bound`."""

    target_quantile: float | None = None
    """Quantile mode: γ in (0, 1), the share of examples to leave unclipped (default 0.5)."""

    clip_learning_rate: float | None = None
    """Quantile mode: η in (0, 5], the geometric step of C's update (default 0.2, as Andrew et al.); one update moves
    C by up to a factor e^η, so a larger η would under- or overflow C within a few steps."""

    count_noise_multiplier: float | None = None
    """Quantile mode: σ_b > 0, the noise std of the unclipped count, in examples (default: expected batch / 20,
    as Andrew et al.); the gradient's noise rises to σ_eff = (σ⁻² − (2σ_b)⁻²)^(−½) so ε stays that of σ."""

    automatic_stability: float | None = None
    """Automatic mode: γ > 0 in C / (‖g‖ + γ) (default 0.01, as Bu et al.)."""

    noise_multiplier: float | None = None
    """σ, the noise's standard deviation in units of C; give this or ``target_epsilon``, not both. 0 adds no noise
    (not private: warns)."""

    target_epsilon: float | None = None
    """Calibrate σ so that the weights' whole privacy history (earlier runs included) spends at most this ε over the
    planned steps; training stops before a step that would spend more."""

    target_delta: float | None = None
    """δ; default N^-1.1 for N training examples. δ ≥ 1/N is refused unless ``allow_large_delta``."""

    accountant: Mechanism = "prv"
    """``"prv"`` (the tighter numerical accountant, default) or ``"rdp"`` (Rényi DP, an upper bound)."""

    clipping: Literal["ghost", "per_example"] = "ghost"
    """``"ghost"``: per-example norms without per-example gradients, one backward; ``"per_example"``: materialised
    per-example gradients (the exact reference, more memory)."""

    tied_norm: Literal["exact", "bound"] = "exact"
    """For a parameter used twice (tied embeddings), ghost only: ``"exact"`` (with the cross term) or ``"bound"``
    (‖G₁‖ + ‖G₂‖, over-clips)."""

    max_physical_batch_size: int = 32
    """The largest micro-batch run through the model at once, per device (memory, not privacy)."""

    self_check: bool = True
    """Before the first DP step, compare the ghost engine's per-parameter norms of a few real examples with
    autograd's and refuse, naming the parameter, on any disagreement."""

    seed: int | None = None
    """Unset (default): sampling and noise are seeded from the operating system's entropy, never stored. A seed
    makes both PREDICTABLE from the config (warns; the ledger says so): for tests and debugging, never a release."""

    allow_large_delta: bool = False
    """Accept δ ≥ 1/N (a δ that large permits releasing whole examples); warns when used."""

    private_diagnostics: bool = True
    """Log the diagnostics computed from private batches without noise (loss, gradient norms, clip fraction,
    realised batch size, memory): none is covered by ε. ``False`` when logs leave the trust boundary."""

    flag_owner: str = FLAG_OWNER
    """The strategy whose flags the refusals name: ``DPStrategy``, or ``ShardedDPStrategy`` for the sharded one."""

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                f"set exactly one of {self.flag_owner}.noise_multiplier and {self.flag_owner}.target_epsilon "
                f"(got noise_multiplier={self.noise_multiplier}, target_epsilon={self.target_epsilon})"
            )
        require_finite("max_grad_norm", self.max_grad_norm, above=0.0, owner=self.flag_owner)
        if self.noise_multiplier is not None:
            require_finite("noise_multiplier", self.noise_multiplier, at_least=0.0, owner=self.flag_owner)
        if self.target_epsilon is not None:
            require_finite("target_epsilon", self.target_epsilon, above=0.0, owner=self.flag_owner)
        if self.target_delta is not None and not is_finite_number(self.target_delta, above=0, maximum=DELTA_MAX):
            raise ValueError(f"{self.flag_owner}.target_delta must be in (0, {DELTA_MAX}], got {self.target_delta}")
        if self.max_physical_batch_size < 1:
            raise ValueError(f"{self.flag_owner}.max_physical_batch_size must be ≥ 1, got {self.max_physical_batch_size}")
        _require_choice("clipping", self.clipping, CLIPPING_ENGINES, owner=self.flag_owner)
        _require_choice("clip_mode", self.clip_mode, CLIP_MODES, owner=self.flag_owner)
        self._check_clip_mode_knobs()
        _require_choice("tied_norm", self.tied_norm, TIED_NORMS, owner=self.flag_owner)
        _require_choice("accountant", self.accountant, ACCOUNTANTS, owner=self.flag_owner)

    def _check_clip_mode_knobs(self) -> None:
        """Each mode's own knobs in range, and none of them set under another mode (one line naming the flag)."""
        knobs = {
            "target_quantile": "quantile", "clip_learning_rate": "quantile", "count_noise_multiplier": "quantile",
            "automatic_stability": "automatic",
        }  # fmt: skip
        for field, mode in knobs.items():
            value = getattr(self, field)
            if value is not None and self.clip_mode != mode:
                raise ValueError(
                    f"{self.flag_owner}.{field} is a knob of clip_mode={mode!r}, but clip_mode={self.clip_mode!r}"
                )
        if self.target_quantile is not None and not is_finite_number(self.target_quantile, above=0, below=1):
            raise ValueError(f"{self.flag_owner}.target_quantile must be in (0, 1), got {self.target_quantile}")
        for field in ("clip_learning_rate", "count_noise_multiplier", "automatic_stability"):
            if getattr(self, field) is not None:
                require_finite(field, getattr(self, field), above=0.0, owner=self.flag_owner)
        if self.clip_learning_rate is not None and self.clip_learning_rate > CLIP_LEARNING_RATE_MAX:
            raise ValueError(
                f"{self.flag_owner}.clip_learning_rate={self.clip_learning_rate} is above {CLIP_LEARNING_RATE_MAX}: one "
                "update moves C by up to a factor e^η, so C would under- or overflow within a few steps (default 0.2)"
            )


CLIP_MODES = ("fixed", "quantile", "automatic")
CLIP_LEARNING_RATE_MAX = 5.0
"""The largest quantile-mode η: one update moves C by a factor e^η at most (e^5 ≈ 148)."""


def require_finite(
    field: str, value: float, *, above: float | None = None, at_least: float | None = None, owner: str = FLAG_OWNER
) -> None:
    """Refuse (one line naming ``<owner>.<field>``) a value that is not a finite number in the range."""
    if not is_finite_number(value, above=above, minimum=at_least):
        bounds = range_text(above=above, minimum=at_least)
        raise ValueError(f"{owner}.{field} must be a finite number{f' {bounds}' if bounds else ''}, got {value}")


def _require_choice(field: str, value: str, choices: tuple[str, ...], *, owner: str) -> None:
    if value not in choices:
        names = " or ".join(repr(choice) for choice in choices)
        raise ValueError(f"{owner}.{field} must be {names}, got {value!r}")
