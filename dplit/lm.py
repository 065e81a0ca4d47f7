"""Where configs and checkpoints written before issue 33 name the language model: :mod:`dplit.tasks.language_model`.

To be removed in dplit 0.2.0: new configs name the new path; by then ``dplit export`` and resuming map the old class
paths that release-0.1.0 checkpoints record.
"""

from dplit.tasks.language_model import CausalLanguageModel

__all__ = ["CausalLanguageModel"]
