"""A process group a ``dplit`` command started is destroyed when the command ends, not left to interpreter exit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from dplit.cli import main as cli_main
from dplit.cli.launch import destroy_process_group_started


def start_one_process_group(folder: Path) -> None:
    """A one-rank gloo group, met through a file (no port)."""
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=0, world_size=1)


@pytest.fixture
def no_group_left() -> Iterator[None]:
    """No group before the test (an in-process Lightning fit earlier leaves its own to ``atexit``), none after."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("no_group_left")
def test_a_group_started_by_the_command_is_destroyed_and_one_from_before_is_kept(tmp_path: Path) -> None:
    start_one_process_group(tmp_path)
    destroy_process_group_started(initialized_before=True)
    assert dist.is_initialized()
    destroy_process_group_started(initialized_before=False)
    assert not dist.is_initialized()
    destroy_process_group_started(initialized_before=False)  # nothing to destroy: no error


@pytest.mark.usefixtures("no_group_left")
@pytest.mark.parametrize("fails", [False, True], ids=["finished", "refused"])
def test_every_command_destroys_the_group_it_started(tmp_path: Path, monkeypatch, fails: bool) -> None:
    def fit(arguments: list[str]) -> None:
        start_one_process_group(tmp_path)
        if fails:
            raise ValueError("a refusal after the group started")

    monkeypatch.setitem(cli_main.RUNNERS, "fit", fit)
    if fails:
        with pytest.raises(SystemExit):
            cli_main.main(["fit"])
    else:
        cli_main.main(["fit"])
    assert not dist.is_initialized()


@pytest.mark.usefixtures("no_group_left")
def test_a_group_the_caller_had_before_the_command_is_kept(tmp_path: Path, monkeypatch) -> None:
    start_one_process_group(tmp_path)
    monkeypatch.setitem(cli_main.RUNNERS, "fit", lambda arguments: None)
    cli_main.main(["fit"])
    assert dist.is_initialized()


@pytest.mark.usefixtures("no_group_left")
def test_a_group_that_cannot_be_destroyed_is_one_warning_not_the_commands_outcome(tmp_path: Path, monkeypatch, capsys):
    start_one_process_group(tmp_path)

    def peer_gone() -> None:
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(dist, "destroy_process_group", peer_gone)
    destroy_process_group_started(initialized_before=False)
    assert capsys.readouterr().err == "dplit: warning: the process group was not destroyed cleanly (RuntimeError)\n"
