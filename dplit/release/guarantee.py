"""The (ε, δ) guarantee of a trained checkpoint, as ``dp_guarantee.json`` states it (the card: :mod:`dplit.release.card`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dplit.data.sources import HUB_DATASET
from dplit.privacy.accounting import PrivacyAccountant
from dplit.privacy.accounting.relations import epsilon_under
from dplit.privacy.composition import (
    disjoint_datasets,
    dp_segments,
    later_runs,
    mixed_epsilon,
    mixed_units,
    protected_unit,
    smallest_delta,
)
from dplit.privacy.history import GUARANTEE_FILE as GUARANTEE_FILE  # re-exported: where release code finds it
from dplit.privacy.history import HISTORY_KEY, PrivacyHistory, history_in_checkpoint
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.tasks.provenance import RELEASE_KEY

NEIGHBOURING_RELATION = (
    "add/remove one example (ε above); the card publishes N and q, which add/remove treats as secret, so ε under "
    "replace-one (substitution, N public) is given too"
)
USER_RELATION = (
    "add/remove one user with all of that user's rows (ε above); the card publishes N and q (users), which "
    "add/remove treats as secret, so ε under replace-one (one user substituted, N public) is given too"
)
MIXED_RELATION = (
    "add/remove one example (ε above), composed per segment: a segment that trained over users counts as "
    "replace-one for one row (a row of a multi-row user can move that user's clipped sum by up to 2C), the others "
    "as add/remove; ε under replace-one throughout (N public) is given too"
)
MIXED_ACCOUNTANT = "dp-accounting PLD, each segment under its own relation (opacus' PRV composes one relation only)"
NEVER_PRIVATE = "trained without dplit.strategy.DPStrategy (no clipping, no noise, no privacy ledger)"
PRIVACY_UNIT = "one training example (one row of the training data)"
EXAMPLE_OR_PAIR_UNIT = (
    "one training example (one row of the training data; in a segment over preference pairs, one pair: a prompt with "
    "its chosen and rejected answers, their two rows clipped together as one unit)"
)
PAIR_UNIT = (
    "one preference pair (a prompt with its chosen and rejected answers: their two rows are clipped together as one "
    "unit)"
)
GROUP_PRIVACY = "groups of rows: a person with k rows in the training data is protected at about k·ε"
NOT_COVERED = (
    "choosing hyperparameters (learning rate, C, epochs, ...) by runs on the private data: each such run spends "
    "privacy that this ε does not count",
    "the diagnostics a run logs unless DPStrategy.private_diagnostics=false: train/* (loss, accuracy), dp/grad_norm, "
    "dp/clip_fraction, dp/dropped_examples, perf/samples_per_sec (the realised batch size), memory/peak_mb, the "
    "longest training prompt the GLUE datamodule reports and, under user-level DP, the largest user's row count "
    "are computed from the private data without noise, so they must not leave the trust boundary; this card and "
    "dp_guarantee.json state such a value only where `dplit export --publish_private_diagnostics` asked for it, "
    "marked as not covered by ε",
    "validation metrics computed on data that is itself private (val/*): only the model's weights are covered",
    "the non-secure RNG: noise and Poisson sampling come from torch's generators seeded from the operating "
    "system's entropy, not from a cryptographically secure sampler, and floating-point noise is not "
    "hardened against floating-point attacks",
    "the pretraining data of the base model and any data outside the training set",
    GROUP_PRIVACY,
)
PREFERENCE_DIAGNOSTICS = (
    "under dplit dpo, the training pairs' values are such diagnostics too: train/loss (the pairs' DPO loss) and any "
    "reward accuracy, implicit reward margin or chosen/rejected log-probability computed on training pairs are "
    "computed from the private pairs without noise and are not covered by ε (the val/* ones are the item below)"
)
"""The not-covered item of a history with preference-pair segments (beside the diagnostics item)."""
PRIVATE_DIAGNOSTICS = ("largest_user_rows",)
"""Values a guarantee can state that are computed from the private data without noise (published only on request)."""


def guarantee_of(checkpoint: dict[str, Any], *, publish_private_diagnostics: bool = False) -> dict[str, Any]:
    """The privacy facts of a loaded Lightning checkpoint: its weights' privacy history, its run ledger, its model.

    ε composes every DP segment of the weights' history (every fit, resume and refit, and an export they were built
    from) at the smallest of their δ, by the relation the guarantee states: per user when every segment protected
    users, else per example, a user-level segment then counting as replace-one (dp-accounting's PLD composes the
    segments, each under its own relation). The weights get ``differentially_private: false`` and the reason when
    any step of their history was taken without DP-SGD or with predictable noise (an explicit seed), when σ = 0, or
    when they were never trained with :class:`~dplit.strategy.DPStrategy`. A change the user declared public
    (``public_change``) is listed and adds no ε.

    Args:
        checkpoint: a loaded Lightning checkpoint of dplit.
        publish_private_diagnostics: state the values of :data:`PRIVATE_DIAGNOSTICS` the run's ledger recorded
            (computed from the private data without noise: each is marked as not covered by ε). Off: none is stated.
    """
    state = _history_state(checkpoint)
    segments = state["segments"]
    counted = PrivacyHistory(_counted_segments(segments))
    dp = dp_segments(segments)
    unit = protected_unit(dp)
    public = [segment for segment in segments if segment.get("kind") == "public_change"]
    facts = {**_training_facts(checkpoint), **_origin_facts(state.get("origin")), "not_covered": _not_covered(unit, dp)}
    record = {"privacy_history": state, "non_private_steps": counted.non_private_steps, "public_changes": len(public)}
    if not dp:
        reason = counted.reason_not_private() or NEVER_PRIVATE
        return {"differentially_private": False, "reason": reason, "protected_unit": unit, **record, **facts}
    ledger = checkpoint.get(CHECKPOINT_KEY)
    last = ledger or dp[-1]
    user_items = {"user_rows": "pairs"} if _users_of_pairs(dp) else {}
    delta, mechanism = _delta_and_mechanism(dp, ledger)
    epsilon, accountant = _epsilon(dp, counted, delta=delta, mechanism=mechanism)
    replace_one = epsilon_under("replace_one", counted.accountant_history(), delta=delta)
    reason = counted.reason_not_private()
    if reason is None and not math.isfinite(epsilon):
        reason = "trained with noise_multiplier = 0: no noise, ε = ∞"
    shared, varying = per_segment_facts(dp, last)
    diagnostics = _diagnostics(ledger, unit) if publish_private_diagnostics else {}
    return {
        "differentially_private": reason is None,
        **({"reason": reason} if reason else {}),
        "epsilon": epsilon if math.isfinite(epsilon) else None,
        "delta": delta,
        "accountant": accountant,
        "protected_unit": unit,
        "neighbouring_relation": _relation_text(dp),
        "epsilon_replace_one": replace_one if math.isfinite(replace_one) else None,
        **{key: value for key, value in shared.items() if key not in USER_FACTS},
        "sampling": last.get("sampling", "poisson"),
        "steps": counted.dp_steps,
        "segments": len(dp),
        "accountant_history": [list(entry) for entry in counted.accountant_history()],
        "dataset_sizes": _dataset_sizes(dp, last),
        "units_per_dataset": _units_per_dataset(dp, last),
        "privacy_unit": privacy_unit_text(
            unit,
            {**shared, **diagnostics, **user_items},
            asked=publish_private_diagnostics,
            dp=dp,
        ),
        **({key: shared[key] for key in USER_FACTS} if unit == "user" else {}),
        **user_items,
        **diagnostics,
        **({"private_diagnostics_published": list(diagnostics)} if diagnostics else {}),
        "clipping": last.get("clipping"),
        **_clip_mode_facts(last, varying),
        "tied_norm": last.get("tied_norm"),
        **({"packing": last["packing"]} if last.get("packing") else {}),
        "noise": _noise_sources(dp),
        "run_id": last.get("run_id"),
        "per_segment": varying,
        **_people_facts(segments, delta=delta, mechanism=mechanism),
        **record,
        **facts,
    }


CLIP_MODE_FACTS = (
    "automatic_stability", "target_quantile", "clip_learning_rate", "count_noise_multiplier",
    "gradient_noise_multiplier", "clip_bound",
)  # fmt: skip
"""The clipping mode's own facts a card states (quantile: γ, η, σ_b, σ_eff and the last C; automatic: γ)."""

