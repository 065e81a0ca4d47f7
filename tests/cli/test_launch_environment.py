"""``dplit`` started by a process that ran Lightning in-process: the launch variables it inherits do not confuse it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dplit.cli.launch import LAUNCH_VARIABLES, LAUNCHERS, drop_inherited_launch_variables, oversubscription_message
from tests.helpers.commands import quickstart_args
from tests.helpers.executable import dplit_executable, user_environment
from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY

PARENT_SCRIPT = """
import subprocess, sys
from pathlib import Path
from tests.helpers.executable import dplit_executable
from tests.helpers.commands import quickstart_args
from tests.helpers.fitting import fit, make_model

folder = Path(sys.argv[1])
fit(folder / "in-process", make_model(), max_steps=1, noise_multiplier=1.0)  # Lightning exports MASTER_PORT, ...
child = [dplit_executable(), "fit", *quickstart_args(folder / "child", "--trainer.max_steps", "1")]
result = subprocess.run(child, capture_output=True, text=True)  # the parent's environment, as a user's script
print(result.stderr, file=sys.stderr)
sys.exit(result.returncode)
"""


@pytest.mark.slow
def test_dplit_started_after_an_in_process_fit_ignores_the_variables_lightning_exported(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    environment = {key: value for key, value in os.environ.items() if key not in (*LAUNCH_VARIABLES, *LAUNCHERS)}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=environment, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("dplit: warning: ignoring")]
    assert len(warnings) == 1 and "MASTER_PORT" in warnings[0] and "DPLIT_LAUNCHED=1" in warnings[0], result.stderr
    assert list((tmp_path / "child").rglob("*.ckpt"))


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment no launcher started, holding what Lightning's in-process fit leaves behind."""
    for name in (*LAUNCH_VARIABLES, *LAUNCHERS):
        monkeypatch.delenv(name, raising=False)
    leftovers = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "LOCAL_RANK": "0", "NODE_RANK": "0"}
    for name, value in leftovers.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_variables_no_launcher_set_are_dropped(no_launcher: pytest.MonkeyPatch) -> None:
    assert drop_inherited_launch_variables() == ["MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK"]
    assert not any(name in os.environ for name in LAUNCH_VARIABLES)


@pytest.mark.parametrize(
    ("name", "value"),
    [("TORCHELASTIC_RUN_ID", "run"), ("SLURM_NTASKS", "2"), ("DPLIT_LAUNCHED", "1"), ("LOCAL_RANK", "1")],
    ids=["torchrun", "slurm", "by-hand", "lightning-worker"],
)
def test_variables_a_launcher_set_are_kept(no_launcher: pytest.MonkeyPatch, name: str, value: str) -> None:
    no_launcher.setenv(name, value)
    assert drop_inherited_launch_variables() == []
    assert os.environ["MASTER_PORT"] == "29511"


@pytest.mark.parametrize(("processes", "cores", "warned"), [(4, 2, True), (2, 2, False), (1, 1, False)])
def test_more_cpu_processes_than_cores_are_named(processes: int, cores: int, warned: bool) -> None:
    message = oversubscription_message(processes, cores)
    assert (message is not None) is warned
    if warned:
        assert f"trainer.devices={processes} starts {processes} training processes on {cores} CPU core(s)" in message


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux) to give dplit one core")
def test_two_processes_on_one_core_start_with_a_word(tmp_path: Path) -> None:
    """Issue 50 §6: 4 processes on 2 cores started without a word; here 2 on 1 (taskset), through the executable."""
    args = quickstart_args(tmp_path, "--trainer.devices", "2", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1")
    result = subprocess.run(
        ["taskset", "-c", "0", dplit_executable(), "fit", *args], capture_output=True, text=True, timeout=600,
        check=False, env=user_environment(),
    )  # fmt: skip
    output = result.stdout + result.stderr
    warned = [line for line in output.splitlines() if "training processes on 1 CPU core(s)" in line]
    assert result.returncode == 0 and len(warned) == 1, output
    assert warned[0].startswith("dplit: warning: trainer.devices=2 starts 2 training processes"), warned
