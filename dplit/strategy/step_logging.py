"""What a DP step logs: the privacy spent and the clipping bound (public), and the clipping diagnostics (private).

``privacy/*`` and ``dp/clip_bound`` (and quantile clipping's noisy ``dp/clip_quantile_estimate``) are public;
the other ``train/*`` and ``dp/*`` values are computed from private batches without noise, and are logged only
with ``private_diagnostics``.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from dplit.privacy.dpsgd import DPSGD


def log_clipping(module: LightningModule, losses: Tensor, norms: Tensor, max_grad_norm: float) -> Tensor:
    """Log the logical batch's loss, clip fraction, mean norm and dropped (non-finite) examples; return the loss."""
    loss, norm = losses.float(), norms.float()
    size = loss.shape[0]
    finite = torch.isfinite(norm)
    module.log("train/loss", loss.mean(), batch_size=size, prog_bar=True)
    module.log("dp/clip_fraction", (norm > max_grad_norm).float().mean(), batch_size=size)
    mean_norm = norm.where(finite, 0.0).sum() / finite.sum().clamp(min=1)  # no device sync in the training step
    module.log("dp/grad_norm", mean_norm, batch_size=size)
    module.log("dp/dropped_examples", (~finite).sum().float(), batch_size=1, reduce_fx="sum")
    return loss.mean()


def log_spend(module: LightningModule, dpsgd: DPSGD) -> None:
    """Log ε so far (when it was refreshed at this step), σ and the number of DP steps (all public)."""
    if dpsgd.budget.epsilon_steps == dpsgd.budget.steps:
        module.log(
            "privacy/epsilon", dpsgd.budget.epsilon_spent, on_step=True, on_epoch=False, prog_bar=True, batch_size=1
        )
    module.log("privacy/noise_multiplier", float(dpsgd.noise_multiplier or 0.0), on_step=True, batch_size=1)
    module.log("privacy/steps", float(dpsgd.budget.steps), on_step=True, batch_size=1)
    module.log("dp/clip_bound", dpsgd.clip_bound, on_step=True, batch_size=1)  # C of the next step (public)
    estimate = dpsgd.bound.last_estimate
    if estimate is not None:  # the noisy share of unclipped examples that moved C (part of the mechanism)
        module.log("dp/clip_quantile_estimate", float(estimate), on_step=True, batch_size=1)
