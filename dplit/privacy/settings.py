"""DPSGDSettings: every DP-SGD knob, one docstring per field, validated once when the settings are made."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from typing import Literal

from dplit.numbers import is_finite_number, range_text
from dplit.privacy.accounting import DELTA_MAX, Mechanism
from dplit.privacy.refusal import DEFAULT_OWNER

CLIPPING_ENGINES = ("ghost", "per_example")
TIED_NORMS = ("exact", "bound")
ACCOUNTANTS = ("prv", "rdp")
FLAG_OWNER = DEFAULT_OWNER
"""Where a user sets these knobs (``trainer.strategy.init_args.<field>``): every refusal names ``<strategy>.<field>``."""


@dataclass(frozen=True)
class DPSGDSettings:
    """The knobs of one DP-SGD run (Abadi et al. 2016, Algorithm 1, with Poisson sampling).

    Every value is checked when the settings are made, so a bad config fails before any data is read, in one line
    naming ``<strategy>.<field>`` (:attr:`flag_owner`).
    """

    max_grad_norm: float
    """C: every example's whole gradient (all trainable parameters, a tied weight counted once as the sum of its uses)
    is clipped to norm ≤ C, and the noise's standard deviation is σ·C (the initial C_0 under ``clip_mode: quantile``;
    the update's scale under ``clip_mode: automatic``)."""

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
    """σ: the noise added to the summed clipped gradients has std σ·C; give this **or** ``target_epsilon``. 0 adds no
    noise (not private: warns)."""

    target_epsilon: float | None = None
    """Calibrate σ so that the weights' whole privacy history (earlier runs included) spends at most this ε over the
    planned steps (``trainer.max_epochs`` / ``max_steps``); training stops before a step that would spend more (also
    when resumed for longer)."""

    target_delta: float | None = None
    """δ; default N^-1.1 for N training examples. δ ≥ 1/N is refused unless ``allow_large_delta``."""

    accountant: Mechanism = "prv"
    """``"prv"`` (the tighter numerical accountant, default) or ``"rdp"`` (Rényi DP, an upper bound)."""

    clipping: Literal["ghost", "per_example"] = "ghost"
    """``"ghost"``: per-example norms from activations and output gradients, one backward; ``"per_example"``:
    materialised per-example gradients with ``torch.func`` (the exact reference for any model, memory B × parameters;
    needs ``model.attn_implementation: eager``)."""

    tied_norm: Literal["exact", "bound"] = "exact"
    """For a parameter used twice (tied embeddings), ghost only: ``"exact"`` (with the cross term) or ``"bound"``
    (‖G₁‖ + ‖G₂‖, over-clips)."""

    max_physical_batch_size: int = 32
    """The largest micro-batch run through the model at once, per device: bounds memory, does not change the maths."""

    self_check: bool = True
    """Before the first DP step, compare the ghost engine's per-parameter norms of a few real examples with
    autograd's (one backward per example, model in train mode with every dropout disabled, under the trainer's
    precision) and refuse the run, naming the parameter and the relative disagreement (never a norm: norms are
    computed from private examples), on any disagreement or on a trainable parameter no covered layer used."""

    seed: int | None = None
    """Unset (default): the Poisson sampler and the noise are seeded from the operating system's entropy
    (``secrets``), independent of ``seed_everything``, never logged or checkpointed, the noise generator reseeded
    every step and fresh after a resume. A seed makes both reproducible **and PREDICTABLE** from the config: it warns,
    the ledger records ``"noise_secure": false``, and the weights are NOT differentially private for good (tests and
    debugging, never a release)."""

    allow_large_delta: bool = False
    """Accept δ ≥ 1/N (a δ that large permits releasing whole examples); warns when used."""

    private_diagnostics: bool = True
    """Log the diagnostics computed from private batches without noise (``train/loss``, ``dp/*``, ``perf/*``,
    ``memory/*``, the training split's longest prompt): none is covered by ε. ``False`` logs none of them (when logs
    leave the trust boundary)."""

    public_change: str | None = None
    """Your statement that the weights' changes no recorded step explains (a training loop outside dplit,
    ``load_state_dict``, an edit) used no private data, e.g. ``"2 epochs on public Wikipedia text"``. Without it such
    a change makes the weights NOT differentially private for good; with it the change is recorded as public and
    the model card quotes the statement verbatim. Used only when such a change is found before the fit; remove it
    from the config once used."""

    people_overlap: bool | None = None
    """Your statement, when the weights start from a dplit export (e.g. DP-DPO after a DP SFT run): whether this run's
    training data holds people who are also in the data of the DP segments the weights already carry. ``true`` (the
    same users gave both): ε composes every segment, and protects a person in both datasets for one unit of each
    together. ``false`` (no person in both; dplit does not check it): ε still composes every segment, and the card
    also states each dataset's own ε, what a person in that dataset only has. Unset: not stated, composed as if they
    overlap. Recorded in this run's segment of the weights' history; the card says how the segments compose."""

    flag_owner: str = FLAG_OWNER
    """The strategy whose flags the refusals name (:data:`~dplit.privacy.refusal.DEFAULT_OWNER` unless the strategy says otherwise)."""

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
            raise ValueError(
                f"{self.flag_owner}.max_physical_batch_size must be ≥ 1, got {self.max_physical_batch_size}"
            )
        _require_choice("clipping", self.clipping, CLIPPING_ENGINES, owner=self.flag_owner)
        _require_choice("clip_mode", self.clip_mode, CLIP_MODES, owner=self.flag_owner)
        self._check_clip_mode_knobs()
        _require_choice("tied_norm", self.tied_norm, TIED_NORMS, owner=self.flag_owner)
        _require_choice("accountant", self.accountant, ACCOUNTANTS, owner=self.flag_owner)
        if self.public_change is not None and (
            not isinstance(self.public_change, str) or not self.public_change.strip()
        ):
            raise ValueError(
                f"{self.flag_owner}.public_change must be a non-empty statement of what was done, got {self.public_change!r}"
            )
        if self.people_overlap is not None and not isinstance(self.people_overlap, bool):
            raise ValueError(
                f"{self.flag_owner}.people_overlap must be true, false or null, got {self.people_overlap!r}"
            )

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


def knob_docs() -> dict[str, str]:
    """Each knob's docstring (the string under its field in :class:`DPSGDSettings`), by name, ``flag_owner`` left out."""
    tree = ast.parse(inspect.getsource(DPSGDSettings))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, after in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr):
            docs[field.target.id] = inspect.cleandoc(str(after.value.value))  # type: ignore[attr-defined]
    docs.pop("flag_owner", None)
    return docs


def knobs_table() -> str:
    """The markdown table of every knob and its docstring (``docs/reference/dp-knobs.md`` holds it, generated)."""
    cell = {name: _markdown(" ".join(doc.split())) for name, doc in knob_docs().items()}
    rows = [f"| `{name}` | {text} |" for name, text in cell.items()]
    return "\n".join(["| knob | meaning |", "|---|---|", *rows])


def _markdown(text: str) -> str:
    """A docstring's reStructuredText roles and literals as markdown, ``|`` escaped for a table cell."""
    text = re.sub(r":(?:mod|class|func|meth|data):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", r"\|")


if __name__ == "__main__":  # python -m dplit.privacy.settings: the table docs/reference/dp-knobs.md shows
    print(knobs_table())
