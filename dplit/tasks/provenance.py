"""What a dplit checkpoint records so that it can be released without the run's config: classes, policy, commit."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
from pathlib import Path
from typing import Any

from torch.distributed.fsdp import FSDPModule

import dplit
from dplit.backbone.embeddings import EmbeddingPolicy, is_tied

RELEASE_KEY = "dplit_release"
"""The checkpoint entry holding :func:`release_record`."""


def release_record(module: Any, datamodule: Any | None) -> dict[str, Any]:
    """The classes of the run, its embedding policy and the dplit that trained it (plain types, no data values).

    Args:
        module: the dplit LightningModule being checkpointed.
        datamodule: the trainer's datamodule (``None`` when the loaders were given directly).
    """
    return {
        "module": _class_path(module),
        "datamodule": _class_path(datamodule) if datamodule is not None else None,
        "embeddings": policy_record(module.embeddings),
        "tied": is_tied(module.backbone),
        "dplit_version": dplit.__version__,
        "dplit_commit": source_commit(),
    }


def policy_record(policy: EmbeddingPolicy) -> dict[str, Any]:
    """``{class_path, init_args}`` of an embedding policy (a frozen dataclass)."""
    return {"class_path": _class_path(policy), "init_args": dataclasses.asdict(policy)}


@functools.cache
def source_commit() -> str | None:
    """The git commit of the dplit source tree in use (``+dirty`` with uncommitted changes), ``None`` if not a checkout."""
    root = Path(dplit.__file__).resolve().parent.parent
    try:
        head = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no", "--", "dplit")
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10)
    return done.stdout.strip()


def _class_path(value: Any) -> str:
    """``module.QualName`` of ``value``'s class; for a module FSDP2 sharded (``FSDP<Class>``), of the class it wraps."""
    kind = type(value)
    if issubclass(kind, FSDPModule):
        kind = next(base for base in kind.__mro__ if not issubclass(base, FSDPModule))
    return f"{kind.__module__}.{kind.__qualname__}"
