"""What a user sees at the terminal: privacy warnings that stand out, no noise they cannot act on."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dplit.cli.lightning_cli import run_cli
from dplit.cli.terminal import COMMANDS, show_warning, terminal_output
from dplit.privacy.warnings import PrivacyWarning
from tests.helpers.commands import quickstart_args, steps
from tests.helpers.executable import dplit_executable, user_environment

NOISE = ("💡 Tip", "LeafSpec", "Initializing distributed", "All distributed processes registered",
         "Loading `train_dataloader` to estimate", "Optimal order is the largest alpha", "bos_token_id", "Traceback")  # fmt: skip


def test_a_privacy_warning_is_one_prominent_line() -> None:
    out = io.StringIO()
    show_warning(PrivacyWarning("no noise:\n not private"), PrivacyWarning, "/elsewhere/x.py", 3, file=out)
    assert out.getvalue() == "dplit: WARNING: no noise: not private\n"


def test_dplits_own_warning_is_one_line_and_a_dependencys_keeps_its_format() -> None:
    ours, theirs = io.StringIO(), io.StringIO()
    show_warning(UserWarning("data.seed is ignored"), UserWarning, str(Path(sys.modules["dplit"].__file__)), 1, file=ours)
    show_warning(UserWarning("deprecated"), DeprecationWarning, "/site-packages/lib.py", 7, file=theirs)
    assert ours.getvalue() == "dplit: warning: data.seed is ignored\n"
    assert "lib.py:7: DeprecationWarning: deprecated" in theirs.getvalue()


def test_unactionable_warnings_are_dropped_and_privacy_warnings_are_never(capsys: pytest.CaptureFixture) -> None:
    with warnings.catch_warnings(), terminal_output():
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", UserWarning, stacklevel=1)
        warnings.warn("no noise", PrivacyWarning, stacklevel=1)
        warnings.warn("no noise", PrivacyWarning, stacklevel=1)  # every time, not once per location
    assert capsys.readouterr().err == "dplit: WARNING: no noise\n" * 2


def test_differing_gguf_files_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model.gguf_file=None and data.gguf_file='x.gguf' differ"):
        run_cli(["fit", *quickstart_args(tmp_path, "--data.gguf_file", "x.gguf")])


@pytest.mark.slow
def test_a_private_run_at_the_terminal_shows_its_privacy_and_no_noise(tmp_path: Path) -> None:
    command = [dplit_executable(), "fit",
               *quickstart_args(tmp_path, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=user_environment())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "DP-SGD: σ=" in output and "self-check passed" in output
    assert "C=1.0 (clip_mode fixed)" in output and "expected batch 20.0 examples" in output, output
    assert not [noise for noise in NOISE if noise in output], output


@pytest.mark.parametrize(
    ("extra", "shown"),
    [
        (["--trainer.strategy.init_args.clip_mode", "automatic"], ("C=1.0 (clip_mode automatic: a scale, not a bound)", "examples")),
        (["--trainer.strategy.init_args.clip_mode", "quantile", "--data.privacy_unit", "user"], ("C_0=1.0 (clip_mode quantile", "users")),
    ],
    ids=["automatic-examples", "quantile-users"],
)  # fmt: skip
def test_the_start_up_line_names_the_clip_mode_and_the_unit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, extra: list[str], shown: tuple[str, str]
) -> None:
    """Under automatic clipping C is no bound, and under user-level DP the expected batch counts users (issue 50)."""
    with caplog.at_level(logging.INFO):
        run_cli(["fit", *quickstart_args(tmp_path, *steps(1), *extra)])
    lines = [line for line in caplog.messages if line.startswith("DP-SGD: σ=")]
    assert len(lines) == 1 and shown[0] in lines[0] and f" {shown[1]}, δ=" in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["lm", "--help"], [], ["lm"]], ids=["help", "lm-help", "bare", "bare-lm"])
def test_one_help_lists_every_command_with_a_line_each(argv: list[str]) -> None:
    result = subprocess.run([dplit_executable(), *argv], capture_output=True, text=True, timeout=120, check=False, env=user_environment())
    assert result.returncode == 0, result.stderr
    for name, what in COMMANDS.items():
        assert f"  {name} " in result.stdout and what in result.stdout, result.stdout
    assert {"generate", "audit", "export"} <= set(result.stdout.split())


@pytest.mark.slow
def test_help_and_a_mistyped_command_answer_without_importing_torch_or_lightning() -> None:
    script = (
        "import sys\nfrom dplit.__main__ import main\n"
        "for argv in (['--help'], ['exprt'], ['lm', 'generat']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print(sorted(name for name in ('torch', 'lightning', 'transformers') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr
    assert "did you mean 'dplit export'?" in result.stderr and "did you mean 'dplit lm generate'?" in result.stderr
