"""The model card (``README.md``) of an export: the guarantee in its first line, then every fact behind it.

It reads only :func:`~dplit.release.guarantee.guarantee_of`'s record: the statement, the facts table (a fact
that differs between the history's segments says so instead of giving the last segment's value), the weights'
privacy history one segment a row (unit and k, clip mode and C, N, δ), and what the guarantee does not cover.
"""

from __future__ import annotations

from typing import Any

from dplit.privacy.history import GUARANTEE_FILE, segment_steps

PER_SEGMENT = "per segment, see the history"
"""What the card says of a fact whose value differs between the history's segments."""
PUBLIC_CHANGE = "public change (declared by the user)"


def model_card(guarantee: dict[str, Any], *, kind: str) -> str:
    """``README.md`` of an export: the guarantee (or its absence, in the first line), then every fact behind it.

    Args:
        guarantee: :func:`~dplit.release.guarantee.guarantee_of`'s record.
        kind: what the folder holds, e.g. ``"causal LM"`` or ``"label-word classifier (a causal LM)"``.
    """
    lines = [
        _title(guarantee, kind),
        "",
        f"Fine-tuned with dplit {guarantee['dplit_version']} (commit {guarantee['dplit_commit']}).",
    ]
    if guarantee["differentially_private"]:
        lines += ["", _statement(guarantee)]
    lines += ["", "## Privacy facts", "", "| fact | value |", "|---|---|", *_facts_table(guarantee)]
    lines += ["", "## Privacy history of these weights", "", *_history_table(guarantee)]
    lines += ["", "## Not covered by this guarantee", ""]
    lines += [f"- {item}" for item in guarantee["not_covered"]]
    lines += ["", f"The same facts, machine-readable, are in `{GUARANTEE_FILE}`.", ""]
    return "\n".join(lines)


def _title(guarantee: dict[str, Any], kind: str) -> str:
    """The first line: (ε, δ) and the unit they protect, or NOT differentially private and why."""
    if not guarantee["differentially_private"]:
        return f"# NOT differentially private {kind}: {guarantee['reason']}"
    unit = "per user (add/remove one user)" if _per_user(guarantee) else "per training example (add/remove one)"
    return f"# Differentially private {kind}: (ε = {guarantee['epsilon']:.4g}, δ = {guarantee['delta']:.3g}) {unit}"


def _per_user(guarantee: dict[str, Any]) -> bool:
    return guarantee.get("protected_unit", "user" if "users" in guarantee else "example") == "user"


def _facts_table(guarantee: dict[str, Any]) -> list[str]:
    """One row per fact the record holds; a fact that differs between segments reads :data:`PER_SEGMENT`."""
    varying = set(guarantee.get("per_segment") or [])
    rows = []
    for key, name in _FACTS:
        if key not in guarantee or (key == "public_changes" and not guarantee[key]):
            continue
        if guarantee.get("user_rows") == "pairs" and key in ("max_rows_per_user", "largest_user_rows"):
            name = name.replace("rows", "preference pairs")
        rows.append(f"| {name} | {PER_SEGMENT if key in varying else _shown(guarantee[key])} |")
    return rows


def _history_table(guarantee: dict[str, Any]) -> list[str]:
    """Every segment of the weights' privacy history, one row each (fits, resumes, refits, non-private steps, ...)."""
    segments = guarantee["privacy_history"]["segments"]
    if not segments:
        return ["No training step is recorded for these weights."]
    header = "| # | kind | steps | σ, q (steps) | unit | clipping | N | δ | noise | note |"
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {number} | {_segment_row(segment)} |" for number, segment in enumerate(segments, start=1)]
    return [*rows, "", *_history_notes(guarantee, segments)]


