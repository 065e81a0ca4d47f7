"""What the DataModules check of their options before reading any data, shared by both."""

from __future__ import annotations


def check_count(name: str, value: int, *, least: int = 1, note: str = "") -> None:
    """Refuse ``data.<name>`` below ``least``: ``data.batch_size must be a positive integer, got 0``.

    Args:
        name: the option, without ``data.`` (``"batch_size"``).
        value: its value (a size or a count; ``None`` is the caller's to allow).
        least: the smallest value accepted.
        note: added after "a positive integer" (``" (max_length ≥ 2)"``).

    Raises:
        ValueError: naming the option and the value.
    """
    if value < least:
        raise ValueError(f"data.{name} must be a positive integer{note}, got {value}")
