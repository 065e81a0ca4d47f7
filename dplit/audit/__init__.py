"""Empirical privacy auditing in one training run (``dplit audit``)."""
