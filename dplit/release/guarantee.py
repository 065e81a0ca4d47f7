"""The (ε, δ) guarantee of a trained checkpoint, as ``dp_guarantee.json`` and a model card a privacy reviewer reads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dplit.data.sources import HUB_DATASET
from dplit.privacy.accounting import PrivacyAccountant
from dplit.privacy.accounting.relations import epsilon_under
from dplit.privacy.history import GUARANTEE_FILE, history_in_checkpoint, segment_steps
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.release.provenance import RELEASE_KEY

NEIGHBOURING_RELATION = (
    "add/remove one example (ε above); the card publishes N and q, which add/remove treats as secret, so ε under "
    "replace-one (substitution, N public) is given too"
)
NEVER_PRIVATE = "trained without dplit.strategy.DPStrategy (no clipping, no noise, no privacy ledger)"
PRIVACY_UNIT = "one training example (one row of the training data)"
NOT_COVERED = (
    "choosing hyperparameters (learning rate, C, epochs, ...) by runs on the private data: each such run spends "
    "privacy that this ε does not count",
    "the diagnostics a run logs unless DPStrategy.private_diagnostics=false: train/* (loss, accuracy), dp/grad_norm, "
    "dp/clip_fraction, dp/dropped_examples, perf/samples_per_sec (the realised batch size), memory/peak_mb, the "
    "longest training prompt the GLUE datamodule reports and, under user-level DP, the largest user's row count "
    "are computed from the private data without noise, so they must not leave the trust boundary; where this card "
    "states that count, publish the card only if the count may be published",
    "validation metrics computed on data that is itself private (val/*): only the model's weights are covered",
    "the non-secure RNG: noise and Poisson sampling come from torch's generators seeded from the operating "
    "system's entropy, not from a cryptographically secure sampler, and floating-point noise is not "
    "hardened against floating-point attacks",
    "the pretraining data of the base model and any data outside the training set",
    "groups of rows: a person with k rows in the training data is protected at about k·ε",
)


def guarantee_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The privacy facts of a loaded Lightning checkpoint: its weights' privacy history, its run ledger, its model.

    ε composes every DP segment of the weights' history (every fit, resume and refit, and an export they were built
    from), at the last run's δ. The weights get ``differentially_private: false`` and the reason when any step of
    their history was taken without DP-SGD or with predictable noise (an explicit seed), when σ = 0, or when they
    were never trained with :class:`~dplit.strategy.DPStrategy`.
    """
    facts = {**_training_facts(checkpoint), "not_covered": list(NOT_COVERED)}
    history = history_in_checkpoint(checkpoint, check_weights=True)
    ledger = checkpoint.get(CHECKPOINT_KEY)
    record = {"privacy_history": history.state_dict(), "non_private_steps": history.non_private_steps}
    segments = [segment for segment in history.segments if segment["kind"] == "dp"]
    if not segments:
        reason = history.reason_not_private() or NEVER_PRIVATE
        return {"differentially_private": False, "reason": reason, **record, **facts}
    last = ledger or segments[-1]
    # a user is protected only if every DP segment protected users: one example-level segment protects rows only
    unit = last if all(segment.get("privacy_unit") == "user" for segment in segments) else {}
    delta = last["accountant"]["delta"] if ledger else last["delta"]
    mechanism = last["accountant"]["mechanism"] if ledger else last["mechanism"]
    accountant = PrivacyAccountant(delta=delta, mechanism=mechanism)
    accountant.load_state_dict({"delta": delta, "mechanism": mechanism, "history": history.accountant_history()})
    epsilon = accountant.epsilon()
    replace_one = epsilon_under("replace_one", history.accountant_history(), delta=delta)
    reason = history.reason_not_private()
    if reason is None and not math.isfinite(epsilon):
        reason = "trained with noise_multiplier = 0: no noise, ε = ∞"
    return {
        "differentially_private": reason is None,
        **({"reason": reason} if reason else {}),
        "epsilon": epsilon if math.isfinite(epsilon) else None,
        "delta": delta,
        "accountant": mechanism,
        "neighbouring_relation": NEIGHBOURING_RELATION,
        "epsilon_replace_one": replace_one if math.isfinite(replace_one) else None,
        "noise_multiplier": last.get("noise_multiplier"),
        "max_grad_norm": last.get("max_grad_norm"),
        "expected_batch_size": last.get("expected_batch_size"),
        "sample_rate": last.get("sample_rate"),
        "sampling": last.get("sampling", "poisson"),
        "steps": history.dp_steps,
        "segments": len(segments),
        "accountant_history": [list(entry) for entry in history.accountant_history()],
        "dataset_size": last.get("dataset_size"),
        "privacy_unit": privacy_unit_text(unit),
        **_user_counts(unit),
        "clipping": last.get("clipping"),
        "clip_mode": last.get("clip_mode", "fixed"),
        **{key: last[key] for key in CLIP_MODE_FACTS if last.get(key) is not None},
        "tied_norm": last.get("tied_norm"),
        "noise": _noise_sources(segments),
        "run_id": last.get("run_id"),
        **record,
        **facts,
    }


CLIP_MODE_FACTS = (
    "automatic_stability", "target_quantile", "clip_learning_rate", "count_noise_multiplier",
    "gradient_noise_multiplier", "clip_bound",
)  # fmt: skip
"""The clipping mode's own facts a card states (quantile: γ, η, σ_b, σ_eff and the last C; automatic: γ)."""


