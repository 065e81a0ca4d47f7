"""dplit.numbers: the one "a finite number in a range" check every setting goes through."""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
from torch import nn

from dplit.audit.command import AuditSettings
from dplit.backbone.causal_lm import check_probability
from dplit.numbers import is_finite_number, range_text, require_finite_number
from dplit.privacy.accounting.checks import check_basics
from dplit.privacy.accounting.relations import epsilon_under
from dplit.privacy.clipping import GhostEngine
from dplit.privacy.settings import DPSGDSettings
from dplit.release.generate import SamplingSettings
from dplit.tasks.base import check_optimizer_settings
from tests.helpers.paths import REPOSITORY


@pytest.mark.parametrize("value", [0, 1, -3, 0.5, -1e300, 1e-300, np.float32(2.5), np.int64(4), Fraction(1, 3)])
def test_finite_real_numbers_pass(value: object) -> None:
    assert is_finite_number(value)


@pytest.mark.parametrize(
    "value",
    [True, False, math.nan, math.inf, -math.inf, np.float64("nan"), np.float32("inf"), "1", "nan", None, [1.0], 1j],
    ids=repr,
)
def test_bools_non_finite_and_non_real_values_fail(value: object) -> None:
    assert not is_finite_number(value)


@pytest.mark.parametrize(
    ("value", "bounds", "expected"),
    [
        (0, {"above": 0}, False),
        (1e-12, {"above": 0}, True),
        (0, {"minimum": 0}, True),
        (-1e-12, {"minimum": 0}, False),
        (1, {"maximum": 1}, True),
        (1 + 1e-12, {"maximum": 1}, False),
        (1, {"below": 1}, False),
        (0.999, {"below": 1}, True),
        (0, {"minimum": 0, "below": 1}, True),
        (1, {"minimum": 0, "below": 1}, False),
        (1, {"above": 0, "maximum": 1}, True),
        (0, {"above": 0, "maximum": 1}, False),
        (math.inf, {"above": 0}, False),  # no bound lets ±inf through
        (-math.inf, {"maximum": 0}, False),
    ],
)
def test_bounds_hold_at_their_edges(value: float, bounds: dict[str, float], expected: bool) -> None:
    assert is_finite_number(value, **bounds) is expected


@pytest.mark.parametrize(
    ("bounds", "text"),
    [
        ({}, ""),
        ({"above": 0}, "> 0"),
        ({"minimum": 0}, "≥ 0"),
        ({"maximum": 1}, "≤ 1"),
        ({"below": 1}, "< 1"),
        ({"above": 0, "maximum": 1}, "in (0, 1]"),
        ({"minimum": 0, "below": 1}, "in [0, 1)"),
        ({"above": 0, "maximum": 0.1}, "in (0, 0.1]"),
        ({"minimum": 0.0, "maximum": 1e6}, "in [0, 1e+06]"),
    ],
)
def test_range_text_words_the_bounds(bounds: dict[str, float], text: str) -> None:
    assert range_text(**bounds) == text


@pytest.mark.parametrize("bounds", [{"minimum": 0, "above": 0}, {"maximum": 1, "below": 1}])
def test_two_bounds_on_one_side_are_a_programming_error(bounds: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="at most one"):
        range_text(**bounds)
    with pytest.raises(ValueError, match="at most one"):
        require_finite_number(0.5, name="x", **bounds)


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (math.nan, {"above": 0}, "model.lr=nan: must be a finite number > 0"),
        (math.inf, {"above": 0}, "model.lr=inf: must be a finite number > 0"),
        (0.0, {"above": 0}, "model.lr=0.0: must be a finite number > 0"),
        (True, {"above": 0}, "model.lr=True: must be a finite number > 0"),
        ("0.1", {"above": 0}, "model.lr='0.1': must be a finite number > 0"),
        (None, {}, "model.lr=None: must be a finite number"),
        (-0.1, {"minimum": 0}, "model.lr=-0.1: must be a finite number ≥ 0"),
        (1, {"minimum": 0, "below": 1}, "model.lr=1: must be a finite number in [0, 1)"),
    ],
    ids=repr,
)
def test_require_refuses_in_one_line_naming_the_flag(value: object, bounds: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        require_finite_number(value, name="model.lr", **bounds)
    assert str(refused.value) == message
    assert "\n" not in str(refused.value)


def test_require_returns_the_value_as_a_float() -> None:
    assert require_finite_number(3, name="x", above=0) == 3.0
    assert type(require_finite_number(np.float32(0.5), name="x", above=0, maximum=1)) is float
    assert require_finite_number(0, name="x", minimum=0) == 0.0


def test_the_module_is_a_leaf_importing_nothing_from_dplit() -> None:
    tree = ast.parse((REPOSITORY / "dplit" / "numbers.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name == "dplit" or name.startswith("dplit.") for name in imported), imported


CALL_SITES: dict[str, tuple[Callable[[object], object], str]] = {
    "model.lr": (lambda v: check_optimizer_settings(v, 0.0, (0.9, 0.999), 0, "linear"), r"^model\.lr=.*: must be a finite number > 0$"),
    "model.betas": (lambda v: check_optimizer_settings(1e-3, 0.0, (v, 0.999), 0, "linear"), r"^model\.betas=.*: must be two numbers in \[0, 1\)$"),
    "model.dropout": (lambda v: check_probability("model.dropout", v), r"^model\.dropout=.*: must be a probability in \[0, 1\]$"),
    "DPStrategy.max_grad_norm": (lambda v: DPSGDSettings(max_grad_norm=v, noise_multiplier=1.0), r"^DPStrategy\.max_grad_norm must be a finite number > 0, got "),
    "DPStrategy.noise_multiplier": (lambda v: DPSGDSettings(max_grad_norm=1.0, noise_multiplier=v), r"^DPStrategy\.noise_multiplier must be a finite number ≥ 0, got "),
    "DPStrategy.target_delta": (lambda v: DPSGDSettings(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=v), r"^DPStrategy\.target_delta must be in \(0, "),
    "engine max_grad_norm": (lambda v: GhostEngine(nn.Linear(2, 2), max_grad_norm=v), r"^max_grad_norm must be a finite number > 0, got "),
    "history sigma": (lambda v: epsilon_under("add_remove", [(v, 0.5, 1)], delta=1e-5), r"^history\[0\]: noise multiplier sigma must be a finite number ≥ 0, got "),
    "history q": (lambda v: epsilon_under("add_remove", [(1.0, v, 1)], delta=1e-5), r"^history\[0\]: sample rate q must be in \(0, 1\], got "),
    "sample rate": (lambda v: check_basics("rdp", v, 1e-5), r"^the Poisson sample rate q = data\.batch_size / N must be in \(0, 1\], got "),
    "--temperature": (lambda v: SamplingSettings(temperature=v), r"^--temperature=.*: must be a finite number > 0$"),
    "--top_p": (lambda v: SamplingSettings(top_p=v), r"^--top_p=.*: must be a finite number in \(0, 1\]$"),
    "audit.confidence": (lambda v: AuditSettings(confidence=v), r"^audit\.confidence=.*: must be a finite number in \(0, 1\)$"),
}  # fmt: skip
"""Where dplit checks a finite number: each refuses nan, ±inf and a bool with its own flag's message."""


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True], ids=repr)
@pytest.mark.parametrize("site", list(CALL_SITES))
def test_every_call_site_refuses_nan_inf_and_bools_naming_its_flag(site: str, value: object) -> None:
    check, message = CALL_SITES[site]
    with pytest.raises(ValueError, match=message) as refused:
        check(value)
    assert "\n" not in str(refused.value)
