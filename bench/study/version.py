"""Which code a study arm's numbers come from: a reviewed study code version, not the git history of dplit/.

A study (:mod:`bench.tying`) records each arm with a fingerprint, and a rerun skips every arm whose fingerprint
is already recorded. Until format 2 the fingerprint's code part was "the last commit that changed dplit/ or
configs/": a refactor that moves files and changes no number (issue 33) would have made every recorded arm look
stale, and the study would have run the whole grid again. A fingerprint (:func:`fingerprint`, format 2) now holds:

* ``code``: :data:`STUDY_CODE_VERSION`, a name for what the arms compute, changed by hand (reviewed) when a change
  alters their numbers; plus ``+uncommitted:<digest>`` while dplit/ or configs/ differ from HEAD
  (:func:`study_code_version`), so arms run on code nobody committed never pass for the reviewed version.
* ``config``: a digest of the arm's shipped config by content (:func:`config_digest`: the parsed YAML, class paths by
  class name): a changed value in ``configs/smollm2_sst2_*.yaml`` invalidates the arms that use it, by itself.
* ``command``: the arm's dplit command line as the study builds it, without this machine's paths, with classes by
  class name and the config by file name (:func:`portable_command`): another flag or value invalidates the arm.

So moving or renaming modules and files (``dplit/...``, ``benchmarks/`` → ``bench/``, a class to another module, the
configs to another folder), rewrapping a config and any change that alters no number keep every recorded arm; a
changed config value, flag, class name or default of the study, or a bump of :data:`STUDY_CODE_VERSION`, runs them
again. ``tests/bench/test_tying_study.py`` replans every committed grid (``bench/results/tying/**/results.json``) with
the current code and fails when a rerun would run any arm it recorded: a move that silently changed a fingerprint
fails CI, and a deliberate bump must say what becomes of the committed grids.

Bump :data:`STUDY_CODE_VERSION` (to any new name: the date and the change, say) in the commit that changes what an
arm computes for the same command: the DP-SGD step (Poisson sampling, clipping, the noise and the order it is drawn
in, σ's calibration, accounting), the model, loss, label words or embedding policies, LoRA, data reading and
tokenisation, the optimiser and its schedule, validation; or the library versions the arms run on. When unsure,
rerun a recorded arm (``python -m bench.tying --arms dp_tied --train-examples 160 --seeds 0 --epsilons 3 --out
DIR``) and compare it with the recorded row: with common noise an arm is deterministic on the CPU, so its
``step_batch_sizes``, ``noise_multiplier``, ``epsilon_spent`` and ``val_acc`` must match exactly and its ``val_loss`` to
float32 rounding (another CPU's kernels round differently).

Rows recorded in format 1 are read by :func:`migrate_fingerprint`, which rewrites them from their own text.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

from bench.machine import ROOT

STUDY_CODE_VERSION = "e6006579a55e3cb5fcff3883e094ad616b2e3daf"
"""What the arms compute, by name: the code version every committed tying grid was recorded with.

It is the commit e6006579 (the last commit that changed dplit/ or configs/ when the 187 arms of
``bench/results/tying/results.json`` ran: the code part of their format-1 fingerprints). The 27 commits to
dplit/ and configs/ between it and 8e73ecf add refusals, the privacy history, checkpoint integrity and messages; none
changes what an arm computes (for weights without a history σ is calibrated as before). Checked by rerunning two
recorded arms at 8e73ecf (DP tied and DP LoRA + untied, 160 rows, ε = 3, seed 0, on an AMD EPYC where the grid ran on
an Intel Xeon, same package versions): the same command, Poisson batch sizes, σ, ε and validation accuracy, and the
validation loss to 1.2e-7 relative (float32 kernels of another CPU). Change it when an arm's numbers change (see the
module docstring)."""

FORMAT = 2
"""The fingerprint format this code writes (format 1: no ``format`` key, code = the last commit of dplit/, configs/)."""

CODE_PATHS = ("dplit", "configs")
"""The code an arm runs besides the study's own: uncommitted changes there are part of the code version."""