def _clipping_text(g: dict[str, Any]) -> str:
    """How each unit's gradient was bounded, for the card's statement."""
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


def privacy_unit_text(facts: dict[str, Any]) -> str:
    """What one unit of protection is: a training row, or a user with all of its rows (from the run's facts)."""
    if facts.get("privacy_unit") != "user":
        return PRIVACY_UNIT
    return (
        f"one user (all of that user's training rows; at most {facts.get('max_rows_per_user')} of them are used in "
        f"any step, drawn at random, so a user's rows beyond that are not seen in that step; "
        f"{_largest_user_text(facts.get('largest_user_rows'))})"
    )


def _largest_user_text(rows: int | None) -> str:
    """The largest user's row count as the card states it: a private diagnostic, or why it is not stated."""
    if rows is None:
        return "the largest user's row count is withheld (DPStrategy.private_diagnostics=false, or not recorded)"
    return (
        f"the largest user has {rows} rows, a count computed from the private data without noise and not covered "
        "by ε (withheld under DPStrategy.private_diagnostics=false)"
    )


def _user_counts(facts: dict[str, Any]) -> dict[str, Any]:
    """The user-level counts a card states (none for example-level DP; the largest user's rows when recorded)."""
    if facts.get("privacy_unit") != "user":
        return {}
    counts = {key: facts.get(key) for key in ("users", "max_rows_per_user")}
    return {**counts, "largest_user_rows": facts["largest_user_rows"]} if "largest_user_rows" in facts else counts


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


def model_card(guarantee: dict[str, Any], *, kind: str) -> str:
    """``README.md`` of an export: the guarantee (or its absence, in the first line), then every fact behind it.

    Args:
        guarantee: :func:`guarantee_of`'s record.
        kind: what the folder holds, e.g. ``"causal LM"`` or ``"label-word classifier (a causal LM)"``.
    """
    if guarantee["differentially_private"]:
        title = (
            f"# Differentially private {kind}: (ε = {guarantee['epsilon']:.4g}, δ = {guarantee['delta']:.3g}) "
            "per training example (add/remove one)"
        )
    else:
        title = f"# NOT differentially private {kind}: {guarantee['reason']}"
    lines = [title, "", f"Fine-tuned with dplit {guarantee['dplit_version']} (commit {guarantee['dplit_commit']})."]
    if guarantee["differentially_private"]:
        lines += ["", _statement(guarantee)]
    lines += ["", "## Privacy facts", "", "| fact | value |", "|---|---|"]
    lines += [f"| {name} | {_shown(guarantee.get(key))} |" for key, name in _FACTS if key in guarantee]
    lines += ["", "## Privacy history of these weights", "", *_history_table(guarantee["privacy_history"]["segments"])]
    lines += ["", "## Not covered by this guarantee", ""]
    lines += [f"- {item}" for item in guarantee["not_covered"]]
    lines += ["", f"The same facts, machine-readable, are in `{GUARANTEE_FILE}`.", ""]
    return "\n".join(lines)


def _history_table(segments: list[dict[str, Any]]) -> list[str]:
    """Every segment of the weights' privacy history, one row each (every fit, resume, refit and non-private step)."""
    if not segments:
        return ["No training step is recorded for these weights."]
    rows = ["| # | kind | steps | σ, q (steps) | C | N | noise | note |", "|---|---|---|---|---|---|---|---|"]
    for number, segment in enumerate(segments, start=1):
        if segment["kind"] == "dp":
            entries = ", ".join(f"{sigma:.4g}, {rate:.4g} ({count})" for sigma, rate, count in segment["accountant"])
            facts = [entries, _shown(segment.get("max_grad_norm")), _shown(segment.get("dataset_size"))]
            rows.append(
                f"| {number} | DP-SGD | {segment_steps(segment)} | {' | '.join(facts)} | {_shown(segment.get('noise'))} "
                f"| {_shown(segment.get('note'))} |"
            )
        else:
            rows.append(
                f"| {number} | NOT private | {segment_steps(segment)} | — | — | — | — | {_shown(segment['reason'])} |"
            )
    composed = "ε above composes every DP-SGD row as if all were on the same data (an upper bound for each dataset)."
    return [*rows, "", composed]


def _statement(g: dict[str, Any]) -> str:
    users = "users" in g  # user-level DP: the unit, N and q are users
    unit, units = ("user", "users") if users else ("example", "rows")
    return (
        f"The weights in this folder are ({g['epsilon']:.4g}, {g['delta']:.3g})-differentially private with respect "
        f"to {g['privacy_unit']} of the {g['dataset_size']} training {units}: DP-SGD with {g['sampling']} sampling "
        f"(rate q = {g['sample_rate']:.6g}, expected batch {g['expected_batch_size']:.6g} {units}), every {unit}'s "
        f"{'summed ' if users else ''}gradient {_clipping_text(g)}, "
        f"Gaussian noise of σ = "
        f"{g['noise_multiplier']:.6g} times C once per step, {g['steps']} steps in {g['segments']} segment(s) of the "
        f"weights' privacy history, ε from the {g['accountant']} accountant. Neighbouring datasets differ by adding or "
        f"removing one {unit}; under replace-one (one {unit} substituted, N public) ε = "
        f"{_shown(g.get('epsilon_replace_one'))} (dp-accounting PLD). Anything computed from these weights alone "
        "(generated text, predictions) has the same guarantee."
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
    ("noise", "noise seeding"),
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
