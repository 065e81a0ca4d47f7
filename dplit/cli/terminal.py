"""What the ``dplit`` command shows at the terminal: privacy warnings that stand out, no noise a user cannot act on.

It imports neither torch nor Lightning at module level: ``dplit --help`` and a mistyped command answer at once.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

COMMANDS = {
    "fit": "train a classifier privately with DP-SGD (GLUE tasks, the built-in synthetic task)",
    "validate": "evaluate a classifier (--ckpt_path: a checkpoint) on the validation split",
    "test": "evaluate a classifier on the test split (GLUE's dev set)",
    "audit": "train once with canaries and measure an empirical lower bound on ε",
    "export": "write a checkpoint as a Hugging Face model folder with its DP model card",
    "lm fit": "train a causal language model privately on next-token loss over a text corpus",
    "lm validate": "validation loss and perplexity of a language model (--ckpt_path: a checkpoint)",
    "lm audit": "the privacy audit of dplit audit, for a language model",
    "lm export": "export a language-model checkpoint (as dplit export)",
    "lm generate": "sample synthetic text from an exported private language model",
    "dpo fit": "preference-tune a causal language model privately (DPO), one preference pair per privacy unit",
    "dpo validate": "DPO loss, reward accuracy and margins of a preference model on the validation pairs",
    "dpo test": "as dpo validate (the validation pairs)",
}
"""Every ``dplit`` command → one line saying what it does."""

HELP_FLAGS = ("-h", "--help")
GROUPS = ("lm", "dpo")
"""The command groups: ``dplit lm ...``, ``dplit dpo ...``."""


def help_text() -> str:
    """``dplit --help``: every command with a line each, and where to start."""
    width = max(map(len, COMMANDS)) + 2
    lines = [f"  {name:<{width}}{what}" for name, what in COMMANDS.items()]
    return "\n".join([
        "usage: dplit <command> [--config FILE.yaml] [--section.flag VALUE ...]",
        "",
        "Differentially private (DP-SGD) fine-tuning of causal language models with PyTorch Lightning.",
        "",
        "commands:",
        *lines,
        "",
        "dplit <command> --help lists every flag of a command. Start with:",
        "  dplit fit --config configs/quickstart.yaml",
        "  dplit lm fit --config configs/lm_quickstart.yaml",
        "  dplit dpo fit --config configs/dpo_quickstart.yaml",
    ])  # fmt: skip


def front_door(argv: list[str]) -> int | None:
    """Answer ``dplit``, ``dplit --help``, ``dplit lm --help`` and a mistyped command without importing torch.

    Returns:
        The exit status when it answered (help: 0, an unknown command: 2), ``None`` to run the command.
    """
    words = argv[1:] if argv[:1] and argv[0] in GROUPS else argv
    if not words or words[0] in HELP_FLAGS:
        print(help_text())
        return 0
    if words[0].startswith("-"):  # a flag before the command (``dplit -c run.yaml fit``): Lightning's parser reads it
        return None
    message = unknown_command(argv)
    if message is None:
        return None
    print(f"dplit: error: {message}", file=sys.stderr)
    return 2


def unknown_command(argv: list[str]) -> str | None:
    """The one-line refusal of a command ``argv`` does not start with (with a did-you-mean); ``None`` if it does."""
    lm = bool(argv[:1]) and argv[0] in GROUPS
    given = " ".join(argv[:2]) if lm else argv[0]
    if given in COMMANDS:
        return None
    candidates = [name for name in COMMANDS if name.startswith(f"{argv[0]} ")] if lm else list(COMMANDS)
    close = difflib.get_close_matches(given, candidates, n=1, cutoff=0.7)
    hint = f" (did you mean 'dplit {close[0]}'?)" if close else ""
    return f"invalid choice: {argv[1 if lm else 0]!r}{hint}; the commands: {', '.join(COMMANDS)} (dplit --help)"


UNACTIONABLE_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's pytree use under new torch
    r"Optimal order is the largest alpha",  # opacus' RDP analysis inside the PRV accountant and σ calibration
    r"The '(train|val)_dataloader' does not have many workers",  # workers do not help tokenised in-memory data
    r"LightningCLI's args parameter is intended",  # dplit passes its own command line on
    r"`loftq_config` specified but will be ignored",  # the CLI fills peft.LoraConfig's default LoftQ settings in
    # Poisson sampling draws every batch afresh, so resuming mid-epoch (an interrupt checkpoint) loses nothing:
    r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
    # a resumed run writes into a new version folder by design, so its checkpoint folder always differs:
    r"The dirpath has changed from",
)
"""Messages of dependencies' warnings that every run would print and no user setting can address."""

