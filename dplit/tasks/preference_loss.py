"""The preference losses of one pair from its four sequence log-probabilities: DPO (sigmoid), cDPO and IPO.

Each pair has the policy's and the reference's log-probabilities of its chosen and rejected answers (summed over
the answer's tokens). With the log-ratios ρ_w = log π(y_w|x) − log π_ref(y_w|x) and ρ_l likewise, h = ρ_w − ρ_l:

* ``"sigmoid"`` (DPO, Rafailov et al. 2023), with label smoothing ε (cDPO): −(1 − ε) log σ(βh) − ε log σ(−βh);
* ``"ipo"`` (Azar et al. 2023, length-normalised as TRL does): (ρ_w / n_w − ρ_l / n_l − 1 / (2β))², n the answer's
  token count.

βh is the pair's implicit reward margin (chosen reward β ρ_w minus rejected reward β ρ_l).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from dplit.numbers import is_finite_number

PreferenceLossType = Literal["sigmoid", "ipo"]
LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class PairLogProbs:
    """The four sequence log-probabilities of P pairs, each [P], and the answers' token counts (IPO).

    Attributes:
        policy_chosen: log π(y_w | x).
        policy_rejected: log π(y_l | x).
        reference_chosen: log π_ref(y_w | x) (no gradient).
        reference_rejected: log π_ref(y_l | x) (no gradient).
        chosen_tokens: the chosen answers' token counts (``None``: not needed, the sigmoid loss).
        rejected_tokens: the rejected answers' token counts.
    """

    policy_chosen: Tensor
    policy_rejected: Tensor
    reference_chosen: Tensor
    reference_rejected: Tensor
    chosen_tokens: Tensor | None = None
    rejected_tokens: Tensor | None = None

    def margins(self, beta: float) -> Tensor:
        """The implicit reward margins β h [P] (positive: the policy prefers the chosen answer more than the reference)."""
        return beta * self.log_ratio_difference()

    def log_ratio_difference(self) -> Tensor:
        """The log-ratio difference h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)) [P]."""
        return (self.policy_chosen - self.reference_chosen) - (self.policy_rejected - self.reference_rejected)


def check_preference_settings(beta: float, label_smoothing: float, loss_type: str) -> None:
    """Refuse, in one line naming the flag, β ≤ 0, ε outside [0, 0.5) and an unknown loss."""
    if not is_finite_number(beta, above=0):
        raise ValueError(
            f"model.beta={beta!r}: must be a finite number > 0 (the strength of the pull to the reference)"
        )
    if not is_finite_number(label_smoothing, minimum=0, below=0.5):
        raise ValueError(f"model.label_smoothing={label_smoothing!r}: must be in [0, 0.5) (cDPO's label noise)")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"model.loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("model.label_smoothing applies to model.loss_type=sigmoid only (cDPO); set it to 0 for ipo")


def preference_losses(
    pairs: PairLogProbs, *, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid"
) -> Tensor:
    """Each pair's loss [P].

    Args:
        pairs: the four log-probabilities (and, for IPO, the token counts) of each pair.
        beta: β > 0 (DPO's temperature; IPO's regulariser τ).
        label_smoothing: ε in [0, 0.5), the assumed share of flipped labels (cDPO; sigmoid only).
        loss_type: ``"sigmoid"`` (DPO / cDPO) or ``"ipo"``.
    """
    if loss_type == "sigmoid":
        logits = beta * pairs.log_ratio_difference()
        return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    if loss_type == "ipo":
        if pairs.chosen_tokens is None or pairs.rejected_tokens is None:
            raise ValueError("the ipo loss needs the chosen and rejected answers' token counts")
        chosen = (pairs.policy_chosen - pairs.reference_chosen) / pairs.chosen_tokens.clamp(min=1)
        rejected = (pairs.policy_rejected - pairs.reference_rejected) / pairs.rejected_tokens.clamp(min=1)
        return (chosen - rejected - 1 / (2 * beta)) ** 2
    raise ValueError(f"model.loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
