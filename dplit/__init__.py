"""dplit: differentially private fine-tuning of GPT-style language models with PyTorch Lightning."""

__version__ = "0.1.0"
