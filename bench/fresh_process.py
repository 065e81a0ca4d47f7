"""One benchmark arm per fresh process: a fork of a forkserver that has only imported the libraries it names.

The forkserver holds no tensor and never initialises CUDA (torch's documented way to use CUDA in subprocesses,
besides spawn), so an arm's peak memory is its own, without paying the imports (seconds) per arm. A fork starts with
the server's resident pages (the imported libraries: what a spawned process imports before it builds anything), so
peak RSS counts them as it would in a spawn. :func:`run_fresh` runs one process per arm (``bench.memory``),
:func:`run_ranks` the ranks of a process group (``bench.fsdp``), which the forks create themselves.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def process_context(device: str, preload: list[str], *, follow_tensors: bool = True) -> Any:
    """A forkserver context that has imported ``preload``.

    On the CPU with ``follow_tensors`` it starts with ``MALLOC_MMAP_THRESHOLD_=65536``, which its forks keep: RSS then
    follows live tensors (without it, glibc's defaults: freed buffers stay resident, as in any process).
    """
    if device == "cpu":
        if follow_tensors:
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


def _rank(target: Callable[..., None], rank: int, arguments: tuple[Any, ...], out: str) -> None:
    """One rank's process: ``target(rank, *arguments)``; an exception is written to ``out`` (then raised)."""
    try:
        target(rank, *arguments)
    except BaseException as error:
        Path(out).write_text(f"{type(error).__name__}: {error}")
        raise


def run_ranks(context: Any, target: Callable[..., None], world_size: int, *arguments: Any) -> None:
    """``target(rank, *arguments)`` (a module-level function) in ``world_size`` fresh processes of ``context`` at once.

    Like ``torch.multiprocessing.start_processes``: when a rank fails, the others are killed (they would wait for it
    in a collective), and a ``RuntimeError`` says which rank failed and why.
    """
    with tempfile.TemporaryDirectory() as scratch:
        errors = [Path(scratch, f"rank{rank}.error") for rank in range(world_size)]
        processes = [context.Process(target=_rank, args=(target, rank, arguments, str(errors[rank])))
                     for rank in range(world_size)]  # fmt: skip
        try:
            for process in processes:
                process.start()
            running = {process.sentinel: rank for rank, process in enumerate(processes)}
            while running:
                for sentinel in multiprocessing.connection.wait(list(running)):
                    rank = running.pop(sentinel)
                    processes[rank].join()
                    if processes[rank].exitcode != 0:
                        why = errors[rank].read_text() if errors[rank].exists() else "no exception recorded"
                        raise RuntimeError(f"rank {rank} exited with code {processes[rank].exitcode}: {why}")
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                if process.pid is not None:
                    process.join()
