"""A catalogue of bad inputs a new user gives the CLI: each stops before the first optimizer step, naming the culprit."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from dplit.cli import run_cli
from dplit.strategy import DPStrategy
from tests.glue_files import SST2_HEADER, SST2_ROWS, write_glue_task
from tests.test_cli import CONFIGS, TINY, quickstart_args
from tests.test_strategy import make_model
from tests.tiny import RandomTokenData

Setup = Callable[[Path, Path], list[str]]
"""Builds one bad run's extra arguments from (a scratch folder, the tiny BPE tokenizer folder)."""


def flags(*extra: str) -> Setup:
    return lambda scratch, tokenizer: list(extra)


def text_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    (scratch / "notes.ckpt").write_text("not a checkpoint\n")
    return ["--ckpt_path", str(scratch / "notes.ckpt")]


def random_bytes_checkpoint(scratch: Path, tokenizer: Path) -> list[str]:
    (scratch / "noise.ckpt").write_bytes(os.urandom(4096))
    return ["--ckpt_path", str(scratch / "noise.ckpt")]


def sst2_files(train: str | None, dev: str) -> Setup:
    """SST-2 run on a tiny random GPT-2 with the given train.tsv / dev.tsv contents (None: a 0-byte train.tsv)."""

    def setup(scratch: Path, tokenizer: Path) -> list[str]:
        folder = write_glue_task(scratch / "sst2", SST2_HEADER, SST2_ROWS * 4)
        (folder / "train.tsv").write_text(train or "")
        (folder / "dev.tsv").write_text(dev)
        return [
            "--config", str(CONFIGS / "sst2_untied.yaml"),
            "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--model.pretrained", "null", "--model.config", TINY,
            "--data.data_dir", str(folder), "--data.tokenizer", str(tokenizer), "--data.batch_size", "4",
        ]  # fmt: skip

    return setup


GOOD_TSV = "\n".join([SST2_HEADER, *SST2_ROWS]) + "\n"
CATALOGUE: list[tuple[str, Setup, str]] = [
    ("max-length-above-positions", flags("--data.max_length", "100"), r"data.max_length=100 exceeds .* 64 tokens"),
    (
        "target-epsilon-with-endless-plan",
        flags("--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"),
        r"target_epsilon .* finite trainer.max_epochs or trainer.max_steps",
    ),
    (
        "endless-non-private-linear-decay",
        flags("--trainer.strategy", "auto", "--non_private", "true", "--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"),
        r"model.lr_schedule='linear' .* trainer.max_epochs and trainer.max_steps are both -1",
    ),
    ("text-file-as-checkpoint", text_checkpoint, r"--ckpt_path .*notes.ckpt: not a checkpoint"),
    ("random-bytes-as-checkpoint", random_bytes_checkpoint, r"--ckpt_path .*noise.ckpt: not a checkpoint"),
    ("missing-checkpoint", flags("--ckpt_path", "/nonexistent/last.ckpt"), r"--ckpt_path /nonexistent/last.ckpt: no such"),
    (
        "missing-pretrained-folder",
        flags("--model.config", "null", "--model.pretrained", "/nonexistent/model"),
        r"model.pretrained='/nonexistent/model': the folder does not exist",
    ),
    ("empty-tsv", sst2_files(None, GOOD_TSV), r"train.tsv: the file is empty"),
    ("header-only-tsv", sst2_files(SST2_HEADER + "\n", GOOD_TSV), r"train.tsv"),
    ("label-outside-set", sst2_files(GOOD_TSV + "so so . \t2\n", GOOD_TSV), r"train.tsv, line 5: label '2'"),
    ("missing-column", sst2_files("text\tlabel\nfine . \t1\n", GOOD_TSV), r"train.tsv.*sentence"),
    ("infinite-target-epsilon", flags("--trainer.strategy.init_args.target_epsilon", "inf"), r"target_epsilon='inf': must be a finite number > 0"),
    ("yaml-infinite-target-epsilon", flags("--trainer.strategy.init_args.target_epsilon", ".inf"), r"target_epsilon must be a finite number > 0, got inf"),
    ("nan-max-grad-norm", flags("--trainer.strategy.init_args.max_grad_norm", "nan"), r"max_grad_norm='nan': must be a finite number > 0"),
    ("yaml-nan-noise-multiplier", flags("--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", ".nan"), r"noise_multiplier must be a finite number ≥ 0, got nan"),
    ("both-sigma-and-epsilon", flags("--trainer.strategy.init_args.noise_multiplier", "1.0"), r"^set exactly one of DPStrategy.noise_multiplier and DPStrategy.target_epsilon"),
    ("neither-sigma-nor-epsilon", flags("--trainer.strategy.init_args.target_epsilon", "null"), r"^set exactly one of DPStrategy.noise_multiplier"),
    ("unknown-task", flags("--data.task", "mnli"), r"data.task must be one of"),
    ("gradient-clipping-beside-dp", flags("--trainer.gradient_clip_val", "1.0"), r"trainer.gradient_clip_val must be unset"),
    ("accumulation-beside-dp", flags("--trainer.accumulate_grad_batches", "2"), r"trainer.accumulate_grad_batches must be 1"),
    (
        "multi-token-label-word",
        lambda scratch, tokenizer: [*sst2_files(GOOD_TSV, GOOD_TSV)(scratch, tokenizer), "--data.label_words", '{"0": " magnificent", "1": " great"}'],
        r"data.label_words: the word ' magnificent' for label '0' must be exactly one token",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("setup", "message"), [row[1:] for row in CATALOGUE], ids=[row[0] for row in CATALOGUE])
def test_bad_input_stops_before_the_first_step_naming_it(
    setup: Setup, message: str, tmp_path: Path, tiny_bpe_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["fit", *quickstart_args(tmp_path / "run"), *setup(scratch, tiny_bpe_dir)]
    with pytest.raises((ValueError, FileNotFoundError, SystemExit)) as caught:
        run_cli(args)
    said = capsys.readouterr().err if caught.type is SystemExit else str(caught.value)
    first_line = said.removeprefix("dplit: error: ").strip()
    assert re.search(message, first_line), said
    assert not list((tmp_path / "run").rglob("privacy_ledger.json")) and not list((tmp_path / "run").rglob("*.ckpt"))


def test_16_bit_loss_scaling_is_refused_where_a_grad_scaler_exists(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu")  # what '16-mixed' builds on a GPU; Lightning swaps it for bf16 on a CPU
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    strategy = DPStrategy(accelerator="cpu", max_grad_norm=1.0, noise_multiplier=1.0, precision_plugin=plugin)
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=1, default_root_dir=tmp_path, logger=False)
    with pytest.raises(ValueError, match=r"trainer.precision .16-mixed. \(loss scaling\) is not supported"):
        trainer.fit(make_model(), RandomTokenData())
    assert trainer.global_step == 0
