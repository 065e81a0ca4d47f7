"""Checkpoint integrity: a damaged checkpoint is refused on resume and export, in one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dplit.cli.lightning_cli import run_cli
from dplit.privacy.integrity import DIGEST_KEY, check_digests
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.privacy.weights_content import content_digest
from dplit.release.export import export_checkpoint
from tests.helpers.commands import quickstart_args, steps
from tests.helpers.executable import refusal_line, run_dplit_in_process

SIGMA = ["--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a 2-step quickstart run."""
    root = tmp_path_factory.mktemp("run")
    run_cli(["fit", *quickstart_args(root, *steps(2), *SIGMA)])
    return max(root.rglob("*.ckpt"), key=lambda path: path.stat().st_mtime)


def tampered(checkpoint: Path, folder: Path, change: str) -> Path:
    """A copy of ``checkpoint`` with its LM head, ledger or history changed and its recorded digest kept."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if change == "weights":
        name = next(key for key in state["state_dict"] if key.endswith("lm_head.weight"))
        state["state_dict"][name][3, :] += 1e3
    elif change == "ledger":
        history = state[CHECKPOINT_KEY]["accountant"]["history"]
        state[CHECKPOINT_KEY]["accountant"]["history"] = [(sigma, q, 1) for sigma, q, _ in history]
    else:
        state["dplit_privacy_history"]["segments"] = []
    path = folder / f"{change}.ckpt"
    torch.save(state, path)
    return path


def test_every_checkpoint_records_the_digest_of_its_weights_history_and_ledger(trained: Path) -> None:
    state = torch.load(trained, map_location="cpu", weights_only=True)
    assert set(state[DIGEST_KEY]) == {"weights", "dplit_privacy_history", CHECKPOINT_KEY}
    assert state[DIGEST_KEY]["weights"] == content_digest(state["state_dict"])
    assert state["dplit_privacy_history"]["digest"] == content_digest(state["state_dict"])  # one hash seals both
    check_digests(state, source="the file")  # intact: accepted


@pytest.mark.parametrize("change", ["weights", "ledger", "history"])
def test_a_changed_checkpoint_is_refused_by_export_and_resume(trained: Path, tmp_path: Path, change: str) -> None:
    path = tampered(trained, tmp_path, change)
    with pytest.raises(ValueError, match=f"--ckpt_path {path}: its .* do not match the digest dplit recorded"):
        export_checkpoint(path, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    resume = [*quickstart_args(tmp_path / "resumed", *steps(2), *SIGMA), "--trainer.max_epochs", "2"]
    error = refusal_line(run_dplit_in_process("fit", *resume, "--ckpt_path", str(path)))
    assert f"--ckpt_path {path}: its" in error and "do not match the digest" in error
    assert not list((tmp_path / "resumed").rglob("*.ckpt")) and not list((tmp_path / "resumed").rglob("*.json"))


def test_flipped_bytes_in_the_file_are_caught(trained: Path, tmp_path: Path) -> None:
    data = bytearray(trained.read_bytes())
    state = torch.load(trained, map_location="cpu", weights_only=True)
    head = next(value for key, value in state["state_dict"].items() if key.endswith("lm_head.weight"))
    start = bytes(data).find(head.contiguous().numpy().tobytes()[:64])  # the head's bytes in the zip
    assert start > 0
    data[start + 256 : start + 512] = bytes(256)
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="its weights do not match the digest"):
        export_checkpoint(damaged, tmp_path / "export")


def test_a_checkpoint_resumed_away_from_its_ledger_warns(trained: Path, tmp_path: Path) -> None:
    from dplit.privacy.warnings import PrivacyWarning

    moved = tmp_path / "elsewhere" / "version_9" / "checkpoints" / "moved.ckpt"
    moved.parent.mkdir(parents=True)
    moved.write_bytes(trained.read_bytes())
    resume = [*quickstart_args(tmp_path / "resumed", *steps(2), *SIGMA), "--trainer.max_epochs", "2"]
    with pytest.warns(PrivacyWarning, match=r"whose privacy_ledger.json is not beside it .* ε covers only the history"):
        cli = run_cli(["fit", *resume, "--ckpt_path", str(moved)])
    assert cli.trainer.strategy.accountant.steps == 4


def test_a_checkpoint_resumed_in_its_run_folder_does_not_warn(trained: Path, tmp_path: Path) -> None:
    import warnings

    resume = [*quickstart_args(trained.parents[3], *steps(2), *SIGMA), "--trainer.max_epochs", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli(["fit", *resume, "--ckpt_path", str(trained)])
    assert not [warning for warning in caught if "not beside it" in str(warning.message)]


def test_resuming_on_a_training_set_of_another_size_names_the_data_not_delta(trained: Path, tmp_path: Path) -> None:
    resume = [*quickstart_args(tmp_path / "resumed", *steps(2), *SIGMA), "--trainer.max_epochs", "2"]
    resume[resume.index("--data.synthetic_train_size") + 1] = "240"
    error = refusal_line(run_dplit_in_process("fit", *resume, "--ckpt_path", str(trained)))
    assert "the training set has 240 rows, but the checkpoint's run trained on 200" in error
    assert "δ=" not in error and not list((tmp_path / "resumed").rglob("*.ckpt"))


def test_a_folder_given_as_ckpt_path_is_called_a_folder(tmp_path: Path) -> None:
    for command in (["fit", *quickstart_args(tmp_path / "run", *steps(1))], ["export", "--output_dir", str(tmp_path / "out")]):
        error = refusal_line(run_dplit_in_process(*command, "--ckpt_path", str(tmp_path)))
        assert f"--ckpt_path {tmp_path}: is a folder" in error
