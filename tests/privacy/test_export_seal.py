"""An export's weight files and its guarantee name each other: any route that separates them is caught (issue 49 §2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dplit.privacy.export_seal import (
    GUARANTEE_FILE,
    METADATA_KEY,
    check_export,
    guarantee_digest,
    seal_export,
    sealed_weight_files,
)
from dplit.privacy.history import PrivacyHistory, inherited_history

GUARANTEE: dict[str, Any] = {
    "differentially_private": True, "epsilon": 1.5, "delta": 1e-5,
    "privacy_history": {
        "version": 2, "origin": {"description": "hub model gpt2", "digest": "ab"}, "digest": "cd",
        "segments": [{"kind": "dp", "run_id": "r", "accountant": [[1.0, 0.1, 8]], "noise_secure": True}],
    },
}  # fmt: skip


def sealed_export(folder: Path, *, files: tuple[str, ...] = ("model.safetensors",)) -> Path:
    """A folder as ``dplit export`` leaves it: weight files, a card, and the sealed guarantee."""
    folder.mkdir()
    for index, name in enumerate(files):
        save_file({"weight": torch.full((3, 2), float(index))}, str(folder / name), metadata={"format": "pt"})
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    (folder / "README.md").write_text("# Differentially private causal LM: (ε = 1.5, δ = 1e-05)\n")
    guarantee = seal_export(folder, GUARANTEE)
    (folder / GUARANTEE_FILE).write_text(json.dumps(guarantee, indent=1))
    return folder


def test_an_intact_export_is_sealed_both_ways(tmp_path: Path) -> None:
    folder = sealed_export(
        tmp_path / "export", files=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    )
    check = check_export(folder)
    assert check.kind == "sealed" and check.guarantee is not None
    digest = guarantee_digest(GUARANTEE)
    assert check.guarantee["seal"]["guarantee_sha256"] == digest and len(check.guarantee["seal"]["weight_files"]) == 2
    with safe_open(str(folder / "model-00002-of-00002.safetensors"), "pt") as file:
        assert file.metadata() == {"format": "pt", METADATA_KEY: digest}
        assert torch.equal(file.get_tensor("weight"), torch.full((3, 2), 1.0))  # the tensors are unchanged
    segments, origin = inherited_history(str(folder))
    assert PrivacyHistory(segments).accountant_history() == [(1.0, 0.1, 8)]
    assert json.loads((folder / "config.json").read_text())[METADATA_KEY] == digest
    assert sealed_weight_files(folder) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert origin == "dplit export export (seal intact; its history starts from hub model gpt2)"


def _resaved_elsewhere(folder: Path) -> None:
    """``from_pretrained(export).save_pretrained(elsewhere)``: the config (with its mark) and fresh weights, alone."""
    for path in folder.iterdir():
        if path.name != "config.json":
            path.unlink()
    save_file({"weight": torch.full((3, 2), 0.0)}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _drop_guarantee(folder: Path) -> None:
    (folder / GUARANTEE_FILE).unlink()


def _weights_only(folder: Path) -> None:
    for path in folder.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            path.unlink()


def _resave_weights(folder: Path) -> None:
    save_file({"weight": torch.full((3, 2), 7.0)}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _edit_history(folder: Path) -> None:
    guarantee = json.loads((folder / GUARANTEE_FILE).read_text())
    guarantee["privacy_history"]["segments"][0]["accountant"] = [[1.0, 0.1, 2]]  # fewer steps: a smaller ε
    (folder / GUARANTEE_FILE).write_text(json.dumps(guarantee))


def _remove_seal(folder: Path) -> None:
    guarantee = json.loads((folder / GUARANTEE_FILE).read_text())
    del guarantee["seal"]
    (folder / GUARANTEE_FILE).write_text(json.dumps(guarantee))


def _add_weight_file(folder: Path) -> None:
    save_file({"extra": torch.ones(2)}, str(folder / "extra.safetensors"))


def _remove_weight_file(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model.safetensors.old")


def _bin_beside(folder: Path) -> None:
    torch.save({"weight": torch.zeros(3, 2)}, folder / "pytorch_model.bin")


def _card_only(folder: Path) -> None:
    _drop_guarantee(folder)
    _resave_weights(folder)
    (folder / "config.json").write_text('{"model_type": "gpt2"}')  # a config written anew


ROUTES = {
    "re-saved elsewhere": (_resaved_elsewhere, "config.json belongs to a dplit export, but its dp_guarantee.json is missing"),
    "guarantee not copied": (
        _drop_guarantee,
        "model.safetensors belongs to a dplit export, but its dp_guarantee.json is missing",
    ),
    "weights alone": (
        _weights_only,
        "model.safetensors belongs to a dplit export, but its dp_guarantee.json is missing",
    ),
    "weights re-saved": (_resave_weights, "model.safetensors is not the file exported with dp_guarantee.json"),
    "history edited": (_edit_history, "dp_guarantee.json was changed after the export"),
    "seal removed": (_remove_seal, "has no seal binding it to the weight files"),
    "file added": (_add_weight_file, "the weight file extra.safetensors was not part of the export"),
    "file removed": (_remove_weight_file, "the exported weight file model.safetensors is missing"),
    "bin beside": (_bin_beside, "the weight file pytorch_model.bin was not part of the export"),
    "card without guarantee": (
        _card_only,
        "README.md is a dplit model card, but the export's dp_guarantee.json is missing",
    ),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_that_separates_weights_and_guarantee_gives_weights_of_unknown_history(
    tmp_path: Path, route: str
) -> None:
    change, reason = ROUTES[route]
    folder = sealed_export(tmp_path / "export")
    change(folder)
    check = check_export(folder)
    assert check.kind == "broken" and check.reason is not None and reason in check.reason
    segments, origin = inherited_history(str(folder))
    history = PrivacyHistory(segments)
    assert history.accountant_history() == [] and origin == "folder export, weights of unknown history"
    assert history.reason_not_private() == f"built from weights of unknown history (folder export: {check.reason})"


def test_a_folder_without_any_trace_of_dplit_is_a_plain_base(tmp_path: Path) -> None:
    folder = sealed_export(tmp_path / "export")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert METADATA_KEY in json.loads((folder / "config.json").read_text())
    (plain / "config.json").write_text('{"model_type": "gpt2"}')
    save_file({"weight": torch.zeros(3, 2)}, str(plain / "model.safetensors"), metadata={"format": "pt"})
    (plain / "README.md").write_text("# gpt2\n")
    assert check_export(plain).kind == "plain" and inherited_history(str(plain)) == ([], None)


def hub_cache_with(tmp_path: Path, folder: Path, files: tuple[str, ...]) -> Path:
    """A Hugging Face hub cache holding ``files`` of ``folder`` as the downloaded snapshot of ``org/private-sft``."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--private-sft"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copy(folder / name, snapshot / name)
    return cache


