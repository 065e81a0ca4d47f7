"""The ``dplit`` command line: every subcommand dispatched, a refusal shown as one line, inherited launch variables.

``dplit.__main__`` answers help and a mistyped command before importing this module (it imports torch and
Lightning); everything else arrives at :func:`main`, which dispatches to the classifier and LM CLIs
(:mod:`dplit.cli`), ``dplit audit`` (:mod:`dplit.audit.command`), ``dplit export`` and ``dplit lm generate``
(:mod:`dplit.release.commands`).
"""

from __future__ import annotations

import os
import sys
import warnings

from lightning.pytorch.cli import ArgsType

from dplit.audit.command import audit_main
from dplit.cli import run_cli, run_lm_cli
from dplit.release.commands import export_main, generate_main
from dplit.terminal import dependency_refusal, front_door, terminal_output

REFUSALS = (ValueError, TypeError, FloatingPointError, FileNotFoundError)
"""What dplit raises for a bad config, bad data or an unsafe setting: shown as one line, not a traceback."""


def main(args: ArgsType = None) -> None:
    """Entry point of ``dplit fit|validate|test|audit|export`` and ``dplit lm fit|validate|audit|generate|export``.

    ``dplit``, ``dplit --help`` and an unknown command are answered by :func:`dplit.terminal.front_door` (one
    help listing every command; a did-you-mean).

    torch.distributed variables that a parent process exported for itself are dropped first, in one warning line
    (see :func:`drop_inherited_launch_variables`). A refusal (one of :data:`REFUSALS`, or Lightning's or torch's
    own refusal of a setting: see :func:`dplit.terminal.dependency_refusal`) prints ``dplit: error: <message>`` on
    one line and exits 2; ``--debug`` or ``DPLIT_DEBUG=1`` shows the traceback instead.
    """
    argv = list(sys.argv[1:] if args is None else args)
    inherited = drop_inherited_launch_variables()
    if inherited:
        print(f"dplit: warning: {inherited_message(inherited)}", file=sys.stderr)
    debug = "--debug" in argv or os.environ.get("DPLIT_DEBUG") == "1"
    argv = [arg for arg in argv if arg != "--debug"]
    status = front_door(argv)  # help and a mistyped command (the console script answers them before importing us)
    if status is not None:
        raise SystemExit(status)
    try:
        with terminal_output():
            _run(argv)
    except Exception as error:
        message = refusal_message(error)
        if debug or message is None:
            raise
        print(f"dplit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


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


def refusal_message(error: Exception) -> str | None:
    """The one line a refusal prints (``None``: not a refusal, so its traceback is shown)."""
    if isinstance(error, REFUSALS):
        return " ".join(str(error).split())
    return dependency_refusal(error)


def _run(argv: list[str]) -> None:
    """Run the classifier CLI, the ``dplit lm`` one, ``dplit audit``, ``dplit export`` or ``dplit lm generate``."""
    with warnings.catch_warnings():  # the command line is passed on as args (without --debug)
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        if argv[:1] == ["audit"] or argv[:2] == ["lm", "audit"]:
            audit_main(argv[argv.index("audit") + 1 :], lm=argv[0] == "lm")
        elif argv[:1] == ["export"] or argv[:2] == ["lm", "export"]:
            export_main(argv[argv.index("export") + 1 :])
        elif argv[:2] == ["lm", "generate"]:
            generate_main(argv[2:])
        elif argv[:1] == ["lm"]:
            run_lm_cli(argv[1:])
        else:
            run_cli(argv)
