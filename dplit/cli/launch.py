"""torch.distributed around one command: launch variables trusted or dropped; the group it started, destroyed."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch.distributed as dist
from lightning.pytorch import Trainer

LAUNCH_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
)  # fmt: skip
"""The torch.distributed variables that tell a process it is one rank of a multi-process job, and where to meet."""

LAUNCHERS = {
    "TORCHELASTIC_RUN_ID": "torchrun",
    "SLURM_NTASKS": "SLURM",
    "OMPI_COMM_WORLD_SIZE": "Open MPI",
    "PMI_SIZE": "MPI",
    "LSB_JOBID": "LSF",
    "DPLIT_LAUNCHED": "the user (DPLIT_LAUNCHED=1)",
}
"""A variable each launcher sets in the processes it starts → the launcher."""


def drop_inherited_launch_variables() -> list[str]:
    """Remove the :data:`LAUNCH_VARIABLES` that dplit inherited from the process that started it; return their names.

    dplit trusts them only when a launcher started it (a variable of :data:`LAUNCHERS` is set: torchrun, SLURM,
    MPI, LSF, or ``DPLIT_LAUNCHED=1`` from a user who starts the ranks by hand) or when it is a worker that
    Lightning's own launcher started for a multi-device dplit run (``LOCAL_RANK`` ≥ 1). Otherwise they are what a
    parent exported for itself: Lightning sets ``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK``/``NODE_RANK`` in
    the process of an in-process ``trainer.fit``, and a ``dplit`` started from that process would try to join the
    parent's (finished) process group on a port the parent still holds.
    """
    if any(name in os.environ for name in LAUNCHERS) or os.environ.get("LOCAL_RANK", "0") != "0":
        return []
    found = [name for name in LAUNCH_VARIABLES if name in os.environ]
    for name in found:
        del os.environ[name]
    return found


def inherited_message(names: list[str]) -> str:
    """The warning for launch variables :func:`drop_inherited_launch_variables` dropped."""
    return (
        f"ignoring {', '.join(names)}: inherited from the process that started dplit, not set by a launcher "
        "(torchrun, SLURM, MPI, LSF); set DPLIT_LAUNCHED=1 if you start the ranks of a multi-process run yourself"
    )


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity: ``taskset``, a container's CPU set), else all of them."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def oversubscription_message(processes: int, cores: int) -> str | None:
    """The warning for more CPU training processes than cores (``None``: they fit)."""
    if processes <= cores:
        return None
    return (
        f"trainer.devices={processes} starts {processes} training processes on {cores} CPU core(s): they take turns "
        f"on the cores, so each step is slower than with trainer.devices={cores} (the guarantee is the same)"
    )


def sigterm_without_collective(trainer: Trainer) -> None:
    """Make ``trainer``'s SIGTERM handler issue no collective (Lightning's broadcasts from inside the handler).

    A signal handler runs between whatever collectives its rank is issuing at that moment, so the ranks'
    in-handler broadcasts can pair with other collectives (FSDP2 issues many per step) and a sharded run preempted by
    SIGTERM hung. Lightning's training loop broadcasts rank 0's SIGTERM flag before every batch anyway, so every rank
    still stops at the same batch; the handler only records the signal and forwards it to the ranks it launched.
    """
    connector = trainer._signal_connector

    def notify(signum: int, frame: FrameType | None) -> None:
        if not connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify


def process_group_initialized() -> bool:
    """Whether a default torch.distributed process group exists in this process now."""
    return dist.is_available() and dist.is_initialized()


def destroy_process_group_started(*, initialized_before: bool) -> None:
    """Destroy the default process group if this command started it (``initialized_before`` is False).

    Released in Python, before the interpreter shuts down, rather than left to an ``atexit`` handler: torch asks
    for an explicit ``destroy_process_group``, and a group torn down during interpreter shutdown may abort in its
    C++ destructors. A group the caller had before (an in-process call) is left as it was. A failure to destroy
    it (e.g. a peer already gone) is one warning line: it never replaces the command's own outcome.
    """
    if initialized_before or not process_group_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001  (a peer already gone: the command's own outcome stands)
        print(f"dplit: warning: the process group was not destroyed cleanly ({type(error).__name__})", file=sys.stderr)
