"""The content digest of a model's weights: what the privacy history binds itself to.

A privacy history is true only of the weights it describes. dplit records the weights' digest at every boundary it
knows (construction from a public starting point, each DP segment's end, each checkpoint) and compares it at the next
one, so a change no recorded step explains (a plain training loop, ``load_state_dict``, an edit through ``.data``)
is found whatever route it took. A tensor's version counter would miss an edit through ``.data``; a digest does not.

The digest is a SHA-256 over every entry's name, full shape and values, chosen to be the same wherever the same
values are held:

* **dtype**: a floating tensor is hashed as float32 when its values are exactly float32 values (bfloat16, float16,
  float32, and float64 holding float32 values, as a float32 model converted by ``trainer.precision="64-true"``),
  as float64 otherwise; a lossless conversion does not look like a change, a rounding does;
* **sharding**: each dim-0 row is hashed on its own, and a FSDP2 ``DTensor`` (sharded on dim 0) hashes the rows its
  rank holds; the ranks' row digests are gathered in rank order, so a sharded model and the same model whole give
  the same digest;
* **device**: tensors are read on the CPU.

Cost: one pass of SHA-256 over the weights (float32 bytes: ~1.5 GB/s on a CPU core with SHA extensions) plus one
hash call per row; ``python -m bench.content_digest`` measures it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

Gather = Callable[[Any], list[Any]]
"""``gather(value)``: every rank's ``value``, in rank order (for one process: ``[value]``)."""


def content_digest(state: Mapping[str, Any], *, gather: Gather | None = None) -> str:
    """SHA-256 (hex) of every tensor of ``state`` by name, full shape and value (see the module docstring).

    Args:
        state: a state dict (plain tensors or dim-0-sharded ``DTensor`` s; other values are skipped).
        gather: collects the ranks' row digests when ``state`` holds ``DTensor`` s (every rank must call).

    Raises:
        ValueError: for a ``DTensor`` without ``gather``, or one not sharded on dim 0 alone.
    """
    digest = hashlib.sha256(b"dplit weights v1")
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, Tensor):
            continue
        rows = _row_digests(name, value, gather)
        digest.update(f"{name} {tuple(value.shape)} {len(rows)}\n".encode())
        digest.update(b"".join(rows))
    return digest.hexdigest()


def _row_digests(name: str, value: Tensor, gather: Gather | None) -> list[bytes]:
    """The SHA-256 of each dim-0 row of ``value`` (its dtype tag included), all ranks' rows for a ``DTensor``."""
    if not isinstance(value, DTensor):
        return _local_row_digests(value.detach())
    if gather is None:
        raise ValueError(f"content_digest: {name} is a sharded DTensor: pass gather (the ranks' collective)")
    if any(not placement.is_shard(dim=0) for placement in value.placements):
        raise ValueError(f"content_digest: {name} is not sharded on dim 0 alone ({value.placements})")
    return [row for rank_rows in gather(_local_row_digests(value.to_local().detach())) for row in rank_rows]


def _local_row_digests(tensor: Tensor) -> list[bytes]:
    canonical = _canonical(tensor.cpu())
    tag = str(canonical.dtype).encode()
    count = canonical.shape[0] if canonical.dim() else 1  # a rank's shard may hold no row
    rows = canonical.reshape(count, canonical.numel() // count if count else 0)  # [rows, entries per row]
    data = rows.contiguous().view(torch.uint8).numpy()  # [rows, bytes per row]
    return [_sha256(tag, data[index]) for index in range(rows.shape[0])]


def _sha256(tag: bytes, row: Any) -> bytes:
    digest = hashlib.sha256(tag)
    digest.update(row)
    return digest.digest()


def _canonical(tensor: Tensor) -> Tensor:
    """``tensor`` as float32 when that holds its values exactly, as float64 when not; non-floating unchanged."""
    if not tensor.is_floating_point():
        return tensor
    single = tensor.float()
    if tensor.dtype == torch.float64 and not torch.equal(single.double(), tensor):
        return tensor
    return single
