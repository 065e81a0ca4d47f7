"""A fingerprint of the training rows, so data-parallel ranks can check they Poisson-sample the same dataset.

Each rank samples a disjoint shard of the dataset's indices at the global rate q. That is one Poisson sample of N
rows only if every rank's dataset holds the same rows in the same order; a split or shuffle that is not seeded
breaks it silently (a row sampled by two ranks is clipped and summed twice: sensitivity 2C, rate 2q − q²). The
fingerprint is a SHA-256 over every example's content; it is compared between ranks and never logged.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch


class IndexedRows(Protocol):
    """A map-style dataset: ``len`` and integer indexing."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def rows_fingerprint(dataset: IndexedRows) -> str:
    """SHA-256 over N and every example ``dataset[0 .. N-1]`` (tensors by dtype, shape and bytes), in order."""
    digest = hashlib.sha256(f"rows {len(dataset)}".encode())
    for index in range(len(dataset)):
        _feed(digest, dataset[index])
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    """Add ``value`` to ``digest`` unambiguously (type tags and lengths before contents)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {flat.dtype} {tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"map {len(value)}".encode())
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"seq {len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        digest.update(f"{type(value).__name__} {value!r}".encode())
    else:
        digest.update(pickle.dumps(value, protocol=4))