def _segment_row(segment: dict[str, Any]) -> str:
    """One history row after its number: a DP segment's own mechanism, a non-private or a declared public change."""
    kind = segment.get("kind")
    if kind == "dp":
        entries = ", ".join(f"{sigma:.4g}, {rate:.4g} ({count})" for sigma, rate, count in segment["accountant"])
        delta = segment.get("delta")
        cells = [
            "DP-SGD", str(segment_steps(segment)), entries, _unit_cell(segment), _clip_cell(segment),
            _shown(segment.get("dataset_size")), "—" if delta is None else f"{delta:.3g}", _shown(segment.get("noise")),
            _shown(segment.get("note")),
        ]  # fmt: skip
    elif kind == "public_change":
        statement = _shown(str(segment.get("statement", ""))).replace("\r", " ").replace("\n", "<br>")
        where = f" ({_shown(segment['where'])})" if segment.get("where") else ""
        cells = [PUBLIC_CHANGE, _shown(segment.get("steps")), *["—"] * 6, f'"{statement}"{where}']
    else:
        cells = ["NOT private", _shown(segment.get("steps")), *["—"] * 6, _shown(segment.get("reason", kind))]
    return " | ".join(cells)


def _unit_cell(segment: dict[str, Any]) -> str:
    """``user (k = 4)``, ``example``, or ``—`` for a segment that does not record its unit."""
    unit = segment.get("privacy_unit")
    if unit == "user":
        return f"user (k = {_shown(segment.get('max_rows_per_user'))})"
    return _shown(unit)


def _clip_cell(segment: dict[str, Any]) -> str:
    """The segment's clip mode and bound: ``fixed, C = 1``, ``quantile, C 1 → 1.317``, ``automatic, C = 1 (γ = …)``."""
    mode, bound = segment.get("clip_mode"), _shown(segment.get("max_grad_norm"))
    if mode == "quantile":
        start = segment.get("clip_bound_start", segment.get("max_grad_norm"))
        return f"quantile, C {_shown(start)} → {_shown(segment.get('clip_bound_end'))}"
    if mode == "automatic" and segment.get("automatic_stability") is not None:
        return f"automatic, C = {bound} (γ = {_shown(segment['automatic_stability'])})"
    return f"{_shown(mode)}, C = {bound}"


def _history_notes(guarantee: dict[str, Any], segments: list[dict[str, Any]]) -> list[str]:
    """How ε composes the rows above, and what a declared public change is."""
    if _over_users(guarantee) and not _per_user(guarantee):
        notes = [
            "ε above composes every DP-SGD row at the smallest of their δ, each under its own relation: a row over "
            "users as replace-one for one training example, the others as add/remove (dp-accounting PLD)."
        ]
    else:
        notes = [
            "ε above composes every DP-SGD row at the smallest of their δ, as if all were on the same data (an "
            "upper bound for each dataset)."
        ]
    notes += _people_notes(guarantee)
    if any(segment.get("kind") == "public_change" for segment in segments):
        notes.append(
            f"A {PUBLIC_CHANGE} is the user's statement that the change used no private data, quoted verbatim: "
            "dplit does not check it; it adds no ε and does not make the weights non-private."
        )
    return notes


PEOPLE_STATED = {
    True: (
        "the user stated that its data shares people with the data of the fits above it (DPStrategy.people_overlap=true, "
        "e.g. the same users gave the SFT rows and the preference pairs): ε above is what a person in both datasets "
        "has, for one unit of each together (sequential composition); a person with more units in a dataset is "
        "covered as group privacy says"
    ),
    False: (
        "the user stated that no person in its data is in the data of the fits above it (DPStrategy.people_overlap=false; "
        "dplit does not check it)"
    ),
    None: (
        "whether its data shares people with the data of the fits above it was not stated (DPStrategy.people_overlap): "
        "ε above composes every row as if they do (a person in both datasets, one unit of each together)"
    ),
}
"""What the card says of a later fit (a refit from an export, e.g. DPO after SFT) by the user's statement."""


def _people_notes(g: dict[str, Any]) -> list[str]:
    """How the fits of the history compose for one person: the user's statement of each later fit's people."""
    notes = [f"Row {number} starts a later fit from these weights: {PEOPLE_STATED[stated]}." for number, stated in
             g.get("people_overlap") or []]  # fmt: skip
    per_dataset = g.get("epsilon_per_dataset")
    if per_dataset:
        each = "; ".join(f"row(s) {', '.join(map(str, rows))}: ε = {_shown(epsilon)}" for rows, epsilon in per_dataset)
        notes.append(
            f"With no person in two of these datasets, a person is protected at the ε of the rows that trained on "
            f"their dataset alone (the others' weights are, for them, a public starting point): {each}. ε above, "
            "composing every row, holds whatever the statement."
        )
    return notes


