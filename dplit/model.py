"""Where configs and checkpoints written before issue 33 name the classifier: it lives in :mod:`dplit.tasks.classifier`."""

from dplit.tasks.classifier import CausalLMClassifier, GPT2Classifier

__all__ = ["CausalLMClassifier", "GPT2Classifier"]
