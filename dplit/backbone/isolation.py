"""Documents isolated inside packed rows: block-diagonal causal attention and positions restarting per document.

transformers' mask builders (``masking_utils.create_causal_mask``) pass a 4-D mask through as given, so a packed
row's isolation is an explicit additive mask [B, 1, T, T]: 0 where query t may attend to key s (same document,
s ≤ t), the dtype's lowest value elsewhere. Eager and SDPA attention add it to the scores. Attention kernels that
take no such mask (flash attention's varlen path relies on ``position_ids`` instead) are refused here for now:
:func:`isolation_refusal` names why, in one line, before any step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SEGMENT_KEY = "segment_ids"
"""The batch key of each token's document (0..D-1 within the batch, -1 for padding): [R, T]."""
POSITION_KEY = "position_ids"
"""The batch key of each token's position within its document (restarting at 0): [R, T]."""
ISOLATING_ATTENTION = ("eager", "sdpa")
"""Attention implementations that apply a 4-D additive mask exactly (so documents in one row never meet)."""


def isolating_mask(segment_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The attention mask [B, 1, T, T] letting each token see its own document's earlier tokens only.

    Args:
        segment_ids: [B, T] each token's document (-1: padding, which sees only itself and is seen by no one).
        dtype: ``torch.bool`` (True: attend; what SDPA takes whatever the autocast dtype), or the floating dtype of
            an additive mask (0 or the dtype's lowest value; eager attention adds it to the scores).
    """
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]: query t, key s
    positions = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    causal = positions[None, :, None] >= positions[None, None, :]  # [1, T, T]: s ≤ t
    padding = segment_ids < 0
    own = torch.eye(segment_ids.shape[1], dtype=torch.bool, device=segment_ids.device)[None]  # [1, T, T]
    allowed = (same & causal & ~padding[:, None, :]) | (own & padding[:, :, None])  # padding: itself only
    if dtype == torch.bool:
        return allowed[:, None]  # [B, 1, T, T]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]  # [B, 1, T, T]


def model_mask(model: nn.Module, segment_ids: Tensor) -> Tensor:
    """:func:`isolating_mask` in the form ``model``'s attention takes: boolean for SDPA, additive for eager.

    The additive mask is in the dtype of the model's floating-point weights (float32 for a quantised base).
    """
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        return isolating_mask(segment_ids, torch.bool)
    floating = (p.dtype for p in model.parameters() if p.is_floating_point())
    return isolating_mask(segment_ids, next(floating, torch.float32))


def isolation_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot isolate packed documents (one line), or ``None`` when it can."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ISOLATING_ATTENTION:
        return (
            f"data.packing=true: attention implementation {implementation!r} of this model cannot isolate the "
            f"documents of a packed row (dplit passes a 4-D block-diagonal mask, applied by "
            f"{' and '.join(ISOLATING_ATTENTION)}): set model.attn_implementation to sdpa or eager, or data.packing=false"
        )
    return None
