"""The ``dplit`` command: LightningCLI over CausalLMClassifier and GlueDataModule, driven by YAML."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import yaml
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from dplit.callbacks import use_plain_summary, use_quiet_progress_bar
from dplit.data import GlueDataModule
from dplit.data.text import TextDataModule
from dplit.privacy.ledger import LEDGER_FILE
from dplit.privacy.warnings import PrivacyWarning
from dplit.release.checkpoint import check_checkpoint_file
from dplit.strategy import INTERRUPT_CHECKPOINT, DPStrategy
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel

_LIGHTNING_CKPT_ALIASES = ("last", "best", "hpc")
_PRIVACY_NUMBERS = {
    "max_grad_norm": "a finite number > 0",
    "noise_multiplier": "a finite number ≥ 0",
    "target_epsilon": "a finite number > 0",
    "target_delta": "a number in (0, 1)",
}
_KEY = re.compile(r"(?:Parser key \"|NestedArg\(key=')(?P<key>[^\"']+)")
_VALUE = re.compile(r"(?:Given value: |Got value: |val=')(?P<value>[^'\n)]*)")
_SINGLE_TYPE = re.compile(r"Expected a (?P<kind><class '[a-z]+'>)")
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
    if key is not None and "Errors:" in message:
        return _union_error(key["key"], message)
    single = _SINGLE_TYPE.search(message)
    if key is not None and value is not None and single is not None:  # a plain-typed flag given another type
        return f"{key['key']}={value['value']!r}: expected {_expected(single['kind'])}"
    return message


def _union_error(key: str, message: str) -> str:
    """``key: <why>`` from jsonargparse's dump of a value that matches no type of a union (``X | None``).

    A value of none of the union's types reads ``key='maybe': expected true or false or an integer``.
    """
    reasons = _reasons(message.split("Errors:", 1)[1])
    reasons = [reason for reason in reasons if not reason.startswith("Expected a <class 'NoneType'>")]
    hint = f" ({key} takes {{class_path: peft.LoraConfig, init_args: {{...}}}})" if "PeftConfig" in message else ""
    value = _VALUE.search(message)
    if value is not None and reasons and all(reason.startswith("Expected a ") for reason in reasons):
        expected = " or ".join(_expected(reason.removeprefix("Expected a ")) for reason in reasons)
        return f"{key}={value['value']!r}: expected {expected}{hint}"
    return f"{key}: {reasons[0] if reasons else 'invalid value'}{hint}"


def _reasons(errors: str) -> list[str]:
    """The ``- reason`` items of jsonargparse's ``Errors:`` list, each joined with its more-indented lines."""
    reasons: list[str] = []
    bullet = -1
    for line in errors.splitlines():
        indent, text = len(line) - len(line.lstrip()), line.strip()
        if text.startswith("- "):
            bullet = indent
            reasons.append(text[2:].strip())
        elif text and reasons and indent > bullet:
            reasons[-1] = f"{reasons[-1]} {text}"
        else:
            bullet = 10**6  # the dump goes on below the list (``Given value: ...``)
    return reasons


_TYPE_NAMES = {"<class 'bool'>": "true or false", "<class 'int'>": "an integer", "<class 'float'>": "a number",
               "<class 'str'>": "a string"}  # fmt: skip


def _expected(kind: str) -> str:
    """A type as jsonargparse prints it (``<class 'bool'>``, ``typing.Literal['a', 'b']``) in words."""
    if kind.startswith("typing.Literal[") and kind.endswith("]"):
        return f"one of {kind.removeprefix('typing.Literal[')[:-1]}"
    return _TYPE_NAMES.get(kind, kind)


class DPLitArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors show the broken rule in one line instead of jsonargparse's union dump."""

    @override
    def error(self, message: str, *args: Any, **kwargs: Any) -> NoReturn:
        self.exit(2, f"dplit: error: {essential_error(message)}\n")

    @override
    def parse_path(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Namespace:
        """Parse a ``--config`` file after refusing what YAML would read silently wrong (see :func:`check_config_file`)."""
        check_config_file(Path(path))
        check_config_command(Path(path), {action.dest for action in self._actions})
        return super().parse_path(path, *args, **kwargs)


COMMANDS = {"dplit fit": (CausalLMClassifier, GlueDataModule), "dplit lm fit": (CausalLanguageModel, TextDataModule)}
"""The command of each kind of run → its model and data classes, whose arguments its config sets."""


def check_config_command(path: Path, accepted: set[str]) -> None:
    """Refuse a ``--config`` written for the other kind of run (``dplit lm`` vs ``dplit``), naming its command.

    Args:
        path: the config file.
        accepted: the keys the running command's parser accepts (``model.head``, ``data.task``, ...).
    """
    try:
        settings = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return
    sections = {section: settings.get(section) for section in ("model", "data")} if isinstance(settings, dict) else {}
    unknown = [
        f"{section}.{key}" for section, values in sections.items() if isinstance(values, dict)
        for key in values if f"{section}.{key}" not in accepted
    ]  # fmt: skip
    for command, classes in COMMANDS.items():
        if unknown and all(_accepts(classes, key) for key in unknown):
            raise ValueError(
                f"--config {path}: a config for {command} (it sets {', '.join(unknown[:3])}, which this command "
                f"does not take): run {command} --config {path}"
            )


def _accepts(classes: tuple[type, type], key: str) -> bool:
    """Whether ``model.X`` / ``data.X`` is an argument of the model / data class of ``classes``."""
    section, _, name = key.partition(".")
    model, data = classes
    return name in inspect.signature(model if section == "model" else data).parameters


def check_config_file(path: Path) -> None:
    """Refuse a ``--config`` file that is empty, not a mapping of settings, or repeats a key in one mapping.

    YAML keeps the last of two equal keys without a word, so ``lr: 0.1`` written twice trains with the second.

    Raises:
        ValueError: naming the file, and for a repeated key its path in the config and the lines of both.
    """
    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # jsonargparse reports a file it cannot read or parse
    if root is None:
        raise ValueError(f"--config {path}: the file is empty (no settings)")
    if not isinstance(root, yaml.MappingNode):
        raise ValueError(f"--config {path}: not a YAML mapping of settings such as 'trainer:', 'model:', 'data:'")
    repeated = repeated_key(root)
    if repeated is not None:
        key, first, second = repeated
        raise ValueError(
            f"--config {path}: {key} is given twice (lines {first} and {second}); YAML would silently keep only the "
            "second: remove one"
        )


def repeated_key(node: yaml.Node, prefix: str = "") -> tuple[str, int, int] | None:
    """``(dotted key, first line, second line)`` of the first key given twice in one mapping under ``node``."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = repeated_key(item, f"{prefix}[{index}]")
            if found is not None:
                return found
    if not isinstance(node, yaml.MappingNode):
        return None
    lines: dict[str, int] = {}
    for key, value in node.value:
        name = f"{prefix}.{key.value}" if prefix else str(key.value)
        line = key.start_mark.line + 1
        if name in lines:
            return name, lines[name], line
        lines[name] = line
        found = repeated_key(value, name)
        if found is not None:
            return found
    return None


class DPLitCLI(LightningCLI):
    """LightningCLI that feeds the data's label words, vocabulary size, task and length limit into the model."""

    links: tuple[tuple[str, str], ...] = (
        ("data.label_word_ids", "model.label_word_ids"),
        ("data.num_classes", "model.num_classes"),
        ("data.vocab_size", "model.vocab_size"),
        ("data.task", "model.task"),
        ("data.max_length", "model.max_length"),
    )

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test`` (GLUE's dev split); no ``predict``: there is nothing to predict on."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--non_private", type=bool, default=False,
            help="Train without DPStrategy on purpose (no clipping, no noise, no privacy guarantee)",
        )  # fmt: skip
        for source, target in self.links:
            parser.link_arguments(source, target, apply_on="instantiate")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            config = self.config[subcommand]
            check_checkpoint_path(config.get("ckpt_path"), weights_only=config.get("weights_only") is not False)
            check_gguf_files(config)
            if subcommand == "fit" and not check_privacy_choice(config):
                rank_zero_warn(NON_PRIVATE_WARNING, category=PrivacyWarning)

    @override
    def _parse_ckpt_path(self) -> None:
        """Lightning replaces the ``model`` settings by the checkpoint's: refuse or name those that differ."""
        subcommand = self.config.get("subcommand")
        given = self.config[subcommand]["model"].clone() if subcommand else None
        super()._parse_ckpt_path()
        if given is not None:
            check_checkpoint_settings(given, self.config[subcommand]["model"])

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path last`` and record in the logged hyperparameters whether the run is private."""
        self._resolve_last_checkpoint()
        non_private = bool(self.config_init[self.subcommand].get("non_private"))
        for logger in self.trainer.loggers:
            logger.log_hyperparams({"non_private": non_private})

    def fit(self, **kwargs: Any) -> None:
        """``trainer.fit``; stopped by SIGTERM (a scheduler preempting the job), exit 143 saying how to resume.

        Lightning ends a run on SIGTERM with its ``SIGTERMException``, a ``SystemExit`` with status 0: the scheduler
        would record a preempted job as a success.
        """
        try:
            self.trainer.fit(**kwargs)
        except SIGTERMException:
            if self.trainer.is_global_zero:
                print(f"dplit: stopped by SIGTERM: {resume_hint(self.trainer)}", file=sys.stderr)
            raise SystemExit(PREEMPTED_EXIT) from None

    def after_fit(self) -> None:
        """One line saying where the checkpoint, the privacy ledger and the TensorBoard logs are, and the ε spent."""
        if self.trainer.is_global_zero and not self.trainer.interrupted:
            print(f"dplit: done: {run_summary(self.trainer)}")

    def before_validate(self) -> None:
        """Resolve ``--ckpt_path last``."""
        self._resolve_last_checkpoint()

    def before_test(self) -> None:
        """Resolve ``--ckpt_path last``."""
        self._resolve_last_checkpoint()

    def _resolve_last_checkpoint(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last":
            config["ckpt_path"] = str(find_last_checkpoint(self.trainer))
            rank_zero_info(f"--ckpt_path last: {config['ckpt_path']}")

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            essential = essential_error(str(error))
            if essential == str(error):
                raise
            raise ValueError(essential) from None

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, with dplit's default progress bar and model summary.

        The default progress bar loses ``v_num`` and the default summary its FLOPs column of zeros; a progress bar or
        summary the user configured is kept as it is.
        """
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init  # dplit audit: none
        configured = list(config.get("trainer", {}).get("callbacks") or [])
        trainer = super().instantiate_trainer(**kwargs)  # extends that very list with its defaults
        if not any(isinstance(callback, ProgressBar) for callback in configured):
            use_quiet_progress_bar(trainer)
        if not any(isinstance(callback, ModelSummary) for callback in configured):
            use_plain_summary(trainer)
        return trainer


class DPLitLMCLI(DPLitCLI):
    """The ``dplit lm`` command: CausalLanguageModel on TextDataModule (vocabulary size and length linked)."""

    links = (("data.vocab_size", "model.vocab_size"), ("data.max_length", "model.max_length"))

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` (a text corpus has no test split here, and nothing to predict)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}


PREEMPTED_EXIT = 128 + signal.SIGTERM
"""The exit status of a run stopped by SIGTERM (the shell's convention), so schedulers see it did not finish."""


def resume_hint(trainer: Trainer) -> str:
    """How to resume a run that SIGTERM stopped: the ``--ckpt_path`` of the ``interrupted.ckpt`` it saved."""
    saved = [path for path in checkpoint_folders(trainer) if (path / INTERRUPT_CHECKPOINT).is_file()]
    if not saved:
        return (
            "no checkpoint was saved (no DP step since the start, or a multi-process run whose privacy_ledger.json is "
            "current): rerun the same command with --ckpt_path last to continue from the newest checkpoint"
        )
    path = max((folder / INTERRUPT_CHECKPOINT for folder in saved), key=lambda file: file.stat().st_mtime)
    return f"saved {path} with the privacy ledger; resume by rerunning the same command with --ckpt_path {path}"


def checkpoint_folders(trainer: Trainer) -> list[Path]:
    """The run's checkpoint folders: its ``ModelCheckpoint`` folders, else ``<log_dir>/checkpoints``."""
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    return folders or [Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"]


def run_summary(trainer: Trainer) -> str:
    """Where a finished ``fit`` left its checkpoint, ``privacy_ledger.json`` and TensorBoard logs, and its ε."""
    parts = []
    callback = trainer.checkpoint_callback
    checkpoint = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    ledger = Path(trainer.log_dir or trainer.default_root_dir) / LEDGER_FILE
    if ledger.is_file():
        parts.append(f"privacy ledger {ledger}")
    board = next((logger.log_dir for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)
    if board is not None:
        parts.append(f"TensorBoard logs {board} (tensorboard --logdir {Path(board).parent})")
    return "; ".join([*parts, privacy_spent(trainer.strategy)])


def privacy_spent(strategy: Any) -> str:
    """``ε=7.99 at δ=0.00294 after 40 DP steps``, or that the run had no privacy guarantee."""
    accountant = strategy.accountant if isinstance(strategy, DPStrategy) else None
    if accountant is None:
        return "NON-PRIVATE run: no ε, no differential privacy guarantee"
    return f"ε={accountant.epsilon():.4g} at δ={accountant.delta:.3g} after {accountant.steps} DP steps"


NON_PRIVATE_WARNING = (
    "NON-PRIVATE run (--non_private true): trained without DPStrategy, so no clipping, no noise, no privacy "
    "ledger and NO differential privacy guarantee for the model or anything computed from it"
)


def check_privacy_choice(config: Any) -> bool:
    """Whether a ``fit`` is private; refuse one without :class:`DPStrategy` unless ``--non_private true`` (and vice versa)."""
    strategy = config["trainer"].get("strategy")
    private = _is_dp_strategy(strategy)
    shown = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", type(strategy).__name__)
    if not private and not config.get("non_private"):
        raise ValueError(
            f"trainer.strategy={shown!r} trains WITHOUT differential privacy: use dplit.strategy.DPStrategy, or pass "
            "--non_private true to train non-privately on purpose"
        )
    if private and config.get("non_private"):
        raise ValueError("--non_private true contradicts trainer.strategy=DPStrategy: drop one of them")
    return private


ARCHITECTURE_SETTINGS = ("pretrained", "gguf_file", "config", "head", "peft", "train_embeddings", "freeze")
"""``model`` settings that decide which weights exist and which are trained: on ``--ckpt_path`` they must match the
checkpoint's (its weights and optimizer state were made for them). Every other ``model`` setting (``lr``, ``dropout``,
...) that differs is replaced by the checkpoint's value, with one warning naming each."""


def check_checkpoint_settings(given: Namespace, saved: Namespace) -> None:
    """Refuse a ``model`` architecture setting that differs from the checkpoint's; warn naming every other one.

    Args:
        given: the ``model`` settings of the command line and config, before the checkpoint's replaced them.
        saved: the same after Lightning merged in the checkpoint's hyperparameters.

    Raises:
        ValueError: naming the first differing setting of :data:`ARCHITECTURE_SETTINGS` (``model.peft.init_args.r``).
    """
    differing = settings_replaced(given, saved)
    architecture = [item for item in differing if item[0].split(".")[0] in ARCHITECTURE_SETTINGS]
    if architecture:
        key, value, kept = architecture[0]
        more = f" (and {len(architecture) - 1} more)" if len(architecture) > 1 else ""
        raise ValueError(
            f"model.{key}={value!r} differs from the checkpoint's {kept!r}{more}: --ckpt_path resumes the "
            "checkpoint's model, so drop the setting (or set the checkpoint's value), or start a new run without "
            "--ckpt_path"
        )
    if differing:
        ignored = ", ".join(f"model.{key}={value!r} (checkpoint: {kept!r})" for key, value, kept in differing)
        warnings.warn(
            f"--ckpt_path resumes with the checkpoint's model settings, ignoring {ignored}", UserWarning, stacklevel=2
        )


def settings_replaced(given: Namespace, saved: Namespace) -> list[tuple[str, Any, Any]]:
    """``(key, given value, checkpoint's value)`` of every ``model`` setting the checkpoint's replaced.

    Settings the command line could not give (the data's links: ``vocab_size``, ``task``, ...) are not compared.
    """
    before, after = dict(given.items()), dict(saved.items())
    groups = {key.split(".")[0] for key in before}
    keys = sorted(key for key in before.keys() | after.keys() if key.split(".")[0] in groups)
    return [(key, before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)]


def check_gguf_files(config: Any) -> None:
    """Refuse a tokenizer and a model taken from different GGUF files (Lightning would also stop on the clash)."""
    model, data = config["model"].get("gguf_file"), config["data"].get("gguf_file")
    if model != data:
        raise ValueError(
            f"model.gguf_file={model!r} and data.gguf_file={data!r} differ: the tokenizer must come from the "
            "model's own GGUF file, so set both to the same file (or neither)"
        )


def _is_dp_strategy(strategy: Any) -> bool:
    if isinstance(strategy, DPStrategy):
        return True
    cls = strategy_class(strategy)
    return cls is not None and issubclass(cls, DPStrategy)


def strategy_class(strategy: Any) -> type | None:
    """The class a ``trainer.strategy`` config entry (``{class_path: ...}``) names, ``None`` if it names none."""
    class_path = getattr(strategy, "class_path", None) if not isinstance(strategy, dict) else strategy.get("class_path")
    if not class_path:
        return None
    module, _, name = str(class_path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def find_last_checkpoint(trainer: Trainer) -> Path:
    """The newest checkpoint (``last.ckpt``, ``interrupted.ckpt`` or any other) of this run's checkpoint folders.

    Those are the ``ModelCheckpoint`` folders and the ``checkpoints/`` of every version folder beside the new one:
    a resumed run writes a new version folder, so Lightning's own ``"last"`` would look only in an empty one.
    """
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    root = Path(getattr(trainer.logger, "root_dir", None) or trainer.default_root_dir)
    folders += [path for path in root.glob("*/checkpoints") if path.is_dir()]
    found = [path for folder in folders for path in folder.glob("*.ckpt") if path.is_file()]
    if not found:
        raise ValueError(
            f"--ckpt_path last: no checkpoint under {root}, so there is nothing to resume (training would restart "
            "ε at 0): give a checkpoint file, or leave --ckpt_path unset for a new run"
        )
    return max(found, key=lambda path: path.stat().st_mtime)


def check_checkpoint_path(ckpt_path: str | None, *, weights_only: bool = True) -> None:
    """Refuse a ``--ckpt_path`` that does not exist or is not a checkpoint, in one line naming it.

    Args:
        ckpt_path: the flag's value (Lightning's aliases and URLs pass unchecked).
        weights_only: whether it will be loaded with ``torch.load(weights_only=True)`` (``--weights_only``), which
            refuses a file that pickles any other object than tensors and plain values: refused here already.
    """
    if (
        ckpt_path is None
        or ckpt_path in _LIGHTNING_CKPT_ALIASES
        or "://" in ckpt_path
        or ckpt_path.startswith("registry")
    ):
        return
    check_checkpoint_file(ckpt_path, flag="--ckpt_path", weights_only=weights_only)


def run_cli(args: ArgsType = None) -> DPLitCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), run the subcommand and return the CLI (trainer, model, data)."""
    return DPLitCLI(CausalLMClassifier, GlueDataModule, parser_class=DPLitArgumentParser, args=args)


def run_lm_cli(args: ArgsType = None) -> DPLitLMCLI:
    """Like :func:`run_cli`, for private next-token fine-tuning (``dplit lm fit --config configs/lm_X.yaml``)."""
    return DPLitLMCLI(CausalLanguageModel, TextDataModule, parser_class=DPLitArgumentParser, args=args)
