"""The seal between an export's weight files and its ``dp_guarantee.json``: each alone says whether the other belongs.

``dplit export`` writes the guarantee's SHA-256 (of everything in it but the seal) into the metadata of every weight
file it writes (safetensors' string header), then the SHA-256 of every weight file into the guarantee's ``seal``.
So a folder whose weights were re-saved (plain transformers writes no dplit entry), edited, dropped or joined by
others, or whose guarantee was edited or left behind, no longer matches, and a model built on it gets weights of
unknown history (not differentially private), never a fresh public base.

What the seal covers: accidents and honest mistakes (a copy that left a file behind, weights trained further outside
dplit and saved back, a hand edit of the JSON). It is not a signature: whoever rewrites both the weights and the
guarantee, recomputing the digests, forges it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from safetensors import safe_open

GUARANTEE_FILE = "dp_guarantee.json"
"""The machine-readable guarantee of a dplit export (its ``privacy_history`` is inherited by a model built on it)."""
SEAL_KEY = "seal"
"""The guarantee's entry holding ``{"guarantee_sha256", "weight_files": {name: sha256}}``."""
METADATA_KEY = "dplit_guarantee_sha256"
"""The safetensors metadata entry of each exported weight file: the SHA-256 of the guarantee it belongs to."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
"""Files that can hold weights (transformers, peft, PyTorch, GGUF, TensorFlow, Flax)."""
CARD_MARKS = ("# Differentially private ", "# NOT differentially private ")
"""How the first line of a dplit model card begins."""
CONFIG_FILE = "config.json"
"""The model config, which carries :data:`METADATA_KEY` too: transformers keeps an unknown config entry through
``from_pretrained`` and ``save_pretrained``, so weights re-saved into another folder still say where they came from."""


@dataclass(frozen=True)
class ExportCheck:
    """What a model folder is: ``plain`` (no trace of dplit), ``sealed`` (an intact export) or ``broken``."""

    kind: Literal["plain", "sealed", "broken"]
    guarantee: dict[str, Any] | None = None
    """The export's guarantee (``sealed`` only)."""
    reason: str | None = None
    """Why the weights cannot be tied to a dplit guarantee (``broken`` only), in words a card can publish."""


