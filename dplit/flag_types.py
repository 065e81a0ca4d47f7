"""Numbers in a range as types: jsonargparse checks a flag's range when it parses the flag, Python code with :func:`check`.

A signature LightningCLI reads (``lr: PositiveNumber``) or a settings dataclass's field carries its range in its
type, written once: jsonargparse refuses a value out of range before anything is built (``dplit.cli.messages``
turns its report into ``model.lr=-0.001: must be a finite number > 0``), and the class's own check, for a caller
from Python, is :func:`check` on the same type, in the same words. Every range is worded by
:func:`dplit.numbers.range_text` and tested by :func:`dplit.numbers.is_finite_number` (a ``bool``, nan and ±inf are
refused).
"""

from __future__ import annotations

import math
from typing import Any

from jsonargparse.typing import register_type

from dplit.numbers import is_finite_number, range_text


def number_type(
    name: str,
    *,
    integer: bool = False,
    finite: bool = True,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
) -> type:
    """A ``float`` (``integer``: ``int``) type for annotations whose values are finite and in the range given.

    jsonargparse parses a value of it (registered with :func:`jsonargparse.typing.register_type`) into a plain
    ``float`` or ``int``, so nothing downstream (a checkpoint's hyperparameters, a JSON record) meets the type
    itself; a value out of range raises ``ValueError("<value>: must be <the range in words>")``.

    Args:
        name: the type's name, as ``--help`` shows it.
        integer: whole numbers only (an ``int``, or a string or float holding one).
        finite: refuse nan and ±inf (``False``: any number, ``inf`` and ``nan`` included, for a setting whose
            owner words its own refusal of them).
        minimum: ``value ≥ minimum``.
        above: ``value > above``.
        maximum: ``value ≤ maximum``.
        below: ``value < below``.
    """
    bounds = range_text(minimum=minimum, above=above, maximum=maximum, below=below)
    words = ("an integer" if integer else "a finite number" if finite else "a number") + (
        f" {bounds}" if bounds else ""
    )
    base: type = int if integer else float

    def parse(value: Any) -> Any:
        number = _number(value, integer=integer)
        in_range = is_finite_number(number, minimum=minimum, above=above, maximum=maximum, below=below)
        if number is None or (finite and not in_range):
            raise ValueError(f"{_shown(value)}: must be {words}")
        return base(number)

    kind = type(name, (base,), {"__doc__": words, "__module__": __name__, "parse": staticmethod(parse)})
    register_type(kind, serializer=base, deserializer=parse)
    return kind


def _number(value: Any, *, integer: bool) -> object:
    """``value`` as the number it holds (a command-line string is parsed), or ``None`` when it holds none."""
    if isinstance(value, str) and value.strip().lower() in _YAML_SPECIALS:  # ``.inf``, as YAML writes it
        value = _YAML_SPECIALS[value.strip().lower()]
    if isinstance(value, bool):
        return None
    try:
        number = float(value) if not isinstance(value, int) else value
    except (TypeError, ValueError):
        return None
    if integer and not isinstance(number, int):
        return int(number) if is_finite_number(number) and float(number).is_integer() else None
    return number


_YAML_SPECIALS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
"""YAML's spellings of ±inf and nan (jsonargparse hands a union-typed flag's value over as the text given)."""


def _shown(value: Any) -> str:
    """``value`` as a refusal shows it: a number (or a string holding one) as written, other text quoted."""
    if isinstance(value, str) and _number(value, integer=False) is None:
        return repr(value)
    return str(value)


def check(value: Any, kind: type, *, flag: str) -> Any:
    """``value`` as ``kind`` (a :func:`number_type`), or a one-line ``ValueError``: ``<flag>=<value>: must be ...``."""
    try:
        return kind.parse(value)  # type: ignore[attr-defined]
    except ValueError as error:
        raise ValueError(f"{flag}={error}") from None


Number = number_type("Number", finite=False)
"""Any number, ``inf`` and ``nan`` included (on the command line too), for a setting whose owner checks its range."""
PositiveNumber = number_type("PositiveNumber", above=0)
NonNegativeNumber = number_type("NonNegativeNumber", minimum=0)
OpenUnitNumber = number_type("OpenUnitNumber", above=0, below=1)
PositiveInteger = number_type("PositiveInteger", integer=True, minimum=1)
NonNegativeInteger = number_type("NonNegativeInteger", integer=True, minimum=0)
