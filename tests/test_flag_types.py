"""dplit.flag_types: a flag's range in its type, checked by jsonargparse at parse time and by ``check`` from Python."""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
from jsonargparse import ArgumentParser

from dplit.flag_types import NonNegativeInteger, Number, OpenUnitNumber, PositiveInteger, PositiveNumber, check
from dplit.numbers import require_finite_number


def parsed(kind: Any, value: str) -> Any:
    """``--x value`` through a jsonargparse parser whose one flag has type ``kind``."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--x", type=kind)
    return parser.parse_args(["--x", value]).x


@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [(PositiveNumber, "0.5", 0.5), (PositiveNumber, "1e-3", 1e-3), (PositiveInteger, "3", 3), (NonNegativeInteger, "0", 0),
     (OpenUnitNumber, "0.95", 0.95), (Optional[Number], "null", None)],  # noqa: UP045
)  # fmt: skip
def test_a_value_in_range_parses_to_a_plain_number(kind: Any, value: str, expected: Any) -> None:
    """A plain float or int, never the type itself: hyperparameters go into weights_only checkpoints."""
    result = parsed(kind, value)
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize(
    ("kind", "value"),
    [(PositiveNumber, "0"), (PositiveNumber, "-1"), (PositiveNumber, "inf"), (PositiveNumber, ".nan"),
     (PositiveNumber, "abc"), (PositiveInteger, "0"), (PositiveInteger, "1.5"), (PositiveInteger, "true"),
     (OpenUnitNumber, "1"), (NonNegativeInteger, "-1")],
)  # fmt: skip
def test_a_value_out_of_range_is_refused_at_parse_time(kind: Any, value: str) -> None:
    with pytest.raises(Exception, match=r"must be (a finite number|an integer)"):
        parsed(kind, value)


@pytest.mark.parametrize("value", [-0.001, 0, math.nan, math.inf, True, "abc"], ids=repr)
def test_check_words_a_refusal_as_require_finite_number_does(value: object) -> None:
    """One wording for a number out of range, whether the range is a type or a call."""
    with pytest.raises(ValueError) as by_type:
        check(value, PositiveNumber, flag="model.lr")
    if isinstance(value, str):
        assert str(by_type.value) == "model.lr='abc': must be a finite number > 0"
        return
    with pytest.raises(ValueError) as by_call:
        require_finite_number(value, name="model.lr", above=0)
    assert str(by_type.value) == str(by_call.value)


def test_check_returns_the_plain_number() -> None:
    assert type(check(2, PositiveInteger, flag="n")) is int and check(2, PositiveInteger, flag="n") == 2
    assert type(check(1, PositiveNumber, flag="x")) is float


@pytest.mark.parametrize("value", ["inf", ".inf", "+.inf", "nan", ".nan", "NaN"])
def test_number_reads_yaml_and_python_spellings_of_inf_and_nan(value: str) -> None:
    """``Number`` leaves the range to the setting's owner (DPSGDSettings refuses a non-finite ε in its own words)."""
    result = parsed(Optional[Number], value)  # noqa: UP045
    assert type(result) is float and not math.isfinite(result)