def guarantee_digest(guarantee: dict[str, Any]) -> str:
    """SHA-256 of the guarantee without its seal (sorted keys, strict JSON: what the weight files carry)."""
    body = {key: value for key, value in guarantee.items() if key != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def seal_export(folder: Path, guarantee: dict[str, Any]) -> dict[str, Any]:
    """Write the guarantee's digest into every weight file of ``folder``; the guarantee with its seal.

    Raises:
        ValueError: for a weight file that is not safetensors (dplit writes no other kind).
    """
    digest = guarantee_digest(guarantee)
    _mark_config(folder / CONFIG_FILE, digest)
    files = {}
    for path in weight_files(folder):
        if path.suffix != ".safetensors":
            raise ValueError(f"cannot seal {path.name}: dplit exports only safetensors weight files")
        _add_metadata(path, {METADATA_KEY: digest})
        files[path.name] = file_sha256(path)
    return {**guarantee, SEAL_KEY: {"guarantee_sha256": digest, "weight_files": files}}


def check_export(folder: Path) -> ExportCheck:
    """Whether ``folder``'s weights are those of an intact dplit export, of none, or of a broken one."""
    guarantee_path, files = folder / GUARANTEE_FILE, weight_files(folder)
    if not guarantee_path.is_file():
        marked = next((path.name for path in files if METADATA_KEY in _metadata(path)), None)
        marked = marked or (CONFIG_FILE if METADATA_KEY in _json(folder / CONFIG_FILE) else None)
        if marked is not None:
            return _broken(f"{marked} belongs to a dplit export, but its {GUARANTEE_FILE} is missing")
        if _is_dplit_card(folder / "README.md"):
            return _broken(f"README.md is a dplit model card, but the export's {GUARANTEE_FILE} is missing")
        return ExportCheck("plain")
    try:
        guarantee = json.loads(guarantee_path.read_text())
    except (OSError, ValueError):
        return _broken(f"its {GUARANTEE_FILE} cannot be read")
    reason = _seal_mismatch(guarantee, {path.name: path for path in files})
    return _broken(reason) if reason else ExportCheck("sealed", guarantee=guarantee)


def weight_files(folder: Path) -> list[Path]:
    """The files directly in ``folder`` that can hold weights, sorted by name."""
    return sorted(path for path in folder.iterdir() if path.is_file() and path.suffix in WEIGHT_SUFFIXES)


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 16 MB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _seal_mismatch(guarantee: dict[str, Any], files: dict[str, Path]) -> str | None:
    seal = guarantee.get(SEAL_KEY)
    if not isinstance(seal, dict) or not isinstance(seal.get("weight_files"), dict):
        return (
            f"its {GUARANTEE_FILE} has no seal binding it to the weight files (written by a dplit before exports "
            "were sealed, or edited): export the checkpoint again"
        )
    if guarantee_digest(guarantee) != seal.get("guarantee_sha256"):
        return f"its {GUARANTEE_FILE} was changed after the export (its digest no longer matches its seal)"
    listed: dict[str, str] = seal["weight_files"]
    missing, extra = sorted(set(listed) - set(files)), sorted(set(files) - set(listed))
    if missing:
        return f"the exported weight file {missing[0]} is missing"
    if extra:
        return f"the weight file {extra[0]} was not part of the export"
    changed = next((name for name, sha in listed.items() if file_sha256(files[name]) != sha), None)
    if changed is not None:
        return f"{changed} is not the file exported with {GUARANTEE_FILE} (changed or re-saved since)"
    return None


def _broken(reason: str) -> ExportCheck:
    return ExportCheck("broken", reason=reason)


def _metadata(path: Path) -> dict[str, str]:
    if path.suffix != ".safetensors":
        return {}
    try:
        with safe_open(str(path), "pt") as file:
            return dict(file.metadata() or {})
    except Exception:  # a damaged file carries no metadata dplit can read  # noqa: BLE001
        return {}


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _mark_config(path: Path, digest: str) -> None:
    """Write the guarantee's digest into the model config (when the export has one: an adapter folder has not)."""
    config = _json(path)
    if config:
        path.write_text(json.dumps({**config, METADATA_KEY: digest}, indent=2, sort_keys=True) + "\n")


def sealed_weight_files(folder: Path) -> list[str]:
    """The weight files the guarantee in ``folder`` lists in its seal (none without a readable one)."""
    seal = _json(folder / GUARANTEE_FILE).get(SEAL_KEY)
    files = seal.get("weight_files") if isinstance(seal, dict) else None
    return sorted(files) if isinstance(files, dict) else []


def _is_dplit_card(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8", errors="replace") as file:
            first = file.readline()
    except OSError:
        return False
    return first.startswith(CARD_MARKS)


def _add_metadata(path: Path, entries: dict[str, str]) -> None:
    """Rewrite a safetensors file with ``entries`` added to its metadata, byte for byte deterministic.

    The format is an 8-byte little-endian header length, a JSON header (``__metadata__`` and each tensor's dtype,
    shape and offsets into the data that follows) and the data. Only the header is rewritten (metadata keys sorted,
    padded with spaces to 8 bytes as safetensors writes it); the tensors' bytes are copied as they are. (safetensors'
    own ``save_file`` orders metadata keys differently from call to call, so two exports of one checkpoint would differ.)
    """
    with path.open("rb") as source:
        (length,) = struct.unpack("<Q", source.read(8))
        header = json.loads(source.read(length))
        metadata = {**(header.pop("__metadata__", None) or {}), **entries}
        text = json.dumps({"__metadata__": dict(sorted(metadata.items())), **header}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        staging = path.with_name(f".{path.name}.sealing")
        with staging.open("wb") as target:
            target.write(struct.pack("<Q", len(text)) + text)
            shutil.copyfileobj(source, target, length=1 << 24)
    os.replace(staging, path)