def _statement(g: dict[str, Any]) -> str:
    """The guarantee in one paragraph: unit, N per dataset, sampling, clipping, noise, steps, relation, start."""
    users = _per_user(g)  # user-level DP: the unit, N and q are users
    unit, units = ("user", "users") if users else ("example", "rows")
    if g.get("protected_unit") == "pair":
        unit, units = "preference pair", "pairs"
    return (
        f"The weights in this folder are ({g['epsilon']:.4g}, {g['delta']:.3g})-differentially private with respect "
        f"to {g['privacy_unit']}{_of_n(g, units)}: DP-SGD with {g['sampling']} sampling ({_rate(g, units)}), "
        f"{_whose_gradient(g, unit)} {_clipping_text(g)}, Gaussian noise of {_sigma(g)} times C once per step, "
        f"{g['steps']} steps in {g['segments']} segment(s) of the weights' privacy history{_start(g)}, "
        f"{_accountant(g)}{_deltas(g)}.{_mixed(g)} Neighbouring datasets differ "
        f"by adding or removing one {unit}; under replace-one (one {unit} substituted, N public) ε = "
        f"{_shown(g.get('epsilon_replace_one'))} (dp-accounting PLD).{_public(g)} Anything computed from these "
        "weights alone (generated text, predictions) has the same guarantee."
    )


def _of_n(g: dict[str, Any], units: str) -> str:
    """`` of the 200 training rows``, or every dataset's N when the segments trained on more than one."""
    datasets = g.get("units_per_dataset") or [[g.get("dataset_size"), units]]
    if len(datasets) == 1:
        return f" of the {_shown(datasets[0][0])} training {datasets[0][1]}"
    sizes = "; ".join(f"N = {size} {what}" for size, what in datasets)
    return f" (N differs between the segments: {sizes}; each segment's N is in the history below)"


def _whose_gradient(g: dict[str, Any], unit: str) -> str:
    if _per_user(g):
        return "every user's summed gradient"
    if _over_users(g):
        return "every example's gradient (in a segment over users, every user's summed gradient)"
    return f"every {unit}'s gradient"


def _accountant(g: dict[str, Any]) -> str:
    if _over_users(g) and not _per_user(g):
        return "ε from dp-accounting's PLD, each segment under its own relation"
    return f"ε from the {g['accountant']} accountant"


def _over_users(g: dict[str, Any]) -> int:
    """How many DP segments of the history trained over users."""
    dp = [s for s in g["privacy_history"]["segments"] if s.get("kind") == "dp"]
    return sum(segment.get("privacy_unit") == "user" for segment in dp)


def _rate(g: dict[str, Any], units: str) -> str:
    if g.get("sample_rate") is None:
        return f"rate q and expected batch {PER_SEGMENT}"
    batch = g.get("expected_batch_size")
    expected = f"expected batch {batch:.6g} {units}" if batch is not None else f"expected batch {PER_SEGMENT}"
    return f"rate q = {g['sample_rate']:.6g}, {expected}"


def _sigma(g: dict[str, Any]) -> str:
    sigma = g.get("noise_multiplier")
    return f"σ ({PER_SEGMENT})" if sigma is None else f"σ = {sigma:.6g}"


def _clipping_text(g: dict[str, Any]) -> str:
    """How each unit's gradient was bounded, for the card's statement."""
    if {"clip_mode", "max_grad_norm"} & set(g.get("per_segment") or []):
        return f"clipped as each segment states (clip mode and C {PER_SEGMENT})"
    if g.get("clip_mode") == "quantile":
        return (
            f"clipped to a bound C_t that privately tracks the {g.get('target_quantile')}-quantile of the norms "
            f"(C_0 = {g['max_grad_norm']}, last C = {_shown(g.get('clip_bound'))}; {g['clipping']} clipping; the "
            f"noisy count and the gradient together are one Gaussian mechanism of multiplier σ)"
        )
    if g.get("clip_mode") == "automatic":
        return (
            f"scaled by C / (‖g‖ + {g.get('automatic_stability')}) to norm below C = {g['max_grad_norm']} "
            f"(automatic clipping, {g['clipping']})"
        )
    return f"clipped to norm C = {g['max_grad_norm']} ({g['clipping']} clipping)"


