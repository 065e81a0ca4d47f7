"""Activation checkpointing: each transformer block's activations are recomputed in the backward pass.

transformers' own switch (``activation_checkpointing_enable``), always non-reentrant: the recomputed forward runs
with autograd on, so the ghost engine sees each call inside a block again; it keeps none of a block's inputs
through the forward pass, takes each from the replay, pairs it with its own output gradient and counts every use
once (:mod:`dplit.privacy.clipping.recorder`; a reentrant checkpoint runs the first forward under ``no_grad``,
which the engine refuses). Blocks are recomputed in training mode only.
"""

from __future__ import annotations

from transformers import PreTrainedModel


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute ``model``'s transformer blocks in the backward pass (non-reentrant ``torch.utils.checkpoint``).

    Raises:
        ValueError: naming ``model.gradient_checkpointing`` when the family does not support it.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):  # transformers 5 keeps this attribute's name
        raise ValueError(
            f"model.gradient_checkpointing=true: {type(model).__name__} does not support activation checkpointing "
            "in transformers; set it to false"
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
