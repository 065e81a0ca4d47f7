"""Where configs and checkpoints written before issue 33 name the language model: :mod:`dplit.tasks.language_model`."""

from dplit.tasks.language_model import CausalLanguageModel

__all__ = ["CausalLanguageModel"]
