"""dplit: differentially private fine-tuning of GPT-style language models with PyTorch Lightning."""

import logging

__version__ = "0.1.0"

_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as Lightning does: its lines show unless the application logs itself
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False
