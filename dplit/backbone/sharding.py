"""Sharding a task with FSDP2: each transformer block is one unit; the task itself, the root, holds the rest.

The block classes come from the HF model's own ``_no_split_modules`` (``GPT2Block``, ``LlamaDecoderLayer``,
``Qwen2DecoderLayer``, ...), so any family dplit loads is wrapped the same way. The root unit holds the embeddings,
the final norm and the head: a tied input/output embedding is one parameter there. Its weights are gathered when the
task's ``forward`` runs, so the task reaches its backbone only through ``forward``. Every rank must start from the
same weights: rank 0's are broadcast first.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from transformers import PreTrainedModel

from dplit.backbone.quantization import quantized_modules


def shard_task(task: nn.Module, mesh: DeviceMesh, *, entry_points: tuple[str, ...] = ()) -> None:
    """Shard ``task.backbone``'s transformer blocks, one unit each, then ``task`` as the root unit.

    Args:
        task: a module with a ``backbone`` causal LM (a :class:`~dplit.tasks.base.CausalLMModule`).
        mesh: a one-dimensional device mesh over the data-parallel ranks.
        entry_points: methods of ``task`` besides ``forward`` that reach the backbone (e.g. text generation): the
            root's weights are gathered around them too.
    """
    refuse_quantized_base(task)
    for tensor in [*task.parameters(), *task.buffers()]:
        dist.broadcast(tensor.data, src=0, group=mesh.get_group())
    backbone: nn.Module = task.backbone
    for block in transformer_blocks(backbone):
        fully_shard(block, mesh=mesh)
    fully_shard(task, mesh=mesh, reshard_after_forward=True)  # the root too: outside a step, every weight is a shard
    for name in entry_points:
        register_fsdp_forward_method(task, name)


def shard_frozen_copy(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard a frozen causal LM held outside the task (DPO's reference copy) as :func:`shard_task` shards the task.

    Its weights are first made rank 0's on every rank (as the task's are), then each transformer block and the
    model itself become FSDP2 units over ``mesh``: every rank holds a shard, and each forward pass gathers them.
    """
    refuse_quantized_base(model)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0, group=mesh.get_group())
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def refuse_quantized_base(task: nn.Module) -> None:
    """Refuse a bitsandbytes-quantised base in one line: FSDP2 cannot shard its packed integer weights."""
    layer = next((name for name, _ in quantized_modules(task)), None)
    if layer is not None:
        raise ValueError(
            f"model.quantization cannot be sharded by FSDP2 (dplit.strategy.ShardedDPStrategy; {layer} is quantised): "
            "train a quantised base with dplit.strategy.DPStrategy"
        )


def transformer_blocks(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's transformer blocks: instances of the classes its HF model names in ``_no_split_modules``."""
    model = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    names = set(getattr(model, "_no_split_modules", None) or []) if isinstance(model, PreTrainedModel) else set()
    blocks = [module for module in backbone.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class (_no_split_modules): dplit cannot shard it"
        )
    return blocks
