"""The ``dplit`` command line: every command dispatched from one table, a refusal shown as one line.

``dplit.__main__`` answers help and a mistyped command before importing this module (it imports torch and
Lightning); everything else arrives at :func:`main`, which looks the command up in :data:`RUNNERS`: the classifier
and LM LightningCLIs (:mod:`dplit.cli.lightning_cli`), ``dplit audit`` (:mod:`dplit.cli.audit`), ``dplit export``
and ``dplit lm generate`` (:mod:`dplit.cli.release`).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from functools import partial

from lightning.pytorch.cli import ArgsType

from dplit.cli.audit import audit_main
from dplit.cli.launch import (
    destroy_process_group_started,
    drop_inherited_launch_variables,
    inherited_message,
    process_group_initialized,
)
from dplit.cli.lightning_cli import run_cli, run_dpo_cli, run_lm_cli
from dplit.cli.release import export_main, generate_main
from dplit.cli.terminal import dependency_refusal, front_door, terminal_output

Runner = Callable[[list[str]], object]
"""Runs one command on the arguments that follow its name."""


def lightning(run: Callable[[ArgsType], object], subcommand: str) -> Runner:
    """The runner of a LightningCLI ``subcommand``: LightningCLI reads the subcommand itself, so it comes first."""
    return lambda args: run([subcommand, *args])


RUNNERS: dict[str, Runner] = {
    "fit": lightning(run_cli, "fit"),
    "validate": lightning(run_cli, "validate"),
    "test": lightning(run_cli, "test"),
    "audit": partial(audit_main, lm=False),
    "export": export_main,
    "lm fit": lightning(run_lm_cli, "fit"),
    "lm validate": lightning(run_lm_cli, "validate"),
    "lm audit": partial(audit_main, lm=True),
    "lm export": export_main,
    "lm generate": generate_main,
    "": run_cli,  # flags before the command (``dplit -c run.yaml fit``): LightningCLI finds the subcommand among them
    "lm": run_lm_cli,
    "dpo fit": lightning(run_dpo_cli, "fit"),
    "dpo validate": lightning(run_dpo_cli, "validate"),
    "dpo test": lightning(run_dpo_cli, "test"),
    "dpo": run_dpo_cli,
}
"""Every command of :data:`dplit.cli.terminal.COMMANDS` (and a group whose flags come first) → what runs it."""

REFUSALS = (ValueError, TypeError, FloatingPointError, FileNotFoundError)
"""What dplit raises for a bad config, bad data or an unsafe setting: shown as one line, not a traceback."""


def main(args: ArgsType = None) -> None:
    """Entry point of ``dplit fit|...``, ``dplit lm fit|validate|audit|generate|export``, ``dplit dpo fit|...``.

    ``dplit``, ``dplit --help`` and an unknown command are answered by :func:`dplit.cli.terminal.front_door` (one
    help listing every command; a did-you-mean).

    torch.distributed variables that a parent process exported for itself are dropped first, in one warning line
    (see :func:`dplit.cli.launch.drop_inherited_launch_variables`). A refusal (one of :data:`REFUSALS`, or
    Lightning's or torch's own refusal of a setting: see :func:`dplit.cli.terminal.dependency_refusal`) prints
    ``dplit: error: <message>`` on one line and exits 2; ``--debug`` or ``DPLIT_DEBUG=1`` shows the traceback instead.
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
    command, arguments = split_command(argv)
    group_before = process_group_initialized()
    try:
        with terminal_output(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")  # we pass argv on
            RUNNERS[command](arguments)
    except Exception as error:
        message = refusal_message(error)
        if debug or message is None:
            raise
        print(f"dplit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        destroy_process_group_started(initialized_before=group_before)


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """``(command, its arguments)``: ``lm fit --config x.yaml`` → ``("lm fit", ["--config", "x.yaml"])``.

    When a flag comes before the command (``dplit -c run.yaml fit``) the command is its group, ``""`` or ``"lm"``,
    and the arguments are all that follow the group.
    """
    group = argv[:1] if argv[:1] in (["lm"], ["dpo"]) else []
    words = argv[len(group) :]
    if words and not words[0].startswith("-"):
        return " ".join([*group, words[0]]), words[1:]
    return " ".join(group), words


def refusal_message(error: Exception) -> str | None:
    """The one line a refusal prints (``None``: not a refusal, so its traceback is shown)."""
    if isinstance(error, REFUSALS):
        return " ".join(str(error).split())
    return dependency_refusal(error)
