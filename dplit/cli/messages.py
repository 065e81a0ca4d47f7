"""jsonargparse's and Lightning's parse errors rewritten as the one line that states the broken rule.

jsonargparse reports a value that matches no type of a union (``float | None``, ``bool | int``) as a dump of every
subtype it tried; the rule a user broke is one line of it, or can be said in one (``target_epsilon='inf': must be
a finite number > 0``). Plain string work: ``tests/cli/test_cli_messages.py`` pins each rewrite against the messages
the installed jsonargparse writes.
"""

from __future__ import annotations

import re

from dplit.backbone.adapters import MISSING_PEFT, peft_importable

_PRIVACY_NUMBERS = {
    "max_grad_norm": "a finite number > 0",
    "noise_multiplier": "a finite number ≥ 0",
    "target_epsilon": "a finite number > 0",
    "target_delta": "a number in (0, 1)",
}
_KEY = re.compile(r"(?:Parser key \"|NestedArg\(key=')(?P<key>[^\"']+)")
_VALUE = re.compile(r"(?:Given value: |Got value: |val=')(?P<value>[^'\n)]*)")
_SINGLE_TYPE = re.compile(r"Expected a (?P<kind><class '[a-z]+'>|typing\.Literal\[[^\]]*\])")
_UNION_NOISE = ("Expected a ", "Given value", "Subtypes", "Does not validate", "Errors:", "Got value", "Parser key")


def essential_error(message: str) -> str:
    """The line of a jsonargparse union/nested error that states the broken rule (the whole message if none does)."""
    key, value = _KEY.search(message), _VALUE.search(message)
    if key is not None and value is not None and "Expected a <class 'float'>" in message:
        name = key["key"].split(".")[-1]
        if name in _PRIVACY_NUMBERS:
            return f"trainer.strategy.init_args.{name}={value['value']!r}: must be {_PRIVACY_NUMBERS[name]}"
        return f"{key['key']}={value['value']!r} is not a number"
    for line in message.splitlines():
        text = line.strip().lstrip("- ").strip()
        noise = not text or text.startswith(_UNION_NOISE)
        if not noise and ("DPStrategy" in text or "must be" in text or "set exactly one" in text):
            return text
    if key is not None and "Errors:" in message:
        return _union_error(key["key"], message)
    single = _SINGLE_TYPE.search(message)
    if key is not None and value is not None and single is not None:  # a plain-typed flag given another type
        return f"{key['key']}={value['value']!r}: expected {_expected(single['kind'])}"
    return message


def _union_error(key: str, message: str) -> str:
    """``key: <why>`` from jsonargparse's dump of a value that matches no type of a union (``X | None``).

    A value of none of the union's types reads ``key='maybe': expected true or false or an integer``.
    """
    peft_type = "AdapterConfig" in message  # model.peft's type: a value that is no peft config, or no peft at all
    if peft_type and not peft_importable():
        return MISSING_PEFT
    message = message.replace("subclass of AdapterConfig", "peft config class")
    reasons = _reasons(message.split("Errors:", 1)[1])
    reasons = [reason for reason in reasons if not reason.startswith("Expected a <class 'NoneType'>")]
    hint = f" ({key} takes {{class_path: peft.LoraConfig, init_args: {{...}}}})" if peft_type else ""
    value = _VALUE.search(message)
    scalar = value is not None and not value["value"].startswith("{")  # not a {class_path, init_args} dict
    if scalar and reasons and all(reason.startswith("Expected a ") for reason in reasons):
        expected = " or ".join(_expected(reason.removeprefix("Expected a ")) for reason in reasons)
        return f"{key}={value['value']!r}: expected {expected}{hint}"
    return f"{key}: {reasons[0] if reasons else 'invalid value'}{hint}"


def _reasons(errors: str) -> list[str]:
    """The ``- reason`` items of jsonargparse's ``Errors:`` list, each joined with its more-indented lines."""
    reasons: list[str] = []
    bullet = -1
    for line in errors.splitlines():
        indent, text = len(line) - len(line.lstrip()), line.strip()
        if text.startswith("- "):
            bullet = indent
            reasons.append(text[2:].strip())
        elif text and reasons and indent > bullet:
            reasons[-1] = f"{reasons[-1]} {text}"
        else:
            bullet = 10**6  # the dump goes on below the list (``Given value: ...``)
    return reasons


_TYPE_NAMES = {"<class 'bool'>": "true or false", "<class 'int'>": "an integer", "<class 'float'>": "a number",
               "<class 'str'>": "a string"}  # fmt: skip


def _expected(kind: str) -> str:
    """A type as jsonargparse prints it (``<class 'bool'>``, ``typing.Literal['a', 'b']``) in words."""
    if kind.startswith("typing.Literal[") and kind.endswith("]"):
        return f"one of {kind.removeprefix('typing.Literal[')[:-1]}"
    return _TYPE_NAMES.get(kind, kind)
