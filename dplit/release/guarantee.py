"""The (ε, δ) guarantee of a trained checkpoint, as ``dp_guarantee.json`` and a model card a privacy reviewer reads."""

from __future__ import annotations

import math
from typing import Any

from dplit.data.sources import HUB_DATASET
from dplit.privacy.accountant import PrivacyAccountant
from dplit.privacy.ledger import history_steps
from dplit.release.provenance import RELEASE_KEY
from dplit.strategy import CHECKPOINT_KEY

GUARANTEE_FILE = "dp_guarantee.json"
PRIVACY_UNIT = "one training example (one row of the training data)"
NOT_COVERED = (
    "choosing hyperparameters (learning rate, C, epochs, ...) by runs on the private data: each such run spends "
    "privacy that this ε does not count",
    "the train/* diagnostics a run logs (training loss, clipped share, gradient norms): computed from the private "
    "data without noise, so they must not be released",
    "validation metrics computed on data that is itself private (val/*): only the model's weights are covered",
    "the non-secure RNG: noise and Poisson sampling come from torch's generators seeded from the operating "
    "system's entropy, not from a cryptographically secure sampler, and floating-point noise is not "
    "hardened against floating-point attacks",
    "the pretraining data of the base model and any data outside the training set",
    "groups of rows: a person with k rows in the training data is protected at about k·ε",
)


def guarantee_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The privacy facts of a loaded Lightning checkpoint (``checkpoint["dplit_privacy"]``, hyperparameters).

    A checkpoint trained without :class:`~dplit.strategy.DPStrategy`, with σ = 0 or with an explicit (predictable)
    seed gets ``differentially_private: false`` and the reason.
    """
    facts = {**_training_facts(checkpoint), "not_covered": list(NOT_COVERED)}
    ledger = checkpoint.get(CHECKPOINT_KEY)
    if ledger is None:
        reason = "trained without dplit.strategy.DPStrategy (no clipping, no noise, no privacy ledger)"
        return {"differentially_private": False, "reason": reason, **facts}
    state = ledger["accountant"]
    accountant = PrivacyAccountant(delta=state["delta"], mechanism=state["mechanism"])
    accountant.load_state_dict(state)
    epsilon = accountant.epsilon()
    private, reason = True, None
    if not math.isfinite(epsilon):
        private, reason = False, "trained with noise_multiplier = 0: no noise, ε = ∞"
    elif not ledger.get("noise_secure", False):
        private, reason = False, "trained with DPStrategy.seed set: the noise is predictable from the config"
    return {
        "differentially_private": private,
        **({"reason": reason} if reason else {}),
        "epsilon": epsilon if math.isfinite(epsilon) else None,
        "delta": state["delta"],
        "accountant": state["mechanism"],
        "noise_multiplier": ledger.get("noise_multiplier"),
        "max_grad_norm": ledger.get("max_grad_norm"),
        "expected_batch_size": ledger.get("expected_batch_size"),
        "sample_rate": ledger.get("sample_rate"),
        "sampling": ledger.get("sampling", "poisson"),
        "steps": history_steps(state["history"]),
        "accountant_history": [list(entry) for entry in state["history"]],
        "dataset_size": ledger.get("dataset_size"),
        "privacy_unit": PRIVACY_UNIT,
        "clipping": ledger.get("clipping"),
        "tied_norm": ledger.get("tied_norm"),
        "noise": ledger.get("noise"),
        "run_id": ledger.get("run_id"),
        **facts,
    }


def _training_facts(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Model, data source and dplit provenance (paths and names only: no value computed from the data)."""
    model = checkpoint.get("hyper_parameters", {})
    data = checkpoint.get("datamodule_hyper_parameters", {})
    release = checkpoint.get(RELEASE_KEY, {})
    peft = model.get("peft")
    return {
        "base_model": model.get("pretrained") or "randomly initialised from model.config",
        "base_model_gguf_file": model.get("gguf_file"),
        "embedding_policy": release.get("embeddings"),
        "tied_embeddings": release.get("tied"),
        "adapters": peft.get("class_path") if isinstance(peft, dict) else None,
        "train_embeddings": model.get("train_embeddings"),
        "data_source": data_source(data),
        "dplit_version": release.get("dplit_version"),
        "dplit_commit": release.get("dplit_commit"),
    }


