"""dplit: differentially private fine-tuning of GPT-style language models with PyTorch Lightning."""

import logging

__version__ = "0.1.0"

_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as Lightning does: its lines show unless the application logs itself
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

# bitsandbytes (imported by peft when installed) warns at import, on CPUs with AVX512-BF16, that an optional kernel
# would need the `kernels` package and a hub download; dplit never makes it, so only that line is dropped.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: "kernels-community" not in str(record.msg))
