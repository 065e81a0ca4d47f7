"""The ``dplit`` command: LightningCLI over CausalLMClassifier and GlueDataModule, driven by YAML."""

from __future__ import annotations

import os
import re
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

from dplit.data import GlueDataModule
from dplit.data.text import TextDataModule
from dplit.lm import CausalLanguageModel
from dplit.model import CausalLMClassifier

_LIGHTNING_CKPT_ALIASES = ("last", "best", "hpc")
_PRIVACY_NUMBERS = {
    "max_grad_norm": "a finite number > 0",
    "noise_multiplier": "a finite number ≥ 0",
    "target_epsilon": "a finite number > 0",
    "target_delta": "a number in (0, 1)",
}
_KEY = re.compile(r"(?:Parser key \"|NestedArg\(key=')(?P<key>[^\"']+)")
_VALUE = re.compile(r"(?:Given value: |Got value: |val=')(?P<value>[^'\n)]*)")
_UNION_NOISE = ("Expected a ", "Given value", "Subtypes", "Does not validate", "Errors:", "Got value", "Parser key")


def essential_error(message: str) -> str:
    """The line of a jsonargparse union/nested error that states the broken rule (the whole message if none does)."""
    key, value = _KEY.search(message), _VALUE.search(message)
    if key is not None and value is not None and "Expected a <class 'float'>" in message:
        name = key["key"].split(".")[-1]
        if name in _PRIVACY_NUMBERS:
            return f"trainer.strategy.init_args.{name}={value['value']!r}: must be {_PRIVACY_NUMBERS[name]}"
        return f"{key['key']}={value['value']!r} is not a number"
    for line in message.splitlines():
        text = line.strip().lstrip("- ").strip()
        noise = not text or text.startswith(_UNION_NOISE)
        if not noise and ("DPStrategy" in text or "must be" in text or "set exactly one" in text):
            return text
    return message


class DPLitArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors show the broken rule in one line instead of jsonargparse's union dump."""

    @override
    def error(self, message: str, *args: Any, **kwargs: Any) -> NoReturn:
        self.exit(2, f"dplit: error: {essential_error(message)}\n")


class DPLitCLI(LightningCLI):
    """LightningCLI that feeds the data's label words, vocabulary size, task and length limit into the model."""

    links: tuple[tuple[str, str], ...] = (
        ("data.label_word_ids", "model.label_word_ids"),
        ("data.num_classes", "model.num_classes"),
        ("data.vocab_size", "model.vocab_size"),
        ("data.task", "model.task"),
        ("data.max_length", "model.max_length"),
    )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for source, target in self.links:
            parser.link_arguments(source, target, apply_on="instantiate")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            check_checkpoint_path(self.config[subcommand].get("ckpt_path"))

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            essential = essential_error(str(error))
            if essential == str(error):
                raise
            raise ValueError(essential) from None


class DPLitLMCLI(DPLitCLI):
    """The ``dplit lm`` command: CausalLanguageModel on TextDataModule (vocabulary size and length linked)."""

    links = (("data.vocab_size", "model.vocab_size"), ("data.max_length", "model.max_length"))


def check_checkpoint_path(ckpt_path: str | None) -> None:
    """Refuse a ``--ckpt_path`` that does not exist or is not a checkpoint, in one line naming it."""
    if (
        ckpt_path is None
        or ckpt_path in _LIGHTNING_CKPT_ALIASES
        or "://" in ckpt_path
        or ckpt_path.startswith("registry")
    ):
        return
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise ValueError(f"--ckpt_path {ckpt_path}: no such file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"--ckpt_path {ckpt_path}: not a checkpoint (not a file written by torch.save / Lightning)")


def run_cli(args: ArgsType = None) -> DPLitCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), run the subcommand and return the CLI (trainer, model, data)."""
    return DPLitCLI(CausalLMClassifier, GlueDataModule, parser_class=DPLitArgumentParser, args=args)


def run_lm_cli(args: ArgsType = None) -> DPLitLMCLI:
    """Like :func:`run_cli`, for private next-token fine-tuning (``dplit lm fit --config configs/lm_X.yaml``)."""
    return DPLitLMCLI(CausalLanguageModel, TextDataModule, parser_class=DPLitArgumentParser, args=args)


REFUSALS = (ValueError, TypeError, FloatingPointError, FileNotFoundError)
"""What dplit raises for a bad config, bad data or an unsafe setting: shown as one line, not a traceback."""


def main(args: ArgsType = None) -> None:
    """Entry point of ``dplit fit|validate|test --config X.yaml`` and ``dplit lm fit|validate --config X.yaml``.

    A refusal prints ``dplit: error: <message>`` on one line and exits 2; ``--debug`` or ``DPLIT_DEBUG=1`` shows
    the traceback instead.
    """
    argv = list(sys.argv[1:] if args is None else args)
    debug = "--debug" in argv or os.environ.get("DPLIT_DEBUG") == "1"
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        _run(argv)
    except REFUSALS as error:
        if debug:
            raise
        message = " ".join(str(error).split())  # one line
        print(f"dplit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def _run(argv: list[str]) -> None:
    """Run the classifier CLI, or the ``dplit lm`` one."""
    with warnings.catch_warnings():  # the command line is passed on as args (without --debug)
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        if argv[:1] == ["lm"]:
            run_lm_cli(argv[1:])
        else:
            run_cli(argv)
