"""bench/study/resume.py's input fingerprint: changed data or GGUF files run a recorded arm again.

Rows recorded before the fingerprint existed (the committed studies) are kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import pytest

from bench import clip_modes, user_level
from bench.study import sst2
from bench.study.resume import ENDS, earlier_sitting, file_fingerprint, study_settings, unchanged_inputs
from tests.bench.study_sitting import data_root, sitting, study_argv

RESULTS = Path(__file__).parents[2] / "bench" / "results"


def test_a_file_fingerprint_sees_its_ends_and_size_not_its_mtime(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    content = bytearray(os.urandom(3 * ENDS))
    path.write_bytes(content)
    first = file_fingerprint(path)
    os.utime(path, (1, 1))
    assert file_fingerprint(path) == first and first["size"] == 3 * ENDS
    for where in (0, len(content) - 1):
        changed = content.copy()
        changed[where] ^= 1
        path.write_bytes(changed)
        assert file_fingerprint(path) != first
    path.write_bytes(content + b"x")
    assert file_fingerprint(path) != first
    path.write_bytes(b"small")
    small = file_fingerprint(path)
    path.write_bytes(b"smalL")
    assert file_fingerprint(path) != small


def test_rows_with_other_inputs_run_again_and_rows_without_any_are_kept() -> None:
    now = {"gguf": {"size": 1, "sha256_ends": "a"}}
    rows = [{"name": "same", "inputs": now}, {"name": "old"}, {"name": "changed", "inputs": {"gguf": {"size": 2}}}]
    assert [row["name"] for row in unchanged_inputs(rows, now)] == ["same", "old"]


@pytest.mark.parametrize("study", [user_level, clip_modes])
def test_the_committed_runs_are_kept_whatever_the_files_now(study: ModuleType) -> None:
    args = study.parse_args([])
    _, kept = earlier_sitting(RESULTS / args.out.name, study_settings(args), getattr(study, "migrate", None))
    assert len(kept) == (10 if study is user_level else 25)
    assert unchanged_inputs(kept, {"gguf": {"size": 0, "sha256_ends": "none"}}) == kept


def test_the_input_files_are_the_tsvs_the_arm_reads_and_the_gguf() -> None:
    local = {"data_dir": "/d", "pretrained": "/cache", "gguf_file": None, "gguf_source": "/g/model.gguf"}
    assert sst2.input_files(local) == {"train.tsv": Path("/d/train.tsv"), "dev.tsv": Path("/d/dev.tsv"),
                                       "gguf": Path("/g/model.gguf")}  # fmt: skip
    assert sst2.input_files({"data_dir": None, "pretrained": "/m", "gguf_file": "x.gguf"}) == {
        "gguf": Path("/m/x.gguf")
    }
    assert sst2.input_files({"data_dir": None, "pretrained": "hub/name", "gguf_file": None}) == {}


def arms(study: ModuleType) -> list[str]:
    """The arms of a study at its default settings."""
    return ["example", "user"] if study is user_level else list(clip_modes.arm_flags(clip_modes.parse_args([])))


@pytest.mark.parametrize("study", [user_level, clip_modes])
@pytest.mark.parametrize("changed", ["glue/sst2/train.tsv", "glue/sst2/dev.tsv", "gguf"])
def test_a_resumed_sitting_reruns_the_runs_whose_files_changed(
    study: ModuleType, changed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = data_root(tmp_path)
    argv = study_argv(tmp_path, root, "--train-rows", "40", "--seeds", "0", "1")
    assert len(sitting(study, monkeypatch, argv)) == 2 * len(arms(study))
    assert sitting(study, monkeypatch, argv) == []  # same files (their copies rewritten): nothing to run
    path = tmp_path / "out" / "results.json"
    results = json.loads(path.read_text())
    assert set(results["runs"][0]["inputs"]) == {"train.tsv", "dev.tsv", "gguf"}
    for row in results["runs"]:
        if row["seed"] == 1:
            del row["inputs"]  # as a row recorded before inputs were fingerprinted
    path.write_text(json.dumps(results))
    target = root / sst2.GGUF_DIR / sst2.GGUF_FILE if changed == "gguf" else root / changed
    target.write_bytes(target.read_bytes().replace(b"\t0\n", b"\t1\n", 1) if changed != "gguf" else b"GGUF v2")
    assert [run["name"] for run in sitting(study, monkeypatch, argv)] == [f"{arm}_seed0" for arm in arms(study)]
    names = {row["name"] for row in json.loads(path.read_text())["runs"]}
    assert names == {f"{arm}_seed{seed}" for arm in arms(study) for seed in (0, 1)}