RECORDED_CONFIG_DIGESTS = {
    "e6006579a55e3cb5fcff3883e094ad616b2e3daf": {
        "smollm2_sst2_tied.yaml": "19305f13b0b7fa48",
        "smollm2_sst2_untied.yaml": "8b5bb4ad77f08c1e",
        "smollm2_sst2_lora.yaml": "af2ed76b9556a84d",
    },
}
"""The :func:`config_digest` of each config at a format-1 code version, for :func:`migrate_fingerprint` (format 1 did
not record it; the configs at e6006579 are byte for byte the ones at 8e73ecf)."""

_CLASS_PATH = re.compile(r"(?:[a-z_][a-z0-9_]*\.)+([A-Z][A-Za-z0-9_]*)")


def class_name(value: Any) -> Any:
    """``value`` with every class path reduced to its class name, in nested lists and dicts too.

    ``dplit.embeddings.UntiedEmbeddings`` becomes ``UntiedEmbeddings``: where a class lives is not what it computes.
    """
    if isinstance(value, str):
        match = _CLASS_PATH.fullmatch(value)
        return match.group(1) if match else value
    if isinstance(value, list):
        return [class_name(item) for item in value]
    if isinstance(value, dict):
        return {key: class_name(item) for key, item in value.items()}
    return value


def portable_command(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """The dplit command line as a fingerprint holds it.

    Machine paths replaced, class paths (as values or inside a JSON value) by class name, the config by its file name.
    """
    command = []
    for index, item in enumerate(argv):
        item = replacements.get(item, item)
        if index and argv[index - 1] == "--config":
            item = PurePosixPath(item).name
        elif item[:1] in "[{":
            try:
                item = json.dumps(class_name(json.loads(item)))
            except ValueError:
                pass
        else:
            item = class_name(item)
        command.append(item)
    return command


def config_digest(path: Path) -> str:
    """A digest of a dplit config by content: its parsed YAML, class paths by class name.

    Comments, layout, key order and the module a class lives in do not count.
    """
    import yaml

    data = class_name(yaml.safe_load(path.read_text(encoding="utf-8")))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(code: str, config: str | None, command: list[str]) -> str:
    """What makes two runs of a study the same run (format :data:`FORMAT`).

    The code version, the digest of the config and the portable command (:func:`portable_command`).
    """
    return json.dumps({"format": FORMAT, "code": code, "config": config, "command": command})


def migrate_fingerprint(text: str) -> str:
    """A recorded fingerprint in the current format.

    Format 1: its command made portable, its config digest from :data:`RECORDED_CONFIG_DIGESTS`, ``None`` for a code
    version not listed there, which then matches nothing.
    """
    recorded = json.loads(text)
    if recorded.get("format") == FORMAT:
        return text
    command = recorded["command"]
    name = PurePosixPath(command[command.index("--config") + 1]).name if "--config" in command else None
    config = RECORDED_CONFIG_DIGESTS.get(recorded["code"], {}).get(name) if name else None
    return fingerprint(recorded["code"], config, portable_command(command, {}))


def study_code_version(root: Path = ROOT) -> str:
    """:data:`STUDY_CODE_VERSION`, plus a digest of the uncommitted changes under :data:`CODE_PATHS` if any.

    Outside a git checkout none can be seen, and the version is :data:`STUDY_CODE_VERSION`.
    """

    def git(*command: str) -> str:
        try:
            done = subprocess.run(["git", *command], cwd=root, capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return done.stdout if done.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS)
    if not dirty.strip():
        return STUDY_CODE_VERSION
    digest = hashlib.sha256(git("diff", "HEAD", "--", *CODE_PATHS).encode())
    for name in sorted(line[3:] for line in dirty.splitlines() if line.startswith("??")):
        digest.update(name.encode() + b"\0")
        try:
            digest.update((root / name).read_bytes())
        except OSError:  # removed since git listed it
            pass
    return f"{STUDY_CODE_VERSION}+uncommitted:{digest.hexdigest()[:12]}"
