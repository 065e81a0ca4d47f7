"""What the ``dplit`` command line refuses in a config before Lightning runs it, each in one line naming the setting.

A config file YAML would read silently wrong (empty, not a mapping, a key given twice) or written for the other kind
of run; a run without DPStrategy that does not say ``--non_private true``; a resumed run whose architecture settings
differ from its checkpoint's; a tokenizer and a model from different GGUF files.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace

from dplit.data import GlueDataModule
from dplit.data.preference import PreferenceDataModule
from dplit.data.text import TextDataModule
from dplit.strategy.hooks import DPSGDHooks
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel
from dplit.tasks.preference import PreferenceModel

COMMANDS = {
    "dplit fit": (CausalLMClassifier, GlueDataModule),
    "dplit lm fit": (CausalLanguageModel, TextDataModule),
    "dplit dpo fit": (PreferenceModel, PreferenceDataModule),
}
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


def _is_dp_strategy(strategy: Any) -> bool:
    if isinstance(strategy, DPSGDHooks):
        return True
    cls = strategy_class(strategy)
    return cls is not None and issubclass(cls, DPSGDHooks)


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


LIGHTNING_CHECKPOINT_ALIASES = ("last", "best", "hpc")
"""``--ckpt_path`` values that Lightning (or dplit, for ``last``) resolves to a file of the run."""


def names_a_local_file(ckpt_path: str | None) -> bool:
    """Whether ``--ckpt_path`` names a local file to check now: not unset, an alias, a URL or a model registry."""
    return not (
        ckpt_path is None
        or ckpt_path in LIGHTNING_CHECKPOINT_ALIASES
        or "://" in ckpt_path
        or ckpt_path.startswith("registry")
    )


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
    if model is not None and config["model"].get("pretrained") is None:
        raise ValueError(f"model.gguf_file={model!r} needs model.pretrained: the folder holding the GGUF file")
    if model != data:
        raise ValueError(
            f"model.gguf_file={model!r} and data.gguf_file={data!r} differ: the tokenizer must come from the "
            "model's own GGUF file, so set both to the same file (or neither)"
        )
