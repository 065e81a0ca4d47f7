"""jsonargparse's parse errors as one line naming the flag.

Ranges are checked by the flags' types (:mod:`dplit.flag_types`) and settings by their owners; both already word the
rule. What jsonargparse adds is its layout: ``Parser key "model.lr":`` on one line and the reason indented below, or,
for a value that matches no type of a union (``float | None``, ``bool | int``), a dump of every subtype it tried.
:func:`essential_error` keeps the flag and the reason: ``model.lr=-0.001: must be a finite number > 0``,
``seed_everything='maybe': expected true or false or an integer``. ``tests/cli/test_cli_messages.py`` pins the
messages the installed jsonargparse writes (``pyproject.toml`` bounds its version).
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from dplit.backbone.adapters import MISSING_PEFT, peft_importable

_KEY = re.compile(r'Parser key "(?P<key>[^"]+)"')
_VALUE = re.compile(r"(?:Given value: |Got value: )(?P<value>[^\n]*)")
_REQUIRED = re.compile(r"^(the following arguments are required: )(.+)$")
_OF_TYPE = re.compile(r"^Not of type \w+: ")
_EXPECTED_TYPE = re.compile(r"^Expected a (?P<kind><class '\w+'>|typing\.Literal\[.*\])(?:\. Got value: .*)?$")
_NOISE = ("Expected a <class 'NoneType'>", "Expected a <class 'str'>")  # the union's other members, never the point
_TYPE_NAMES = {"<class 'bool'>": "true or false", "<class 'int'>": "an integer", "<class 'float'>": "a number",
               "<class 'str'>": "a string"}  # fmt: skip


def essential_error(message: str, *, flag_prefix: str = "") -> str:
    """The one line of a jsonargparse error: ``<flag>=<value>: <why>`` or ``<flag>: <why>`` (``message`` if one line).

    Args:
        message: what jsonargparse passed to the parser's ``error``.
        flag_prefix: written before the flag's name (``"--"`` for a command whose flags are shown that way).
    """
    key = _KEY.search(message)
    required = _REQUIRED.match(message)
    if required is not None:  # argparse's own wording, flags named by their destinations
        return f"{required[1]}{', '.join(f'{flag_prefix}{name}' for name in required[2].split(', '))}"
    if key is None:  # a refusal raised while building a class, inside a dump without a key; or already one line
        return _owner_line(message)
    name = f"{flag_prefix}{key['key']}"
    if "AdapterConfig" in message and not peft_importable():  # model.peft given where peft is not installed
        return MISSING_PEFT
    body = message[key.end() :].lstrip(":").strip()
    reasons = _reasons(body.split("Errors:", 1)[1]) if "Errors:" in body else [body.split("\n  - ")[0].strip()]
    reasons = [reason for reason in reasons if not reason.startswith(_NOISE)] or reasons
    value = _VALUE.search(message)
    kinds = [_EXPECTED_TYPE.match(reason) for reason in reasons]
    if value is not None and all(kinds):  # a value of none of the flag's types: say which types it takes
        expected = " or ".join(_expected(kind["kind"]) for kind in kinds if kind is not None)
        return f"{name}={value['value']!r}: expected {expected}{_peft_hint(name, message)}"
    reason = " ".join(reasons[0].split())
    if _OF_TYPE.match(reason):  # a flag type's refusal reads "<value>: must be ..." (dplit.flag_types)
        return f"{name}={_OF_TYPE.sub('', reason)}"
    return f"{name}: {reason.replace('subclass of AdapterConfig', 'peft config class')}{_peft_hint(name, message)}"


def _owner_line(message: str) -> str:
    """The refusal in a dump without a parser key: a union's one reason that is not a type (else ``message``).

    A class that refused its arguments while jsonargparse built it (``trainer.strategy``'s DPStrategy) is reported
    as a union dump whose other reasons are the union's other types (``Expected a <class 'str'>``).
    """
    if "Errors:" not in message:
        return message.strip()
    reasons = [reason for reason in _reasons(message.split("Errors:", 1)[1]) if not _EXPECTED_TYPE.match(reason)]
    return " ".join(reasons[0].split()) if reasons else message


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


def _expected(kind: str) -> str:
    """A type as jsonargparse prints it (``<class 'bool'>``, ``typing.Literal['a', 'b']``) in words."""
    if kind.startswith("typing.Literal[") and kind.endswith("]"):
        return f"one of {kind.removeprefix('typing.Literal[')[:-1]}"
    return _TYPE_NAMES.get(kind, kind)


def _peft_hint(name: str, message: str) -> str:
    """How ``model.peft`` is written, after a refusal of a value given for it."""
    return f" ({name} takes {{class_path: peft.LoraConfig, init_args: {{...}}}})" if "AdapterConfig" in message else ""


class OneLineErrors:
    """A jsonargparse parser mixin (before the parser class in the bases): its errors are one ``dplit: error:`` line.

    Every dplit command's parser has it: LightningCLI's (:class:`dplit.cli.lightning_cli.DPLitArgumentParser`) and
    ``dplit export``'s and ``dplit lm generate``'s (:mod:`dplit.cli.release`).
    """

    flag_prefix = ""
    """Written before a flag's name in the line (``"--"`` where the command's flags are shown that way)."""

    def error(self, message: str, *args: Any, **kwargs: Any) -> NoReturn:
        """Exit with status 2 after the one line stating the broken rule (no usage block)."""
        self.exit(2, f"dplit: error: {essential_error(message, flag_prefix=self.flag_prefix)}\n")  # type: ignore[attr-defined]
