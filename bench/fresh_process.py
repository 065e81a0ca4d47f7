"""One benchmark arm per fresh process: a fork of a forkserver that has only imported the libraries it names.

The forkserver holds no tensor and never initialises CUDA (torch's documented way to use CUDA in subprocesses,
besides spawn), so an arm's peak memory is its own, without paying the imports (seconds) per arm.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def process_context(device: str, preload: list[str]) -> Any:
    """A forkserver context that has imported ``preload``.

    On the CPU it starts with ``MALLOC_MMAP_THRESHOLD_=65536``, which its forks keep: RSS then follows live tensors.
    """
    if device == "cpu":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # glibc reads it as the forkserver starts
    else:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # should anything ask is_available() before the forks
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


def _child(measure: Callable[..., dict[str, Any]], arguments: tuple[Any, ...], name: str, out: str) -> None:
    """The arm's process: measure, write the record to ``out`` (a failure is recorded, not raised)."""
    try:
        record = measure(*arguments)
    except Exception as error:  # noqa: BLE001  (a failed arm is a row, the others still run)
        record = {"arm": name, "status": "failed", "message": f"{type(error).__name__}: {error}"[:500]}
    Path(out).write_text(json.dumps(record))


def run_fresh(context: Any, measure: Callable[..., dict[str, Any]], *arguments: Any, name: str) -> dict[str, Any]:
    """``measure(*arguments)`` (a module-level function) in a fresh process of ``context``: its record, or why not."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "arm.json")
        process = context.Process(target=_child, args=(measure, arguments, name, str(out)))
        process.start()
        process.join()
        if not out.exists():
            return {"arm": name, "status": "failed", "message": f"the process exited with code {process.exitcode}"}
        return json.loads(out.read_text())