def data_source(data: dict[str, Any]) -> str:
    """Where the training rows came from, from the datamodule's hyperparameters."""
    if "task" in data:
        task = data["task"]
        if task == "synthetic":
            return "dplit's built-in synthetic sentiment task (generated, not private)"
        where = f"{data['data_dir']}/train.tsv" if data.get("data_dir") else f"hub dataset {HUB_DATASET} ({task})"
        return f"GLUE {task}: {where}"
    if data.get("train_file"):
        return f"file {data['train_file']}"
    if data.get("dataset", "builtin") == "builtin":
        return "dplit's built-in offline corpus (generated, not private)"
    return f"hub dataset {data['dataset']}"


def model_card(guarantee: dict[str, Any], *, kind: str) -> str:
    """``README.md`` of an export: the guarantee (or its absence, in the first line), then every fact behind it.

    Args:
        guarantee: :func:`guarantee_of`'s record.
        kind: what the folder holds, e.g. ``"causal LM"`` or ``"label-word classifier (a causal LM)"``.
    """
    if guarantee["differentially_private"]:
        title = (
            f"# Differentially private {kind}: (ε = {guarantee['epsilon']:.4g}, δ = {guarantee['delta']:.3g}) "
            "per training example"
        )
    else:
        title = f"# NOT differentially private {kind}: {guarantee['reason']}"
    lines = [title, "", f"Fine-tuned with dplit {guarantee['dplit_version']} (commit {guarantee['dplit_commit']})."]
    if guarantee["differentially_private"]:
        lines += ["", _statement(guarantee)]
    lines += ["", "## Privacy facts", "", "| fact | value |", "|---|---|"]
    lines += [f"| {name} | {_shown(guarantee.get(key))} |" for key, name in _FACTS if key in guarantee]
    lines += ["", "## Not covered by this guarantee", ""]
    lines += [f"- {item}" for item in guarantee["not_covered"]]
    lines += ["", f"The same facts, machine-readable, are in `{GUARANTEE_FILE}`.", ""]
    return "\n".join(lines)


def _statement(g: dict[str, Any]) -> str:
    return (
        f"The weights in this folder are ({g['epsilon']:.4g}, {g['delta']:.3g})-differentially private with respect "
        f"to {g['privacy_unit']} of the {g['dataset_size']} training rows: DP-SGD with {g['sampling']} sampling "
        f"(rate q = {g['sample_rate']:.6g}, expected batch {g['expected_batch_size']:.6g}), every example's gradient "
        f"clipped to norm C = {g['max_grad_norm']} ({g['clipping']} clipping), Gaussian noise of σ = "
        f"{g['noise_multiplier']:.6g} times C once per step, {g['steps']} steps, ε from the {g['accountant']} "
        "accountant. Anything computed from these weights alone (generated text, predictions) has the same guarantee."
    )


_FACTS = (
    ("epsilon", "ε"),
    ("delta", "δ"),
    ("accountant", "accountant"),
    ("noise_multiplier", "noise multiplier σ"),
    ("max_grad_norm", "clipping bound C"),
    ("expected_batch_size", "expected batch size"),
    ("sample_rate", "sampling rate q"),
    ("sampling", "sampling method"),
    ("steps", "DP steps"),
    ("dataset_size", "training rows N"),
    ("privacy_unit", "privacy unit"),
    ("clipping", "clipping mode"),
    ("tied_norm", "tied-weight norm"),
    ("noise", "noise seeding"),
    ("embedding_policy", "embedding policy"),
    ("tied_embeddings", "tied embeddings"),
    ("adapters", "adapters"),
    ("train_embeddings", "embeddings trained"),
    ("data_source", "data source"),
    ("base_model", "base model"),
    ("base_model_gguf_file", "base model GGUF file"),
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
