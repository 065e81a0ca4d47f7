"""The content digest of a model's weights: what the privacy history binds itself to.

A privacy history is true only of the weights it describes. dplit records the weights' digest at every boundary it
knows (construction from a public starting point, each DP segment's end, each checkpoint) and compares it at the next
one, so a change no recorded step explains (a plain training loop, ``load_state_dict``, an edit through ``.data``)
is found whatever route it took. A tensor's version counter would miss an edit through ``.data``; a digest does not.

The digest is a SHA-256 over every entry's name, full shape and values, chosen to be the same wherever the same
values are held:

* **dtype**: a floating tensor is hashed in the narrowest of bfloat16, float32 and float64 that holds its values
  exactly (a float32 model converted by ``trainer.precision="64-true"`` hashes as before; bfloat16 weights cost
  their own 2 bytes per entry); a lossless conversion does not look like a change, a rounding does;
* **sharding**: each dim-0 row is hashed on its own, and a FSDP2 ``DTensor`` (sharded on dim 0) hashes the rows its
  rank holds; the ranks' row digests are gathered in rank order, so a sharded model and the same model whole give
  the same digest;
* **device**: tensors are read on the CPU.

Cost: one pass of SHA-256 over the weights in that dtype (~1.5 GB/s per CPU core with SHA extensions; tensors are
hashed on a thread pool) plus one hash call per row; ``python -m bench.content_digest`` measures it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

Gather = Callable[[Any], list[Any]]
"""``gather(value)``: every rank's ``value``, in rank order (for one process: ``[value]``)."""


def content_digest(state: Mapping[str, Any], *, gather: Gather | None = None) -> str:
    """SHA-256 (hex) of every tensor of ``state`` by name, full shape and value (see the module docstring).

    Tensors are hashed on a pool of threads (hashlib releases the GIL), one tensor per task.

    Args:
        state: a state dict (plain tensors or dim-0-sharded ``DTensor`` s; other values are skipped).
        gather: collects the ranks' row digests when ``state`` holds ``DTensor`` s (every rank must call).

    Raises:
        ValueError: for a ``DTensor`` without ``gather``, or one not sharded on dim 0 alone.
    """
    names = sorted(name for name, value in state.items() if isinstance(value, Tensor))
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        local = list(pool.map(lambda name: _local_rows_of(name, state[name]), names))
    digest = hashlib.sha256(b"dplit weights v1")
    for name, rows in zip(names, local, strict=True):
        if isinstance(state[name], DTensor):
            rows = _gathered(name, rows, gather)
        digest.update(f"{name} {tuple(state[name].shape)} {len(rows)}\n".encode())
        digest.update(b"".join(rows))
    return digest.hexdigest()


def _local_rows_of(name: str, value: Tensor) -> list[bytes]:
    """The row digests of the rows this rank holds (a ``DTensor``'s local shard; checked to be dim-0 sharded)."""
    if not isinstance(value, DTensor):
        return _local_row_digests(value.detach())
    if any(not placement.is_shard(dim=0) for placement in value.placements):
        raise ValueError(f"content_digest: {name} is not sharded on dim 0 alone ({value.placements})")
    return _local_row_digests(value.to_local().detach())


def _gathered(name: str, rows: list[bytes], gather: Gather | None) -> list[bytes]:
    """Every rank's row digests of one sharded tensor, in rank order (its rows in order)."""
    if gather is None:
        raise ValueError(f"content_digest: {name} is a sharded DTensor: pass gather (the ranks' collective)")
    return [row for rank_rows in gather(rows) for row in rank_rows]


def _local_row_digests(tensor: Tensor) -> list[bytes]:
    """The SHA-256 of each dim-0 row, each in its own canonical dtype (so a shard's rows hash as the whole's do)."""
    tensor = tensor.cpu()
    count = tensor.shape[0] if tensor.dim() else 1  # a rank's shard may hold no row
    rows = tensor.reshape(count, tensor.numel() // count if count else 0)  # [rows, entries per row]
    forms = _canonical_forms(rows)  # [(tag, bytes per row [rows, width·size], which rows)]
    digests: list[bytes] = [b""] * count
    for tag, data, chosen in forms:
        for index in chosen:
            digests[index] = _sha256(tag, data[index])
    return digests


def _canonical_forms(rows: Tensor) -> list[tuple[bytes, Any, list[int]]]:
    """Each row in the narrowest of bfloat16, float32, float64 that holds its values exactly (non-floating: as is).

    Returns:
        ``(dtype tag, the rows' bytes in that dtype, the rows that take it)`` for each dtype used.
    """
    if not rows.is_floating_point():
        return [(str(rows.dtype).encode(), _bytes(rows), list(range(rows.shape[0])))]
    forms, left = [], torch.ones(rows.shape[0], dtype=torch.bool)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        exact = left if _holds_every(dtype, rows.dtype) else left & _round_trips(rows, dtype)  # [rows]
        chosen = exact.nonzero().flatten().tolist()
        if chosen:
            narrow = rows.to(dtype)
            if narrow.isnan().any():
                narrow = torch.where(narrow.isnan(), torch.tensor(float("nan"), dtype=dtype), narrow)  # one NaN
            forms.append((str(dtype).encode(), _bytes(narrow), chosen))
        left = left & ~exact
        if not left.any():
            break
    return forms


def _round_trips(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """[rows] whether every value of a row is a value of ``dtype`` (a NaN counts as one)."""
    if rows.dtype == torch.float32 and dtype == torch.bfloat16:  # bfloat16 is float32's top 16 bits
        return ((rows.view(torch.int32) & 0xFFFF) == 0).logical_or_(rows.isnan()).all(dim=1)
    back = rows.to(dtype).to(rows.dtype)
    return ((back == rows) | (back.isnan() & rows.isnan())).all(dim=1)


def _holds_every(wide: torch.dtype, source: torch.dtype) -> bool:
    """Whether every value of ``source`` is a value of ``wide`` (bfloat16 and float16 in float32; all in float64)."""
    return wide == source or wide == torch.float64 or (wide == torch.float32 and source.itemsize <= 4)


def _bytes(rows: Tensor) -> Any:
    """The rows' bytes as a numpy array [rows, bytes per row] (hashlib reads each row's buffer)."""
    return rows.contiguous().view(torch.uint8).numpy()


def _sha256(tag: bytes, row: Any) -> bytes:
    digest = hashlib.sha256(tag)
    digest.update(row)
    return digest.digest()
