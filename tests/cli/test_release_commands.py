"""dplit export and dplit lm generate's flags (dplit.cli.release): jsonargparse parsers, as every dplit command's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.executable import run_dplit_in_process

FLAGS = {
    ("export",): ["--ckpt_path", "--output_dir", "--config", "--adapter_only", "--overwrite", "--data_description",
                  "--publish_private_diagnostics"],
    ("lm", "generate"): ["--model", "--prompts_file", "--num_samples", "--output_file", "--prompt_column",
                         "--label_column", "--temperature", "--top_p", "--max_new_tokens", "--seed", "--batch_size",
                         "--device", "--overwrite", "--no_progress"],
}  # fmt: skip


@pytest.mark.parametrize("command", list(FLAGS), ids=" ".join)
def test_help_lists_every_flag(command: tuple[str, ...]) -> None:
    result = run_dplit_in_process(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert all(flag in result.stdout for flag in FLAGS[command])


def generate(tmp_path: Path, *extra: str) -> list[str]:
    return ["lm", "generate", "--model", str(tmp_path), "--prompts_file", str(tmp_path / "p.txt"), "--num_samples",
            "1", "--output_file", str(tmp_path / "out.jsonl"), *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (("--temperature", "0"), "--temperature=0: must be a finite number > 0"),
        (("--top_p", "1.5"), "--top_p=1.5: must be a finite number in (0, 1]"),
        (("--max_new_tokens", "many"), "--max_new_tokens='many': must be an integer ≥ 1"),
        (("--batch_size", "-2"), "--batch_size=-2: must be an integer ≥ 1"),
        (("--seed", "x"), "--seed='x': expected an integer"),
    ],
    ids=lambda value: value[0] if isinstance(value, tuple) else None,
)
def test_a_bad_sampling_flag_is_refused_at_parse_time_in_one_line(
    tmp_path: Path, extra: tuple[str, ...], line: str
) -> None:
    """Refused before the model or the prompts are read (neither exists here)."""
    result = run_dplit_in_process(*generate(tmp_path, *extra))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"dplit: error: {line}"]


def test_an_unknown_flag_is_one_line(tmp_path: Path) -> None:
    result = run_dplit_in_process("export", "--ckpt_path", "a.ckpt", "--output_dir", str(tmp_path), "--ovewrite")
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(errors) == 1 and "--ovewrite" in errors[0], result.stderr


def test_missing_flags_are_named_as_they_are_written() -> None:
    result = run_dplit_in_process("lm", "generate", "--model", "x")
    assert result.stderr.strip().splitlines() == [
        "dplit: error: the following arguments are required: --prompts_file, --num_samples, --output_file"
    ]
