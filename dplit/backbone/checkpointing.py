"""Activation checkpointing: each transformer block's activations are recomputed in the backward pass.

transformers' own switch (``activation_checkpointing_enable``), always non-reentrant: the recomputed forward runs
with autograd on, so the ghost engine sees each call inside a block again; it keeps none of a block's inputs
through the forward pass, takes each from the replay, pairs it with its own output gradient and counts every use
once (:mod:`dplit.privacy.clipping.recorder`; a reentrant checkpoint runs the first forward under ``no_grad``,
which the engine refuses). Blocks are recomputed in training mode only.
"""

from __future__ import annotations

import math

from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from dplit.numbers import require_finite_number


def enable_activation_checkpointing(model: PreTrainedModel, *, share: float = 1.0) -> int:
    """Recompute ``model``'s transformer blocks in the backward pass (non-reentrant ``torch.utils.checkpoint``).

    Args:
        model: the transformers model.
        share: the share of its blocks recomputed, the first ⌈share · blocks⌉ of them; the others keep their
            activations (less time, more memory: ``model.checkpointed_share``).

    Returns:
        The number of blocks recomputed.

    Raises:
        ValueError: naming ``model.gradient_checkpointing`` when the family does not support it, or
            ``model.checkpointed_share`` when it is not in (0, 1].
    """
    share = require_finite_number(share, name="model.checkpointed_share", above=0, maximum=1)
    if not getattr(model, "supports_gradient_checkpointing", False):  # transformers 5 keeps this attribute's name
        raise ValueError(
            f"model.gradient_checkpointing=true: {type(model).__name__} does not support activation checkpointing "
            "in transformers; set it to false"
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not blocks:
        raise ValueError(
            f"model.gradient_checkpointing=true: {type(model).__name__} has no transformer block transformers can "
            "recompute; set it to false"
        )
    recomputed = max(1, math.ceil(share * len(blocks) - 1e-9))  # 0.65 of 30 blocks: 20 (no rounding up to 21)
    for block in blocks[recomputed:]:
        block.gradient_checkpointing = False
    return recomputed
