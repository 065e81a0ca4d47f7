"""Running the real ``dplit`` executable as a user would: its path, and an environment free of this test run's DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