@pytest.mark.parametrize(
    ("files", "kind"),
    [
        (("config.json", "model.safetensors", GUARANTEE_FILE), "sealed"),  # pushed with its guarantee
        (("config.json", "model.safetensors"), "broken"),  # the weights pushed alone
    ],
    ids=["with guarantee", "weights alone"],
)
def test_a_dplit_export_pushed_to_the_hub_is_found_in_its_downloaded_snapshot(
    tmp_path: Path, files: tuple[str, ...], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dplit.backbone.causal_lm import downloaded_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the guarantee is fetched only when the hub answers: not here
    cache = hub_cache_with(tmp_path, sealed_export(tmp_path / "export"), files)
    snapshot = downloaded_folder("org/private-sft", cache_dir=cache, fetch=(GUARANTEE_FILE,))
    assert snapshot is not None and snapshot.name == "0" * 40
    assert check_export(snapshot).kind == kind
    segments, origin = inherited_history(snapshot, name="hub model org/private-sft")
    assert origin is not None and origin.startswith("dplit export hub model org/private-sft" if kind == "sealed" else "hub model org/private-sft, weights of unknown history")
    assert (PrivacyHistory(segments).reason_not_private() is None) == (kind == "sealed")
    assert downloaded_folder("org/never-downloaded", cache_dir=cache) is None


def test_sealing_is_byte_for_byte_deterministic(tmp_path: Path) -> None:
    """Two exports of one checkpoint are the same files (safetensors' own writer orders metadata at random)."""
    first, second = sealed_export(tmp_path / "a"), sealed_export(tmp_path / "b")
    for name in ("model.safetensors", GUARANTEE_FILE, "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    header = (first / "model.safetensors").read_bytes()
    assert header[8:].startswith(b'{"__metadata__":{"dplit_guarantee_sha256":')  # sorted keys, first in the header
