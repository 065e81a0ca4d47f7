"""The ``dplit`` command: LightningCLI over CausalLMClassifier and GlueDataModule, driven by YAML."""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

from dplit.data import GlueDataModule
from dplit.model import CausalLMClassifier


class DPLitCLI(LightningCLI):
    """LightningCLI that feeds the data's label words, vocabulary size and task into the model."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for source, target in [
            ("data.label_word_ids", "model.label_word_ids"),
            ("data.num_classes", "model.num_classes"),
            ("data.vocab_size", "model.vocab_size"),
            ("data.task", "model.task"),
        ]:
            parser.link_arguments(source, target, apply_on="instantiate")


def run_cli(args: ArgsType = None) -> DPLitCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), run the subcommand and return the CLI (trainer, model, data)."""
    return DPLitCLI(CausalLMClassifier, GlueDataModule, args=args)


def main(args: ArgsType = None) -> None:
    """Entry point of ``dplit fit|validate|test --config configs/X.yaml``."""
    run_cli(args)
