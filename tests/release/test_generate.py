"""``dplit lm generate``: labelled synthetic text from an exported private LM, deterministic for a seed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dplit.cli.lightning_cli import run_lm_cli
from dplit.release.export import export_checkpoint
from dplit.release.generate import (
    MAX_SAMPLES,
    Interrupted,
    SamplingSettings,
    generate_batches,
    load_generator,
    partial_file,
    privacy_line,
    read_prompts,
    write_samples,
)
from tests.helpers.commands import checkpoint_of, lm_args
from tests.helpers.executable import (
    dplit_executable,
    popen_receiving_ctrl_c,
    run_dplit,
    run_dplit_in_process,
    user_environment,
)

PROMPTS = [{"prompt": "the movie is", "label": 1}, {"prompt": "this actress seems so very", "label": 0}]


@pytest.fixture(scope="module")
def exported_lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-epoch private LM quickstart run, exported: (checkpoint, export folder)."""
    root = tmp_path_factory.mktemp("lm")
    run_lm_cli(["fit", *lm_args(root, "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1")])
    checkpoint = checkpoint_of(root)
    return checkpoint, export_checkpoint(checkpoint, root / "export")


def prompts_file(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def rows_for(model: Path, folder: Path, **settings: object) -> list[dict]:
    backbone, tokenizer, _ = load_generator(model)
    prompts = read_prompts(prompts_file(folder))
    return all_rows(backbone, tokenizer, prompts, SamplingSettings(**settings), progress=False)


def test_samples_keep_their_prompt_and_label_and_repeat_for_a_seed(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = exported_lm
    first = rows_for(folder, tmp_path, num_samples=3, max_new_tokens=6, seed=1, batch_size=4)
    assert [(row["prompt"], row["label"], row["sample"]) for row in first] == [
        (p["prompt"], p["label"], index) for p in PROMPTS for index in range(3)
    ]
    assert all(isinstance(row["text"], str) for row in first) and len({row["text"] for row in first}) > 1
    assert rows_for(folder, tmp_path, num_samples=3, max_new_tokens=6, seed=1, batch_size=4) == first
    assert rows_for(folder, tmp_path, num_samples=3, max_new_tokens=6, seed=2, batch_size=4) != first


def test_left_padded_batches_continue_each_prompt_as_alone(exported_lm: tuple[Path, Path], tmp_path: Path) -> None:
    _, folder = exported_lm
    near_greedy = {"num_samples": 2, "max_new_tokens": 6, "temperature": 1e-4}  # sampling ≈ argmax: seeds do not matter
    batched = rows_for(folder, tmp_path, batch_size=4, **near_greedy)
    alone = rows_for(folder, tmp_path, batch_size=1, **near_greedy)
    assert [row["text"] for row in batched] == [row["text"] for row in alone]


def test_a_checkpoint_generates_as_its_export_and_carries_its_guarantee(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    checkpoint, folder = exported_lm
    _, _, from_checkpoint = load_generator(checkpoint)
    _, _, from_folder = load_generator(folder)
    same = {"num_samples": 2, "max_new_tokens": 5, "seed": 3, "batch_size": 2}
    assert rows_for(checkpoint, tmp_path, **same) == rows_for(folder, tmp_path, **same)
    assert from_checkpoint["epsilon"] == from_folder["epsilon"] and from_folder["differentially_private"]
    line = privacy_line(from_folder, 4)
    assert f"ε = {from_folder['epsilon']:.4g}" in line and "post-processing" in line
    assert "NOT differentially private" in privacy_line({"differentially_private": False, "reason": "x"}, 4)


def generate_args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    """``lm generate`` of ``model`` on ``prompts`` into ``out``, on the CPU, with ``extra`` flags."""
    return ["lm", "generate", "--model", str(model), "--prompts_file", str(prompts), "--output_file", str(out),
            "--device", "cpu", *extra]  # fmt: skip


@pytest.mark.slow
def test_the_executable_writes_the_jsonl_and_prints_the_samples_privacy(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = exported_lm
    lines = tmp_path / "prompts.txt"
    lines.write_text("the movie is\n\nthis film is\n")
    out = tmp_path / "synthetic.jsonl"
    result = run_dplit(*generate_args(folder, lines, out, "--num_samples", "2", "--max_new_tokens", "4", "--seed", "7"))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == ["the movie is"] * 2 + ["this film is"] * 2
    assert "label" not in rows[0]
    assert "differentially private per training example, as the model is" in result.stdout + result.stderr
    assert "generating" in result.stderr  # the progress bar
    assert "Loading weights" not in result.stderr  # transformers' per-load bars are noise at dplit's terminal


PROMPT_FILES = {
    "prompts.jsonl": "".join(json.dumps(row) + "\n" for row in PROMPTS),
    "prompts.json": json.dumps(PROMPTS, indent=1),
    "prompts.csv": 'prompt,label\nthe movie is,1\n"this actress seems so very",0\n',
    "prompts.txt": "the movie is\n\nthis actress seems so very\n",
}
"""The same two prompts in each format a training file may have (a .txt file has no labels)."""


@pytest.mark.parametrize("name", sorted(PROMPT_FILES))
def test_prompts_are_read_by_extension_as_training_files_are(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(PROMPT_FILES[name])
    prompts = read_prompts(path)
    assert [prompt.text for prompt in prompts] == [row["prompt"] for row in PROMPTS]  # no CSV header, no JSON array
    labels = [None, None] if name.endswith(".txt") else ["1", "0"] if name.endswith(".csv") else [1, 0]
    assert [prompt.label for prompt in prompts] == labels
    where = {"prompts.json": ["item 1", "item 2"], "prompts.txt": ["line 1", "line 3"], "prompts.csv": ["line 2", "line 3"]}  # fmt: skip
    assert [prompt.where for prompt in prompts] == where.get(name, ["line 1", "line 2"])


def test_prompt_and_label_columns_are_chosen_by_flag(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("id,start,sentiment\n7,the movie is,positive\n")
    prompts = read_prompts(path, prompt_column="start", label_column="sentiment")
    assert [(prompt.text, prompt.label) for prompt in prompts] == [("the movie is", "positive")]
    with pytest.raises(ValueError, match=r"^--prompts_file .*prompts\.csv: missing column\(s\) \['prompt'\]; "
                                         r"the file has \['id', 'start', 'sentiment'\] \(--prompt_column\)$"):  # fmt: skip
        read_prompts(path)


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.csv", "prompts.json"])
def test_default_max_new_tokens_past_the_models_positions_is_capped_with_a_warning(
    exported_lm: tuple[Path, Path], tmp_path: Path, name: str
) -> None:
    _, folder = exported_lm
    backbone, tokenizer, _ = load_generator(folder)
    limit = backbone.config.max_position_embeddings  # 32 in configs/lm_quickstart.yaml: below the default budget
    path = tmp_path / name
    path.write_text(PROMPT_FILES[name])
    prompts = read_prompts(path)
    settings = SamplingSettings(num_samples=2, batch_size=2)
    assert settings.max_new_tokens > limit
    with pytest.warns(UserWarning, match=rf"^--max_new_tokens=64 .* the model's limit of {limit} positions"):
        rows = all_rows(backbone, tokenizer, prompts, settings, progress=False)
    assert len(rows) == 2 * len(prompts) and all(row["text"] for row in rows)


def test_dplit_lm_generate_runs_with_default_options_from_a_quickstart_export(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    """In this process: the real executable generates in the test that writes the JSONL and prints its privacy."""
    _, folder = exported_lm
    lines = tmp_path / "prompts.txt"
    lines.write_text("the movie is\nthis actress seems so very\n")
    out = tmp_path / "synthetic.jsonl"
    result = run_dplit_in_process(*generate_args(folder, lines, out, "--num_samples", "1", "--no_progress"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    warning = [line for line in result.stderr.splitlines() if "--max_new_tokens" in line]
    assert len(warning) == 1 and warning[0].startswith("dplit: warning: --max_new_tokens=64"), result.stderr
    assert len(out.read_text().splitlines()) == 2


def test_a_prompt_that_fills_the_models_positions_is_refused_naming_its_line(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = exported_lm
    backbone, tokenizer, _ = load_generator(folder)
    path = tmp_path / "prompts.txt"
    path.write_text("the movie is\n" + "the movie is very " * 20 + "\n")
    with pytest.raises(ValueError, match=r"^--prompts_file line 2: the prompt has \d+ tokens, which leaves no room"):
        all_rows(backbone, tokenizer, read_prompts(path), SamplingSettings(max_new_tokens=1), progress=False)


# --- generating at scale: bounded, streamed, interruptible ------------------------------------------------


def test_samples_stream_to_a_partial_file_that_is_kept_when_drawing_stops(tmp_path: Path) -> None:
    out = tmp_path / "synthetic.jsonl"
    partial = partial_file(out)

    def batches(stop: BaseException) -> Iterator[list[dict]]:
        yield [{"prompt": "a", "sample": 0, "text": "x"}, {"prompt": "a", "sample": 1, "text": "y"}]
        assert [json.loads(line)["text"] for line in partial.read_text().splitlines()] == ["x", "y"]  # on disk now
        yield [{"prompt": "b", "sample": 0, "text": "z"}]
        raise stop

    with pytest.raises(Interrupted, match=rf"^kept the 3 samples drawn so far in {re.escape(str(partial))} "):
        write_samples(batches(KeyboardInterrupt()), out)
    assert [json.loads(line)["text"] for line in partial.read_text().splitlines()] == ["x", "y", "z"]
    assert not out.exists()
    with pytest.raises(RuntimeError, match="out of memory"), pytest.warns(UserWarning, match="kept the 3 samples"):
        write_samples(batches(RuntimeError("out of memory")), out)
    assert write_samples(iter([[{"text": "done"}]]), out) == (out, 1)
    assert out.read_text() == '{"text": "done"}\n' and not partial.exists()


def test_the_work_is_bounded_up_front_and_never_listed_whole(exported_lm: tuple[Path, Path], tmp_path: Path) -> None:
    _, folder = exported_lm
    backbone, tokenizer, _ = load_generator(folder)
    prompts = read_prompts(prompts_file(tmp_path))
    with pytest.raises(ValueError, match=r"^--num_samples=1000000000: 2 prompt\(s\) × 1000000000 = 2,000,000,000"):
        next(generate_batches(backbone, tokenizer, prompts, SamplingSettings(num_samples=1_000_000_000)))
    most = SamplingSettings(num_samples=MAX_SAMPLES // len(prompts), max_new_tokens=2, batch_size=2)
    tracemalloc.start()
    try:
        first = next(generate_batches(backbone, tokenizer, prompts, most, progress=False))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [row["sample"] for row in first] == [0, 1] and peak < 50 * 2**20  # a list of 10⁷ jobs takes ~1 GB


def interrupted(command: list[str], started: Callable[[], bool], **variables: str) -> subprocess.CompletedProcess[str]:
    """Run ``command``, send it Ctrl-C (SIGINT) once ``started()``, and return how it ended.

    ``variables`` are added to its environment; stdout and stderr come back together.
    """
    process = popen_receiving_ctrl_c(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**user_environment(), **variables})  # fmt: skip
    deadline = time.monotonic() + 300
    while not started() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=300)  # a loaded machine: the shutdown after the interrupt can be slow
    return subprocess.CompletedProcess(command, process.returncode, output)


@pytest.mark.slow
def test_ctrl_c_while_generating_keeps_the_samples_drawn_in_one_line(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = exported_lm
    out = tmp_path / "synthetic.jsonl"
    partial = partial_file(out)
    command = [dplit_executable(), *generate_args(folder, prompts_file(tmp_path), out, "--num_samples", "1000000",
               "--max_new_tokens", "2", "--batch_size", "2", "--no_progress")]  # fmt: skip
    result = interrupted(command, lambda: partial.is_file() and partial.stat().st_size > 0)
    lines = result.stdout.splitlines()
    assert result.returncode == 130 and "Traceback" not in result.stdout, result.stdout
    rows = [json.loads(line) for line in partial.read_text().splitlines()]  # whole rows only
    kept = f"kept the {len(rows)} samples drawn so far in {partial} (JSON lines; {out} was not written)"
    assert lines[-1] == f"dplit: interrupted: {kept}"
    assert [line for line in lines if "interrupted" in line] == lines[-1:] and rows and not out.exists()
    assert rows[0] == {"prompt": PROMPTS[0]["prompt"], "label": 1, "sample": 0, "text": rows[0]["text"]}
    refused = run_dplit_in_process(*command[1:])  # the rerun's refusal needs no fresh process
    assert refused.returncode == 2 and f"{partial} exists (the samples an interrupted run kept)" in refused.stderr


SLOW_SAVE = """
import os, pathlib, time
import safetensors.torch

_save_file = safetensors.torch.save_file


def save_file(*args, **kwargs):
    pathlib.Path(os.environ["DPLIT_TEST_STARTED"]).touch()
    time.sleep(120)
    return _save_file(*args, **kwargs)


safetensors.torch.save_file = save_file
"""
"""A ``sitecustomize`` that makes the export's weights file slow to write (and says when it starts), so a Ctrl-C
lands while the export folder is half-written."""


@pytest.mark.slow
def test_ctrl_c_while_exporting_is_one_line_and_leaves_no_folder(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    checkpoint, _ = exported_lm
    (tmp_path / "sitecustomize.py").write_text(SLOW_SAVE)
    started, out = tmp_path / "started", tmp_path / "out"
    command = [dplit_executable(), "export", "--ckpt_path", str(checkpoint), "--output_dir", str(out)]
    result = interrupted(command, started.exists, PYTHONPATH=str(tmp_path), DPLIT_TEST_STARTED=str(started))
    lines = result.stdout.splitlines()
    assert started.exists() and result.returncode == 130 and "Traceback" not in result.stdout, result.stdout
    assert lines[-1] == f"dplit: interrupted: nothing was exported (--output_dir {out} is as it was)"
    assert [line for line in lines if "interrupted" in line] == lines[-1:]
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # no folder, not even the half-written staging one


def test_the_guarantee_line_names_the_unit() -> None:
    """A user-level model's samples are DP per user, not per training example (issue 49 §4)."""
    guarantee = {"differentially_private": True, "epsilon": 1.5, "delta": 1e-5}
    assert "private per user, as the model is" in privacy_line({**guarantee, "protected_unit": "user"}, 4)
    assert "private per user," in privacy_line({**guarantee, "users": 50}, 4)  # a dp_guarantee.json from before
    assert "private per training example," in privacy_line({**guarantee, "protected_unit": "example"}, 4)
    assert "private per preference pair," in privacy_line({**guarantee, "protected_unit": "pair"}, 4)


def all_rows(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Every row :func:`generate_batches` yields, in one list."""
    return [row for rows in generate_batches(*args, **kwargs) for row in rows]
