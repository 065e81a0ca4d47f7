"""``dplit fit|validate|test`` and ``dplit lm fit|validate``: LightningCLI over a dplit task and its data, from YAML."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from dplit.callbacks import use_plain_summary, use_quiet_progress_bar
from dplit.cli.config_checks import (
    NON_PRIVATE_WARNING,
    check_checkpoint_settings,
    check_config_command,
    check_config_file,
    check_gguf_files,
    check_privacy_choice,
    names_a_local_file,
)
from dplit.cli.launch import available_cores, oversubscription_message, sigterm_without_collective
from dplit.cli.messages import OneLineErrors, essential_error
from dplit.cli.run_summary import (
    INTERRUPTED_EXIT,
    PREEMPTED_EXIT,
    find_last_checkpoint,
    nothing_trained,
    peer_stopped_line,
    resume_hint,
    run_summary,
)
from dplit.data import GlueDataModule
from dplit.data.preference import PreferenceDataModule
from dplit.data.text import TextDataModule
from dplit.privacy.warnings import PrivacyWarning
from dplit.release.checkpoint import check_checkpoint_file
from dplit.strategy.hooks import DPSGDHooks
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel
from dplit.tasks.preference import PreferenceModel


class DPLitArgumentParser(OneLineErrors, LightningArgumentParser):
    """LightningArgumentParser whose errors show the broken rule in one line instead of jsonargparse's union dump."""

    @override
    def parse_path(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Namespace:
        """Parse a ``--config`` file after refusing what YAML would read silently wrong (see :func:`check_config_file`)."""
        check_config_file(Path(path))
        check_config_command(Path(path), {action.dest for action in self._actions})
        return super().parse_path(path, *args, **kwargs)


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
            ckpt_path = config.get("ckpt_path")
            if names_a_local_file(ckpt_path):
                weights_only = config.get("weights_only") is not False  # torch.load refuses other objects
                check_checkpoint_file(ckpt_path, flag="--ckpt_path", weights_only=weights_only)
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
        """Resolve ``--ckpt_path last``, warn of more CPU processes than cores, and log whether the run is private."""
        self._resolve_last_checkpoint()
        if isinstance(self.trainer.accelerator, CPUAccelerator):
            crowded = oversubscription_message(self.trainer.num_devices, available_cores())
            if crowded is not None:
                rank_zero_warn(crowded)
        non_private = bool(self.config_init[self.subcommand].get("non_private"))
        for logger in self.trainer.loggers:
            logger.log_hyperparams({"non_private": non_private})

    def fit(self, **kwargs: Any) -> None:
        """``trainer.fit``; stopped by SIGTERM (a scheduler preempting the job), exit 143 saying how to resume.

        Stopped by Ctrl-C, exit 130 (128 + SIGINT, as a shell reports it; Lightning exits 1). A rank whose step fails
        because another rank's process stopped ends in one line (exit 1).

        Lightning ends a run on SIGTERM with its ``SIGTERMException``, a ``SystemExit`` with status 0: the scheduler
        would record a preempted job as a success.
        """
        try:
            self.trainer.fit(**kwargs)
        except SIGTERMException:
            if self.trainer.is_global_zero:
                print(f"dplit: stopped by SIGTERM: {resume_hint(self.trainer)}", file=sys.stderr)
            raise SystemExit(PREEMPTED_EXIT) from None
        except SystemExit as stop:
            if stop.code == 1 and self.trainer.interrupted:  # Lightning's own exit after Ctrl-C (KeyboardInterrupt)
                raise SystemExit(INTERRUPTED_EXIT) from None
            raise
        except RuntimeError as error:
            line = peer_stopped_line(self.trainer, error)
            if line is None:
                raise
            print(line, file=sys.stderr)
            raise SystemExit(1) from None
        strategy = self.trainer.strategy
        self._took_no_step = isinstance(strategy, DPSGDHooks) and strategy.start_without_steps()

    def after_fit(self) -> None:
        """One line saying where the checkpoint, the privacy ledger and the TensorBoard logs are, and the ε spent.

        A resume whose plan was already done says so instead of "done", with how to train further.
        """
        if self.trainer.interrupted:
            return
        summary = run_summary(self.trainer)  # on every rank: trainer.log_dir is a collective under several processes
        if self.trainer.is_global_zero:
            done = nothing_trained(self.trainer) if getattr(self, "_took_no_step", False) else "done"
            print(f"dplit: {done}: {summary}")

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
        """Lightning's trainer, with dplit's default progress bar and model summary, and a quieter SIGTERM handler.

        The default progress bar loses ``v_num`` and the default summary its FLOPs column of zeros; a progress bar or
        summary the user configured is kept as it is. The SIGTERM handler issues no collective
        (:func:`dplit.cli.launch.sigterm_without_collective`).
        """
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init  # dplit audit: none
        configured = list(config.get("trainer", {}).get("callbacks") or [])
        trainer = super().instantiate_trainer(**kwargs)  # extends that very list with its defaults
        sigterm_without_collective(trainer)
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


class DPLitDPOCLI(DPLitLMCLI):
    """The ``dplit dpo`` command: PreferenceModel on PreferenceDataModule (vocabulary size and length linked)."""

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test`` (the validation pairs)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate", "test")}


def run_cli(args: ArgsType = None) -> DPLitCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), run the subcommand and return the CLI (trainer, model, data)."""
    return DPLitCLI(CausalLMClassifier, GlueDataModule, parser_class=DPLitArgumentParser, args=args)


def run_lm_cli(args: ArgsType = None) -> DPLitLMCLI:
    """Like :func:`run_cli`, for private next-token fine-tuning (``dplit lm fit --config configs/lm_X.yaml``)."""
    return DPLitLMCLI(CausalLanguageModel, TextDataModule, parser_class=DPLitArgumentParser, args=args)


def run_dpo_cli(args: ArgsType = None) -> DPLitDPOCLI:
    """Like :func:`run_cli`, for private preference tuning (``dplit dpo fit --config configs/dpo_quickstart.yaml``)."""
    return DPLitDPOCLI(PreferenceModel, PreferenceDataModule, parser_class=DPLitArgumentParser, args=args)
