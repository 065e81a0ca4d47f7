"""``dplit audit`` and ``dplit lm audit`` on the command line: the ``audit`` section beside a DP config, the run, the verdict.

The audit itself (canaries, the canary strategy, the bounds, the report) lives in :mod:`dplit.audit`; this module is
its front end, as :mod:`dplit.cli.lightning_cli` is ``dplit fit``'s.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import set_parsing_settings
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from dplit.audit.command import FAILED, AuditSettings, failures, run_audit, verdict
from dplit.audit.strategy import CanaryDPStrategy
from dplit.cli.config_checks import check_gguf_files, check_privacy_choice, strategy_class
from dplit.cli.lightning_cli import DPLitArgumentParser, DPLitCLI, DPLitLMCLI
from dplit.data import GlueDataModule
from dplit.data.text import TextDataModule
from dplit.privacy.warnings import PrivacyWarning
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel


class AuditArguments:
    """The ``audit`` section beside a DP config, checked before anything is built (mixed into a dplit CLI)."""

    config: Any
    audit_settings: AuditSettings
    """The checked ``audit`` section (its seed drawn once, and written back into the config)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add the ``audit`` section."""
        super().add_arguments_to_parser(parser)  # type: ignore[misc]
        set_parsing_settings(docstring_parse_attribute_docstrings=True)  # each field's docstring as its --help
        try:
            parser.add_class_arguments(AuditSettings, "audit", instantiate=False)
        finally:
            set_parsing_settings(docstring_parse_attribute_docstrings=False)  # jsonargparse's default (faster)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Refuse a bad ``audit`` section or a run without DPStrategy; fix the seed; put the canaries in."""
        super().parse_arguments(parser, args)  # type: ignore[misc]
        settings = self.audit_settings = AuditSettings(**vars(self.config["audit"]))
        self.config["audit"]["seed"] = settings.seed
        check_gguf_files(self.config)
        if not check_privacy_choice(self.config):
            raise ValueError("dplit audit audits DP-SGD: set trainer.strategy to dplit.strategy.DPStrategy")
        if settings.mode == "white_box":
            _use_canary_strategy(self.config["trainer"]["strategy"], settings)


class ClassifierAuditCLI(AuditArguments, DPLitCLI):
    """``dplit audit``: the classifier CLI with an ``audit`` section, parsed and built but not run."""


class LanguageModelAuditCLI(AuditArguments, DPLitLMCLI):
    """``dplit lm audit``: the language-model CLI with an ``audit`` section, parsed and built but not run."""


def _use_canary_strategy(strategy: Any, settings: AuditSettings) -> None:
    """Make the config's DPStrategy a :class:`CanaryDPStrategy` (a subclass given in the config is kept)."""
    named = strategy_class(strategy)
    if named is None or not issubclass(named, CanaryDPStrategy):
        strategy["class_path"] = f"{CanaryDPStrategy.__module__}.{CanaryDPStrategy.__name__}"
    strategy["init_args"]["canaries"] = settings.canaries
    strategy["init_args"]["canary_seed"] = settings.seed


COMMANDS: dict[bool, tuple[type[DPLitCLI], type[LightningModule], type[Any]]] = {
    False: (ClassifierAuditCLI, CausalLMClassifier, GlueDataModule),
    True: (LanguageModelAuditCLI, CausalLanguageModel, TextDataModule),
}
"""``dplit audit`` (False) and ``dplit lm audit`` (True): the CLI, model and data classes."""


def audit_main(argv: list[str], *, lm: bool) -> dict[str, Any]:
    """Run ``dplit audit`` (``lm``: ``dplit lm audit``) on ``argv``; print the verdict; return the report.

    Exits with status 3 after a loud warning when ε̂ exceeds the claimed ε or a white-box check of the mechanism's
    scale fails: evidence of a bug.
    """
    cli_class, module_class, data_class = COMMANDS[lm]
    cli = cli_class(module_class, data_class, parser_class=DPLitArgumentParser, args=argv, run=False)
    assert isinstance(cli, AuditArguments)
    report = run_audit(cli.trainer, cli.model, cli.datamodule, cli.audit_settings, lm=lm)
    for line in verdict(report):
        rank_zero_info(line)
    reasons = failures(report)
    if reasons:
        rank_zero_warn(FAILED.format(reasons="; ".join(reasons)), category=PrivacyWarning)
        raise SystemExit(3)
    return report
