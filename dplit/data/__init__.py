"""Data: GLUE tasks (hub or local TSV) and a built-in offline task, as prompts for a causal LM."""

from dplit.data.glue import GlueDataModule
from dplit.data.tokenizer import load_tokenizer

__all__ = ["GlueDataModule", "load_tokenizer"]
