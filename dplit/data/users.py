"""Who owns each training row (user-level DP): user ids read from a column, or a seeded synthetic assignment.

User ids are private: they are renumbered 0..U-1 here and never printed; messages give counts and shares only.
"""

from __future__ import annotations

import random
import warnings
from collections import Counter
from collections.abc import Sequence

PRIVACY_UNITS = ("example", "user")
SYNTHETIC_USER_ROWS = 8
"""Built-in data's users own 1 to this many consecutive rows (:func:`synthetic_users`, seeded by ``data.seed``)."""
DOMINANT_SHARE = 0.5
"""A user owning more than this share of the rows is warned about (its share, never its id)."""


def user_indices(ids: Sequence[str]) -> list[int]:
    """Each row's user as 0..U-1, users numbered in order of their first row."""
    numbers: dict[str, int] = {}
    return [numbers.setdefault(user, len(numbers)) for user in ids]


def synthetic_users(rows: int, *, seed: int, most_rows: int) -> list[str]:
    """A documented, seeded assignment of ``rows`` consecutive rows to users of 1..``most_rows`` rows each.

    Users take consecutive rows; each user's size is drawn uniformly from 1..``most_rows`` by
    ``random.Random(seed)`` (the last user may be smaller), so the same seed gives the same users.
    """
    draw, ids, user = random.Random(seed), [], 0
    while len(ids) < rows:
        ids.extend([f"user{user}"] * draw.randint(1, most_rows))
        user += 1
    return ids[:rows]


def check_several_users(users: Sequence[int], *, source: str, column: str | None) -> None:
    """Refuse user-level DP over a training set whose rows all belong to one user (the column names no owner).

    With one user, N = 1: the default δ = N^-1.1 is 1 and no guarantee means anything, so the refusal names the
    column rather than the δ it would otherwise trip over.
    """
    if users and max(users) == 0:
        given = f"data.user_column={column!r}" if column is not None else "the user assignment"
        raise ValueError(
            f"{source}: {given} gives one user for all {len(users)} training rows: user-level DP over one user "
            "protects nobody from anybody; name the column that says whose each row is, or use "
            "data.privacy_unit=example"
        )


def warn_dominant_user(users: Sequence[int], *, source: str, quiet: bool = False) -> None:
    """Warn when one user owns more than :data:`DOMINANT_SHARE` of the rows (its share unless ``quiet``).

    ``quiet`` (``private_diagnostics=false``): the share, computed from private data without noise, is left out.
    """
    if not users:
        return
    largest = Counter(users).most_common(1)[0][1]
    share = largest / len(users)
    if share > DOMINANT_SHARE:
        owns = "most" if quiet else f"{share:.0%}"
        warnings.warn(
            f"{source}: one user owns {owns} of the training rows; user-level DP protects that user as one "
            f"unit, at most data.max_rows_per_user of its rows per step, so most of its rows are rarely seen",
            UserWarning,
            stacklevel=2,
        )


def check_user_settings(
    privacy_unit: str, user_column: str | None, max_rows_per_user: int, *, units: Sequence[str] = PRIVACY_UNITS
) -> None:
    """Refuse, in one line naming the flag, a privacy unit outside ``units``, k ≤ 0, or a stray user setting.

    A user column or a ``max_rows_per_user`` other than 1 without ``privacy_unit: user`` would train example-level
    (or pair-level) DP without a word (a user with k rows is then protected at about k·ε): both are refused.
    """
    if privacy_unit not in units:
        raise ValueError(f"data.privacy_unit must be one of {', '.join(units)}, got {privacy_unit!r}")
    if isinstance(max_rows_per_user, bool) or not isinstance(max_rows_per_user, int) or max_rows_per_user < 1:
        raise ValueError(f"data.max_rows_per_user must be an integer ≥ 1, got {max_rows_per_user!r}")
    if user_column is not None and privacy_unit != "user":
        raise ValueError(
            f"data.user_column={user_column!r} is set but data.privacy_unit={privacy_unit!r}: set "
            "data.privacy_unit=user for user-level DP (or drop data.user_column)"
        )
    if max_rows_per_user != 1 and privacy_unit != "user":
        raise ValueError(
            f"data.max_rows_per_user={max_rows_per_user} is set but data.privacy_unit={privacy_unit!r}: set "
            "data.privacy_unit=user for user-level DP (or drop data.max_rows_per_user)"
        )
