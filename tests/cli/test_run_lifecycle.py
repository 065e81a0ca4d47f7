"""A run's life: preempted by SIGTERM through the real ``dplit`` executable, resumed (in process), finished."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dplit.cli.run_summary import PREEMPTED_EXIT, privacy_spent
from dplit.privacy.accounting.relations import epsilon_composed
from tests.helpers.commands import CONFIGS
from tests.helpers.executable import dplit_executable, run_dplit_in_process, user_environment
from tests.helpers.fitting import fit, make_model


def quickstart(run: Path, *extra: str) -> list[str]:
    """``dplit fit`` on the quickstart config (40 DP steps of 500 examples: long enough to be preempted)."""
    return [
        dplit_executable(), "fit", "--config", str(CONFIGS / "quickstart.yaml"),
        "--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip


def preempt(command: list[str], run: Path) -> tuple[int, str]:
    """Start ``command``, send it SIGTERM once its first DP step is in the ledger; (exit code, output)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=user_environment()
    )
    started = time.monotonic()
    while not list(run.rglob("privacy_ledger.json")) and process.poll() is None and time.monotonic() - started < 300:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    return process.returncode, output


@pytest.mark.slow
def test_sigterm_exits_143_saying_how_to_resume_and_the_resumed_run_names_what_it_ignores(tmp_path: Path) -> None:
    code, output = preempt(quickstart(tmp_path / "first"), tmp_path / "first")
    assert code == PREEMPTED_EXIT == 143, output
    stopped = [line for line in output.splitlines() if line.startswith("dplit: stopped by SIGTERM:")]
    saved = next((tmp_path / "first").rglob("interrupted.ckpt"))
    assert len(stopped) == 1 and stopped[0].endswith(f"--ckpt_path {saved}"), output
    assert output.rstrip().endswith(stopped[0]) and "Traceback" not in output

    taken = int(torch.load(saved, map_location="cpu", weights_only=True)["global_step"])  # SIGTERM lands when it lands
    # the resume needs no fresh process: it runs in this one (seconds faster)
    resumed = run_dplit_in_process(
        *quickstart(tmp_path / "second", "--ckpt_path", str(saved), "--model.lr", "0.1", "--trainer.max_steps", str(taken + 2),
                    "--trainer.limit_val_batches", "1")[1:],
    )  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    ignored = [line for line in output.splitlines() if line.startswith("dplit: warning: --ckpt_path resumes")]
    assert len(ignored) == 1 and "model.lr=0.1 (checkpoint: 0.005)" in ignored[0], output
    assert "dirpath has changed" not in output
    done = [line for line in output.splitlines() if line.startswith("dplit: done:")]
    ledger = next((tmp_path / "second").rglob("privacy_ledger.json"))
    assert len(done) == 1 and f"privacy ledger {ledger}" in done[0] and f"after {taken + 2} DP steps" in done[0], output
    assert "checkpoint " in done[0] and "TensorBoard logs " in done[0] and "ε=" in done[0]


def test_a_non_private_run_says_it_spent_no_epsilon() -> None:
    assert privacy_spent(object()) == "NON-PRIVATE run: no ε, no differential privacy guarantee"


def test_the_end_of_fit_line_names_the_unit_the_weights_history_protects(tmp_path: Path) -> None:
    """Per user only when every DP segment trained over users; mixed units: the composed per-example ε (issue 49)."""
    _, strategy = fit(tmp_path, make_model(), max_steps=2, noise_multiplier=1.0, seed=None)
    history, accountant = strategy.dpsgd.history, strategy.accountant
    assert accountant is not None
    ran = history.segments
    assert privacy_spent(strategy).endswith(f"at δ={accountant.delta:.3g} per training example after 2 DP steps")
    users = {"privacy_unit": "user", "users": 64, "max_rows_per_user": 2}
    history.load_state_dict({"segments": [{**segment, **users} for segment in ran]})
    assert (
        privacy_spent(strategy) == f"ε={accountant.epsilon():.4g} at δ={accountant.delta:.3g} per user after 2 DP steps"
    )
    history.load_state_dict({"segments": [{**ran[0], **users}, *ran]})  # over users, then over rows
    line = privacy_spent(strategy)
    composed = epsilon_composed([("replace_one", 1.0, 0.25, 2), ("add_remove", 1.0, 0.25, 2)], delta=accountant.delta)
    assert line.startswith(f"ε={composed:.4g} at δ={accountant.delta:.3g} per training example after")
    assert "counted as replace-one" in line