UNACTIONABLE_INFO = (
    re.compile(r"^💡 Tip: "),  # advertisements for Lightning's cloud products
    re.compile(r"^Loading `train_dataloader` to estimate number of stepping batches"),
    re.compile(r"^Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1$"),
    re.compile(r"All distributed processes registered\. Starting with 1 processes"),
)
"""Lightning's info lines that carry nothing for a single-process dplit run."""

_LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.distributed",
    "lightning.pytorch.utilities.distributed",
)


class _DropUnactionable(logging.Filter):
    """Drops Lightning's info lines listed in :data:`UNACTIONABLE_INFO`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage().strip()
        return not any(pattern.search(message) for pattern in UNACTIONABLE_INFO)


def show_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
    line: str | None = None,
) -> None:  # fmt: skip
    """``warnings.showwarning`` for the terminal: a :class:`PrivacyWarning` as one ``dplit: WARNING:`` line.

    dplit's other warnings are one ``dplit: warning:`` line; dependencies' keep Python's format.
    """
    from dplit.privacy.warnings import PrivacyWarning

    text = " ".join(str(message).split())
    if issubclass(category, PrivacyWarning):
        print(f"dplit: WARNING: {text}", file=file or sys.stderr)
    elif Path(filename).resolve().is_relative_to(_PACKAGE):
        print(f"dplit: warning: {text}", file=file or sys.stderr)
    else:
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


_PACKAGE = Path(__file__).resolve().parent.parent  # dplit/ (this file is dplit/cli/terminal.py)


@contextmanager
def terminal_output() -> Iterator[None]:
    """While the command runs: show privacy warnings prominently, drop dependencies' unactionable noise.

    transformers' per-load progress bars ("Loading weights", "Writing model shards") are off: every command loads a
    model, and the bars bury the lines that matter.
    """
    from transformers.utils import logging as transformers_logging

    from dplit.privacy.warnings import PrivacyWarning

    noise = _DropUnactionable()
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    with warnings.catch_warnings():
        for pattern in UNACTIONABLE_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        warnings.simplefilter("always", PrivacyWarning)
        warnings.showwarning = show_warning
        for logger in loggers:
            logger.addFilter(noise)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(noise)
            if bars:
                transformers_logging.enable_progress_bar()


def dependency_refusal(error: BaseException) -> str | None:
    """Lightning's or torch's own refusal of a setting as one line naming the settings; ``None`` for other errors.

    Two kinds, told apart by what raised them rather than by their wording:

    * Lightning's ``MisconfigurationException`` (its type for settings that cannot work: ``devices=0``, an
      accelerator the machine lacks, ...); raised while the ``Trainer`` is built, the line starts with the
      ``trainer.accelerator`` and ``trainer.devices`` it was given.
    * an error raised while ``torch.distributed`` starts the process group (a backend torch was not built with,
      a port in use, ...); the line names ``process_group_backend`` and the rendezvous address.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    frames = list(_frames(error))
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, MisconfigurationException):
        trainer = _locals_of(frames, "lightning.pytorch.trainer.trainer", "__init__")
        if trainer is None:
            return text
        return f"trainer.accelerator={trainer.get('accelerator')!r}, trainer.devices={trainer.get('devices')!r}: {text}"
    group = _locals_of(frames, "torch.distributed.distributed_c10d", "init_process_group")
    if group is None or not isinstance(error, RuntimeError):
        return None
    address = f"MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, MASTER_PORT={os.environ.get('MASTER_PORT')!r}"
    return (
        f"torch.distributed could not start the process group (trainer.strategy.init_args.process_group_backend="
        f"{group.get('backend')!r}, {address}): {text}"
    )


def _frames(error: BaseException) -> Iterator[FrameType]:
    """The frames ``error`` passed through, outermost first."""
    trace = error.__traceback__
    while trace is not None:
        yield trace.tb_frame
        trace = trace.tb_next


def _locals_of(frames: list[FrameType], module: str, function: str) -> dict[str, Any] | None:
    """The local variables of the innermost call of ``module.function`` among ``frames`` (``None``: no such call)."""
    for frame in reversed(frames):
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return frame.f_locals
    return None
