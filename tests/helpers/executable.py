"""Running ``dplit`` as a user would: the real executable, or the same command inside the test process.

The executable: its path, and an environment free of this test run's DDP. In the test process
(:func:`run_dplit_in_process`): everything a run may change is put back afterwards.
"""

from __future__ import annotations

import io
import logging
import os
import random
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, TextIO

_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK")


def dplit_executable() -> str:
    """The ``dplit`` console script beside this interpreter (else the one on ``PATH``)."""
    executable = Path(sys.executable).with_name("dplit")
    return str(executable) if executable.exists() else "dplit"


def user_environment() -> dict[str, str]:
    """``os.environ`` without the launch variables earlier in-process DDP tests left (Lightning sets MASTER_PORT).

    Subprocesses that inherit one MASTER_PORT would all try to listen on it and fail with EADDRINUSE.
    """
    return {key: value for key, value in os.environ.items() if key not in _LAUNCH_VARIABLES and not key.startswith("PL_")}


def popen_receiving_ctrl_c(command: list[str], **options: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(command, **options)`` of a child in which Ctrl-C (SIGINT) raises KeyboardInterrupt.

    A test run started in the background (``cmd &`` in a script, as a CI runner may) ignores SIGINT, its children
    inherit that, and Python then never raises KeyboardInterrupt: a test that sends Ctrl-C would wait forever. While
    the child starts, this process catches SIGINT (Python's own handler), and a caught signal is reset to its default
    action by ``exec``; no code runs between fork and exec (``preexec_fn`` is unsafe in a threaded process).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, **options)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_dplit(*args: str, environment: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``dplit`` with ``args`` in :func:`user_environment` (or ``environment``), capturing its output."""
    return subprocess.run(
        [dplit_executable(), *args], capture_output=True, text=True, timeout=600, check=False,
        env=environment if environment is not None else user_environment(),
    )  # fmt: skip


def refusal_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one ``dplit: error:`` line of a refused run (exit code 2, no traceback), checked to be the only one."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("dplit: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def run_dplit_in_process(
    *args: str, environment: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run ``dplit`` with ``args`` inside this process, as :func:`run_dplit` would run the executable (seconds faster).

    It calls the console script's own function (``dplit.__main__.main``) with ``sys.argv``, ``os.environ``
    (:func:`user_environment`, or exactly ``environment``) and the working directory (``cwd``) set as the executable
    would see them, captures what it writes to ``sys.stdout``/``sys.stderr`` and to the logging handlers that write to
    a terminal stream, and turns its ``SystemExit`` into the exit code (an exception that escapes: exit 1 with its
    traceback on stderr, as Python prints it). Afterwards it restores every piece of process state a run may change
    (see :func:`_isolated_process_state`): the next test sees this process as it was. A ``KeyboardInterrupt``
    propagates (the user stopped the tests).

    Not faithful for what a process fixes once at start-up: environment variables read at import time (``PYTHONPATH``,
    ``HF_HUB_OFFLINE``), modules already imported, and the console script itself. Those stay on :func:`run_dplit`.
    """
    from dplit.__main__ import main

    stdout, stderr = io.StringIO(), io.StringIO()
    environment = environment if environment is not None else user_environment()
    with _isolated_process_state(environment, cwd), _captured(stdout, stderr):
        sys.argv = [dplit_executable(), *args]
        try:
            main(list(args))
            code = 0
        except SystemExit as stop:
            code = _exit_status(stop, stderr)
        except Exception:  # noqa: BLE001 (any error that escapes is what the interpreter prints before exiting 1)
            stderr.write(traceback.format_exc())
            code = 1
    return subprocess.CompletedProcess(["dplit", *args], code, stdout.getvalue(), stderr.getvalue())


def _exit_status(stop: SystemExit, stderr: TextIO) -> int:
    """The exit status of a process that ``stop`` ends (a message instead of a number is printed, status 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=stderr)
    return 1


_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
"""The signals whose handlers Lightning (SIGTERM, SLURM's SIGUSR1) or ``dplit export`` (SIGINT) may replace."""


@contextmanager
def _isolated_process_state(environment: dict[str, str], cwd: Path | None) -> Iterator[None]:
    """Run the body in ``environment`` and ``cwd``; then restore the process state a ``dplit`` run can change.

    Restored: ``os.environ`` (Lightning sets MASTER_ADDR/MASTER_PORT, seeding sets PL_GLOBAL_SEED), the working
    directory, ``sys.argv``, ``sys.path``, the warnings filters and ``showwarning``, every logger's handlers, filters,
    level and propagation (and ``logging.disable``), the handlers of :data:`_SIGNALS`, torch's default dtype and
    thread count, the random generators (torch, NumPy, ``random``); a torch.distributed process group the run
    started (DPStrategy is a one-process DDP strategy; Lightning leaves it to an atexit handler) is destroyed. One
    that an earlier in-process test left is neither the run's nor destroyed: the run joins it, as Lightning does.
    """
    import numpy as np
    import torch

    saved_environment, saved_cwd, saved_argv, saved_path = dict(os.environ), os.getcwd(), sys.argv, list(sys.path)
    saved_loggers = _logger_state()
    saved_disable = logging.root.manager.disable
    saved_signals = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    saved_dtype, saved_threads = torch.get_default_dtype(), torch.get_num_threads()
    saved_random = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    distributed = torch.distributed.is_available()
    group_before = distributed and torch.distributed.is_initialized()
    os.environ.clear()
    os.environ.update(environment)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():
            yield
    finally:
        if distributed and not group_before and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_environment)
        os.chdir(saved_cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        for logger, (handlers, filters, level, propagate, disabled) in saved_loggers.items():
            logger.handlers[:], logger.filters[:] = handlers, filters
            logger.propagate, logger.disabled = propagate, disabled
            logger.setLevel(level)
        logging.disable(saved_disable)
        for signum, handler in saved_signals.items():
            if handler is not None:  # None: set outside Python, cannot be put back (and was not replaced)
                signal.signal(signum, handler)
        torch.set_default_dtype(saved_dtype)
        torch.set_num_threads(saved_threads)
        torch.random.set_rng_state(saved_random[0])
        np.random.set_state(saved_random[1])
        random.setstate(saved_random[2])


def _logger_state() -> dict[logging.Logger, tuple[list[logging.Handler], list[Any], int, bool, bool]]:
    """Every logger (the root included) → its handlers, filters, level, propagate and disabled flags."""
    named = [logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    loggers = [logging.root, *named]
    return {
        logger: (list(logger.handlers), list(logger.filters), logger.level, logger.propagate, logger.disabled)
        for logger in loggers
    }


@contextmanager
def _captured(stdout: TextIO, stderr: TextIO) -> Iterator[None]:
    """``sys.stdout``/``sys.stderr`` into ``stdout``/``stderr``, and the logging handlers that write to a terminal stream.

    Lightning's loggers got a ``StreamHandler`` bound to the ``sys.stderr`` of their import (pytest's capture, here): in
    the executable that is the process's stderr, so here it writes into ``stderr`` too (one bound to stdout: into
    ``stdout``). pytest's own log capture is left alone; file handlers are not terminal streams. What C++ code writes
    to the file descriptors themselves (torch's own warnings) is not captured: the checks do not need it.
    """
    handlers = [handler for logger in _logger_state() for handler in logger.handlers if _writes_to_a_terminal(handler)]
    streams = {handler: handler.stream for handler in handlers}
    for handler, stream in streams.items():
        handler.stream = stdout if stream is sys.stdout or stream is sys.__stdout__ else stderr
    try:
        with redirect_stdout(stdout), redirect_stderr(stderr):
            yield
    finally:
        for handler, stream in streams.items():
            handler.stream = stream


def _writes_to_a_terminal(handler: logging.Handler) -> bool:
    """Whether ``handler`` is a ``StreamHandler`` with its own stream: not a file, nor pytest's log capture.

    logging's last resort has no stream of its own: it writes to whatever ``sys.stderr`` is at the time.
    """
    return (
        isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        and not type(handler).__module__.startswith("_pytest") and "stream" in vars(handler)
    )  # fmt: skip
