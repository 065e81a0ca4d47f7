"""What a weights' privacy history supports: the unit it protects, each segment's relation, δ and the composed ε.

A history may hold segments over users (``privacy_unit: user``) and over rows, on datasets of different sizes and
at different δ. A guarantee protects users only when every DP segment protected users; otherwise it protects one
training example, and a user-level segment, seen from one row of a multi-row user, is a replace-one mechanism
(adding or removing that row can move the user's clipped sum from one vector of norm ≤ C to another: by up to
2C) while an example-level segment is add/remove. δ is the smallest of the segments' (a larger one would weaken
what an earlier dataset's run was refused below). Nothing here reads the data: only the segments' public facts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from dplit.privacy.accounting.relations import RelatedSegment, epsilon_composed

Unit = Literal["user", "pair", "example"]


def dp_segments(segments: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The DP-SGD segments of a history, oldest first."""
    return [segment for segment in segments if segment.get("kind") == "dp"]


def protected_unit(segments: Iterable[Mapping[str, Any]]) -> Unit:
    """``"user"`` (``"pair"``) when every one of the DP segments protected users (preference pairs), else ``"example"``."""
    dp = dp_segments(segments)
    for unit in ("user", "pair"):
        if dp and all(segment.get("privacy_unit") == unit for segment in dp):
            return unit  # type: ignore[return-value]
    return "example"


PER_UNIT = {"user": "per user", "pair": "per preference pair", "example": "per training example"}
"""How the end-of-fit line, the export line and ``dplit lm generate`` say the unit ε is per."""


def mixed_units(segments: Iterable[Mapping[str, Any]]) -> bool:
    """Whether some DP segments protected users and others rows (the claim is then per example)."""
    units = {segment.get("privacy_unit") == "user" for segment in dp_segments(segments)}
    return len(units) > 1


def related_segments(segments: Sequence[Mapping[str, Any]]) -> list[RelatedSegment]:
    """Every DP step as (relation, σ, q, steps) under the claim the history supports (see :func:`protected_unit`).

    Under a per-user claim every segment is add/remove one user; under a per-example claim a user-level segment is
    replace-one and an example-level one add/remove.
    """
    per_user = protected_unit(segments) == "user"
    related: list[RelatedSegment] = []
    for segment in dp_segments(segments):
        replace = segment.get("privacy_unit") == "user" and not per_user
        relation = "replace_one" if replace else "add_remove"
        related += [(relation, float(s), float(q), int(n)) for s, q, n in segment["accountant"]]
    return related


def smallest_delta(segments: Iterable[Mapping[str, Any]], default: float | None = None) -> float | None:
    """The smallest δ of the DP segments (``default`` when none records one, as a ledger-only history)."""
    deltas = [float(segment["delta"]) for segment in dp_segments(segments) if segment.get("delta") is not None]
    return min(deltas) if deltas else default


def mixed_epsilon(segments: Sequence[Mapping[str, Any]], *, delta: float) -> float:
    """ε at δ of a history whose segments compose under different relations (dp-accounting's PLD)."""
    return epsilon_composed(related_segments(segments), delta=delta)


def later_runs(segments: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices (in ``segments``) of the DP segments that start a fit after the first one (a resume does not)."""
    starts: list[int] = []
    previous: object = None
    for index, segment in enumerate(segments):
        if segment.get("kind") != "dp":
            continue
        if previous is not None and segment.get("run_id") != previous:
            starts.append(index)
        previous = segment.get("run_id")
    return starts


def disjoint_datasets(segments: Sequence[Mapping[str, Any]]) -> list[list[int]] | None:
    """The DP segments' indices grouped by dataset, when every later fit stated it shares no people with earlier data.

    A fit whose run stated ``people_overlap: false`` (:class:`~dplit.privacy.settings.DPSGDSettings`) trained on
    people none of whom is in the data of any earlier segment; its resumes stay in its group. Then a person is in
    one group's data only, and the weights are a post-processing of the other groups' outputs for that person:
    each group's own ε is theirs. ``None`` when any later fit stated an overlap or stated nothing (or there is no
    later fit): every segment then composes for one person.
    """
    starts = later_runs(segments)
    if not starts or any(segments[index].get("people_overlap") is not False for index in starts):
        return None
    groups: list[list[int]] = []
    for index, segment in enumerate(segments):
        if segment.get("kind") == "dp":
            if not groups or index in starts:
                groups.append([])
            groups[-1].append(index)
    return groups