USER_FACTS = ("users", "max_rows_per_user")
"""The user-level counts a per-user guarantee states (a per-example one states none)."""
SEGMENT_FACTS = ("max_grad_norm", "clip_mode", "dataset_size", "users", "max_rows_per_user")
"""Facts each DP segment records: the card states one value only where every segment agrees."""


def _clip_mode_facts(last: dict[str, Any], varying: list[str]) -> dict[str, Any]:
    """The last run's clip-mode facts (γ, η, σ_b, σ_eff, C_t), or none when the segments' clip modes differ."""
    if "clip_mode" in varying:
        return {}
    return {key: last[key] for key in CLIP_MODE_FACTS if last.get(key) is not None}


def per_segment_facts(dp: list[Any], last: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The facts that describe every DP step, and the names of those whose value differs between segments.

    A fact no segment records (an old history) is the last run's; one that differs (σ, q, C, clip mode, N, the
    users' k, ...) is ``None`` in the record and :data:`PER_SEGMENT` on the card, never the last segment's value.
    """
    shared: dict[str, Any] = {}
    varying: list[str] = []
    for key in SEGMENT_FACTS:
        values = {_hashable(segment.get(key)) for segment in dp}
        if len(values) > 1:
            varying.append(key)
        shared[key] = None if len(values) > 1 else (next(iter(values)) if values != {None} else last.get(key))
    shared["clip_mode"] = shared["clip_mode"] or ("fixed" if "clip_mode" not in varying else None)
    entries = [entry for segment in dp for entry in segment["accountant"]]
    for key, index in (("noise_multiplier", 0), ("sample_rate", 1)):
        values = {float(entry[index]) for entry in entries}
        if len(values) > 1:
            varying.append(key)
        shared[key] = last.get(key) if len(values) <= 1 else None
    if {"sample_rate", "dataset_size"} & set(varying):
        varying.append("expected_batch_size")
    shared["expected_batch_size"] = None if "expected_batch_size" in varying else last.get("expected_batch_size")
    return shared, varying


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def _history_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The weights' history as the record states it, with its public starting point when the checkpoint names one."""
    state = history_in_checkpoint(checkpoint, check_weights=True).state_dict()
    saved = checkpoint.get(HISTORY_KEY)
    origin = state.get("origin") or (saved.get("origin") if isinstance(saved, dict) else None)
    return {**state, "origin": origin} if origin is not None else state


def _counted_segments(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ε and the verdict count: DP and non-private segments (a segment of an unknown kind is non-private).

    A declared public change adds no ε and does not make the weights non-private: it is listed, not counted.
    """
    counted = []
    for segment in segments:
        kind = segment.get("kind")
        if kind == "public_change":
            continue
        if kind not in ("dp", "non_private"):
            reason = f"a history segment of a kind this dplit does not know ({kind!r}): its steps cannot be vouched for"
            segment = {"kind": "non_private", "steps": int(segment.get("steps") or 0), "reason": reason}
        counted.append(segment)
    return counted


def _delta_and_mechanism(dp: list[dict[str, Any]], ledger: dict[str, Any] | None) -> tuple[float, str]:
    """δ: the smallest of the segments' (and the last run's), never the last segment's alone; the last accountant."""
    ran = ledger["accountant"] if ledger else dp[-1]
    last_delta = ran["delta"]
    delta = min(smallest_delta(dp, last_delta), last_delta)  # type: ignore[type-var]
    return float(delta), ran["mechanism"]


def _epsilon(dp: list[dict[str, Any]], counted: PrivacyHistory, *, delta: float, mechanism: str) -> tuple[float, str]:
    """ε at δ and the accountant that gave it: the run's (PRV or RDP) for one relation, the PLD for mixed units."""
    if mixed_units(dp):
        return mixed_epsilon(dp, delta=delta), MIXED_ACCOUNTANT
    accountant = PrivacyAccountant(delta=delta, mechanism=mechanism)  # type: ignore[arg-type]
    accountant.load_state_dict({"delta": delta, "mechanism": mechanism, "history": counted.accountant_history()})
    return accountant.epsilon(), mechanism


def _people_facts(segments: list[dict[str, Any]], *, delta: float, mechanism: str) -> dict[str, Any]:
    """What the user stated of each later fit's people, and each dataset's own ε when every fit stated none shared.

    ``people_overlap``: ``[[segment number, statement]]`` (``true``, ``false`` or ``null``: not stated) for every DP
    segment that starts a fit after the first (a refit from an export: DPO after SFT). ``epsilon_per_dataset``:
    ``[[segment numbers, ε]]``, only when every such fit stated ``people_overlap: false``.
    """
    starts = later_runs(segments)
    if not starts:
        return {}
    facts: dict[str, Any] = {"people_overlap": [[index + 1, segments[index].get("people_overlap")] for index in starts]}
    groups = disjoint_datasets(segments)
    if groups is not None:
        facts["epsilon_per_dataset"] = [
            [[index + 1 for index in group], _group_epsilon([segments[i] for i in group], delta, mechanism)]
            for group in groups
        ]
    return facts


def _group_epsilon(group: list[dict[str, Any]], delta: float, mechanism: str) -> float | None:
    """ε at δ of some DP segments alone (``None``: infinite, σ = 0)."""
    epsilon, _ = _epsilon(group, PrivacyHistory(group), delta=delta, mechanism=mechanism)
    return epsilon if math.isfinite(epsilon) else None


def _users_of_pairs(dp: list[dict[str, Any]]) -> bool:
    """Whether every DP segment protected users whose items are preference pairs (``dplit dpo`` over users)."""
    return bool(dp) and all(s.get("privacy_unit") == "user" and s.get("user_rows") == "pairs" for s in dp)


def _relation_text(dp: list[dict[str, Any]]) -> str:
    if mixed_units(dp):
        return MIXED_RELATION
    if protected_unit(dp) != "user":
        return NEIGHBOURING_RELATION
    return USER_RELATION.replace("user's rows", "user's preference pairs") if _users_of_pairs(dp) else USER_RELATION


def _not_covered(unit: str, dp: list[dict[str, Any]]) -> list[str]:
    """What ε does not cover; a per-user guarantee covers a person's rows as one unit (no group-privacy item).

    With a DPO segment (over pairs, or over users' pairs), the training pairs' DPO values follow the diagnostics item.
    """
    items = [item for item in NOT_COVERED if not (unit == "user" and item == GROUP_PRIVACY)]
    if any(segment.get("privacy_unit") == "pair" or segment.get("user_rows") == "pairs" for segment in dp):
        items.insert(2, PREFERENCE_DIAGNOSTICS)
    return items


def _dataset_sizes(dp: list[dict[str, Any]], last: dict[str, Any]) -> list[int]:
    """Every distinct N the DP segments trained on, in order (the last run's when no segment records one)."""
    sizes = [segment["dataset_size"] for segment in dp if segment.get("dataset_size") is not None]
    return list(dict.fromkeys(sizes)) or ([last["dataset_size"]] if last.get("dataset_size") is not None else [])


def _units_per_dataset(dp: list[dict[str, Any]], last: dict[str, Any]) -> list[list[Any]]:
    """Every distinct (N, what N counts: ``"rows"`` or ``"users"``) of the DP segments, in order."""
    pairs = [
        (segment.get("dataset_size"), _counted(segment.get("privacy_unit")))
        for segment in dp
        if segment.get("dataset_size") is not None
    ]
    if not pairs and last.get("dataset_size") is not None:
        pairs = [(last["dataset_size"], _counted(last.get("privacy_unit")))]
    return [list(pair) for pair in dict.fromkeys(pairs)]


def _counted(unit: str | None) -> str:
    """What a segment's N counts: ``"users"``, ``"pairs"`` (preference pairs) or ``"rows"``."""
    return {"user": "users", "pair": "pairs"}.get(unit or "", "rows")


def _diagnostics(ledger: dict[str, Any] | None, unit: str) -> dict[str, Any]:
    """The private diagnostics the last run's ledger recorded that the guarantee may state (on request only)."""
    if not ledger or unit != "user":
        return {}
    return {key: ledger[key] for key in PRIVATE_DIAGNOSTICS if ledger.get(key) is not None}


def _origin_facts(origin: dict[str, Any] | None) -> dict[str, Any]:
    """The weights' public starting point (e.g. ``hub model gpt2``) and its digest, when the history names them."""
    if not origin:
        return {}
    return {"starting_point": origin.get("description"), "starting_point_digest": origin.get("digest")}


def privacy_unit_text(
    unit: str, facts: dict[str, Any], *, asked: bool = False, dp: list[dict[str, Any]] | None = None
) -> str:
    """What one unit of protection is: a training row, a preference pair, or a user with all of its rows.

    Args:
        unit: ``"user"``, ``"pair"`` or ``"example"`` (:func:`~dplit.privacy.composition.protected_unit`).
        facts: the users' k (``max_rows_per_user``, ``None`` when it differs between segments) and the largest
            user's row count when it is published.
        asked: whether the export asked for private diagnostics (``--publish_private_diagnostics``).
        dp: the DP segments, when known: a per-example claim over some segments of preference pairs says what an
            example is there.
    """
    if unit == "pair":
        return PAIR_UNIT
    if unit != "user":
        pairs = any(segment.get("privacy_unit") == "pair" for segment in dp or [])
        return EXAMPLE_OR_PAIR_UNIT if pairs else PRIVACY_UNIT
    k = facts.get("max_rows_per_user")
    rows = "preference pairs" if facts.get("user_rows") == "pairs" else "rows"
    most = f"at most {k} of them are used" if k is not None else "at most k of them (k per segment, see the history)"
    largest = _largest_user_text(facts.get("largest_user_rows"), asked=asked).replace(" rows", f" {rows}")
    return (
        f"one user (all of that user's training {rows}; {most} in any step, drawn at random, so a user's {rows} "
        f"beyond that are not seen in that step; {largest})"
    )


def _largest_user_text(rows: int | None, *, asked: bool) -> str:
    """The largest user's row count as the card states it: published on request, else why it is not stated."""
    if rows is not None:
        return (
            f"the largest user has {rows} rows, a count computed from the private data without noise and not covered "
            "by ε, stated because the export asked for it (--publish_private_diagnostics)"
        )
    if asked:
        return "the largest user's row count is not stated: not recorded (DPStrategy.private_diagnostics=false)"
    return (
        "the largest user's row count is withheld: it is computed from the private data without noise "
        "(dplit export --publish_private_diagnostics states it)"
    )


def _noise_sources(segments: list[dict[str, Any]]) -> str:
    """How every DP segment's noise was seeded, e.g. ``os_entropy`` or ``explicit_seed (predictable) + os_entropy``."""
    sources = [str(segment.get("noise")) for segment in segments]
    return " + ".join(dict.fromkeys(sources))


def _training_facts(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Model, data source and dplit provenance (paths and names only: no value computed from the data)."""
    model = checkpoint.get("hyper_parameters", {})
    data = checkpoint.get("datamodule_hyper_parameters", {})
    release = checkpoint.get(RELEASE_KEY, {})
    peft = model.get("peft")
    return {
        "base_model": public_name(model.get("pretrained")) or "randomly initialised from model.config",
        "base_model_gguf_file": model.get("gguf_file"),
        "base_model_quantization": quantization_summary(model.get("quantization")),
        "embedding_policy": release.get("embeddings"),
        "tied_embeddings": release.get("tied"),
        "adapters": peft.get("class_path") if isinstance(peft, dict) else None,
        "train_embeddings": model.get("train_embeddings"),
        "data_source": data_source(data),
        "dplit_version": release.get("dplit_version"),
        "dplit_commit": release.get("dplit_commit"),
    }


def quantization_summary(settings: dict[str, Any] | None) -> str | None:
    """``model.quantization`` in a few words (e.g. ``bitsandbytes 4-bit nf4, compute bfloat16``), ``None`` without."""
    if not settings:
        return None
    if settings.get("load_in_8bit"):
        return "bitsandbytes 8-bit (LLM.int8)"
    kind = settings.get("bnb_4bit_quant_type", "fp4")
    double = ", double quantisation" if settings.get("bnb_4bit_use_double_quant") else ""
    return f"bitsandbytes 4-bit {kind}, compute {settings.get('bnb_4bit_compute_dtype', 'float32')}{double}"


def data_source(data: dict[str, Any]) -> str:
    """Where the training rows came from, from the datamodule's hyperparameters."""
    if "task" in data:
        task = data["task"]
        if task == "synthetic":
            return "dplit's built-in synthetic sentiment task (generated, not private)"
        where = (
            f"local {public_name(data['data_dir'])}/train.tsv"
            if data.get("data_dir")
            else f"hub dataset {HUB_DATASET} ({task})"
        )
        return f"GLUE {task}: {where}"
    if data.get("train_file"):
        return f"file {public_name(data['train_file'])}"
    if data.get("dataset", "builtin") == "builtin":
        return "dplit's built-in offline corpus (generated, not private)"
    return f"hub dataset {data['dataset']}"


def public_name(name: str | None) -> str | None:
    """A hub name as it is; a local path by its base name only (a card never publishes a home folder's path)."""
    if not name:
        return None
    text = str(name)
    local = text.startswith(("/", "~", ".", "\\")) or Path(text).expanduser().exists() or text.count("/") > 1
    return Path(text).name if local else text