def _start(g: dict[str, Any]) -> str:
    return f", starting from {g['starting_point']}" if g.get("starting_point") else ""


def _deltas(g: dict[str, Any]) -> str:
    deltas = {s.get("delta") for s in g["privacy_history"]["segments"] if s.get("kind") == "dp"} - {None}
    return " at the smallest of the segments' δ" if len(deltas) > 1 else ""


def _mixed(g: dict[str, Any]) -> str:
    """Under a per-example claim over user-level segments: how those segments were counted."""
    over_users = _over_users(g)
    if _per_user(g) or not over_users:
        return ""
    return (
        f" Under this per-example guarantee, the {over_users} segment(s) that trained over users count as replace-one "
        "for one row (a row of a multi-row user can move that user's clipped sum by up to 2C) and the others as "
        "add/remove: ε composes each segment under its own relation with dp-accounting's PLD (opacus' PRV "
        "accountant composes one relation only)."
    )


def _public(g: dict[str, Any]) -> str:
    count = g.get("public_changes")
    if not count:
        return ""
    return (
        f" The history also lists {count} change(s) of the weights the user declared used no private data (quoted "
        "verbatim below; dplit does not check the declaration and adds no ε for them)."
    )


_FACTS = (
    ("epsilon", "ε"),
    ("delta", "δ"),
    ("accountant", "accountant"),
    ("neighbouring_relation", "neighbouring relation"),
    ("epsilon_replace_one", "ε under replace-one"),
    ("noise_multiplier", "noise multiplier σ"),
    ("max_grad_norm", "clipping bound C"),
    ("expected_batch_size", "expected batch size"),
    ("sample_rate", "sampling rate q"),
    ("sampling", "sampling method"),
    ("steps", "DP steps"),
    ("segments", "DP segments (fits, resumes, refits)"),
    ("non_private_steps", "steps without DP-SGD"),
    ("public_changes", "changes declared public by the user (no ε added; see the history)"),
    ("dataset_size", "training rows N (users, under user-level DP)"),
    ("privacy_unit", "privacy unit"),
    ("users", "training users N"),
    ("max_rows_per_user", "rows of a user per step (at most)"),
    ("largest_user_rows", "rows of the largest user (computed without noise: not covered by ε)"),
    ("clipping", "clipping engine"),
    ("clip_mode", "clipping bound"),
    ("target_quantile", "target quantile γ of the norms"),
    ("clip_learning_rate", "bound learning rate η"),
    ("count_noise_multiplier", "count noise σ_b (examples)"),
    ("gradient_noise_multiplier", "gradient noise multiplier σ_eff"),
    ("clip_bound", "last clipping bound C"),
    ("automatic_stability", "automatic clipping γ"),
    ("tied_norm", "tied-weight norm"),
    ("packing", "packed rows"),
    ("noise", "noise seeding"),
    ("starting_point", "starting point (public weights)"),
    ("starting_point_digest", "starting point digest"),
    ("embedding_policy", "embedding policy"),
    ("tied_embeddings", "tied embeddings"),
    ("adapters", "adapters"),
    ("train_embeddings", "embeddings trained"),
    ("data_source", "data source"),
    ("base_model", "base model"),
    ("base_model_gguf_file", "base model GGUF file"),
    ("base_model_quantization", "base model quantisation (frozen, trained on)"),
    ("dplit_version", "dplit version"),
    ("dplit_commit", "dplit commit"),
    ("run_id", "run id"),
)


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        args = ", ".join(f"{key}={item!r}" for key, item in (value.get("init_args") or {}).items())
        return f"`{value.get('class_path')}({args})`"
    if isinstance(value, float):
        return f"{value:.6g}"
    return "—" if value is None else str(value).replace("|", "\\|")
