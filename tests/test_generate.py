"""``dplit lm generate``: labelled synthetic text from an exported private LM, deterministic for a seed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dplit.cli import run_lm_cli
from dplit.release.export import export_checkpoint
from dplit.release.generate import SamplingSettings, generate_rows, load_generator, privacy_line, read_prompts
from tests.executable import dplit_executable, user_environment
from tests.test_bad_inputs import lm_args
from tests.test_export import checkpoint_of

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
    return generate_rows(backbone, tokenizer, prompts, SamplingSettings(**settings), progress=False)


def test_samples_keep_their_prompt_and_label_and_repeat_for_a_seed(exported_lm: tuple[Path, Path], tmp_path: Path) -> None:
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


def test_the_executable_writes_the_jsonl_and_prints_the_samples_privacy(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = exported_lm
    lines = tmp_path / "prompts.txt"
    lines.write_text("the movie is\n\nthis film is\n")
    out = tmp_path / "synthetic.jsonl"
    command = [dplit_executable(), "lm", "generate", "--model", str(folder), "--prompts_file", str(lines),
               "--num_samples", "2", "--output_file", str(out), "--max_new_tokens", "4", "--seed", "7", "--device", "cpu"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=user_environment(), check=False)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == ["the movie is"] * 2 + ["this film is"] * 2
    assert "label" not in rows[0]
    assert "differentially private per training example, as the model is" in result.stdout + result.stderr
    assert "generating" in result.stderr  # the progress bar
    assert "Loading weights" not in result.stderr  # transformers' per-load bars are noise at dplit's terminal


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.csv", "prompts.json"])
def test_default_max_new_tokens_past_the_models_positions_is_capped_with_a_warning(
    exported_lm: tuple[Path, Path], tmp_path: Path, name: str
) -> None:
    _, folder = exported_lm
    backbone, tokenizer, _ = load_generator(folder)
    limit = backbone.config.max_position_embeddings  # 32 in configs/lm_quickstart.yaml: below the default budget
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS) if name.endswith("l") else "the movie is\n")
    prompts = read_prompts(path)
    settings = SamplingSettings(num_samples=2, batch_size=2)
    assert settings.max_new_tokens > limit
    with pytest.warns(UserWarning, match=rf"^--max_new_tokens=64 .* the model's limit of {limit} positions"):
        rows = generate_rows(backbone, tokenizer, prompts, settings, progress=False)
    assert len(rows) == 2 * len(prompts) and all(row["text"] for row in rows)


def test_the_executable_generates_with_default_options_from_a_quickstart_export(
    exported_lm: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = exported_lm
    lines = tmp_path / "prompts.txt"
    lines.write_text("the movie is\nthis actress seems so very\n")
    out = tmp_path / "synthetic.jsonl"
    command = [dplit_executable(), "lm", "generate", "--model", str(folder), "--prompts_file", str(lines),
               "--num_samples", "1", "--output_file", str(out), "--device", "cpu", "--no_progress"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=user_environment(), check=False)
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
        generate_rows(backbone, tokenizer, read_prompts(path), SamplingSettings(max_new_tokens=1), progress=False)
