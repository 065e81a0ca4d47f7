"""The dplit command: every shipped config parses and runs a step; overrides, seeds and subcommands work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dplit.backbone.embeddings import is_tied
from dplit.cli.lightning_cli import run_cli
from dplit.strategy import DPStrategy
from tests.helpers.commands import (
    CONFIGS,
    GLUE_FILES,
    config_task,
    glue_args,
    is_quantized,
    is_sharded,
    quickstart_args,
    steps,
)
from tests.helpers.executable import run_dplit_in_process

GLUE_CONFIGS = sorted(
    p
    for p in CONFIGS.glob("*.yaml")
    if yaml.safe_load(p.read_text())["data"].get("task") in GLUE_FILES and not is_sharded(p) and not is_quantized(p)
)  # the sharded ones need two processes: tests/test_sharded_strategy.py










def test_quickstart_runs_one_private_step(tmp_path: Path) -> None:
    cli = run_cli(["fit", *quickstart_args(tmp_path, *steps(1))])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DPStrategy) and strategy.accountant.steps == 1
    assert 0 < cli.trainer.callback_metrics["privacy/epsilon"] <= 8.0
    assert {"train/loss", "val/acc", "memory/peak_mb", "perf/samples_per_sec"} <= set(cli.trainer.callback_metrics)


@pytest.mark.parametrize("config", GLUE_CONFIGS, ids=lambda p: p.stem)
def test_glue_config_runs_one_private_step_offline(config: Path, tmp_path: Path, tiny_bpe_dir: Path) -> None:
    cli = run_cli(["fit", *glue_args(config, tmp_path, tiny_bpe_dir)])
    assert cli.trainer.strategy.accountant.steps == 1
    assert cli.model.hparams.task == config_task(config)
    embeddings = yaml.safe_load(config.read_text())["model"]["embeddings"]["class_path"]
    assert is_tied(cli.model.backbone) == embeddings.endswith("TiedEmbeddings")
    if "peft" in yaml.safe_load(config.read_text())["model"]:  # adapters beside the trained embedding
        assert any("lora_A" in name for name, p in cli.model.named_parameters() if p.requires_grad)
        assert cli.model.backbone.get_input_embeddings().weight.requires_grad
    if config.stem.startswith("qqp"):
        assert "val/f1" in cli.trainer.callback_metrics
    if yaml.safe_load(config.read_text())["model"].get("gradient_checkpointing"):  # blocks recomputed in backward
        assert cli.model.backbone.is_activation_checkpointing


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_config_has_header_with_exact_command(config: Path) -> None:
    header = config.read_text().split("\n\n")[0]
    settings = yaml.safe_load(config.read_text())
    command = "dplit lm fit" if "task" not in settings["data"] else "dplit fit"
    command = "dplit dpo fit" if "beta" in settings["model"] else command
    assert header.startswith("# ") and f"{command} --config configs/{config.name}" in header


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_config_saves_the_last_checkpoint_the_docs_resume_and_export(config: Path) -> None:
    """``lightning_logs/version_0/checkpoints/last.ckpt`` (README, tutorial, how-tos) exists after any shipped config."""
    callbacks = yaml.safe_load(config.read_text())["trainer"].get("callbacks", [])
    checkpoints = [c for c in callbacks if c["class_path"].endswith(".ModelCheckpoint")]
    assert len(checkpoints) == 1 and checkpoints[0].get("init_args", {}).get("save_last") is True


def test_print_config_shows_linked_and_overridden_values(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = quickstart_args(tmp_path, "--trainer.strategy.init_args.max_grad_norm", "0.25", "--print_config")
    with pytest.raises(SystemExit) as stop:
        run_cli(["fit", *args])
    assert stop.value.code == 0
    printed = capsys.readouterr().out
    assert "max_grad_norm: 0.25" in printed and "task: synthetic" in printed


def test_command_line_override_reaches_the_strategy(tmp_path: Path) -> None:
    args = quickstart_args(tmp_path, *steps(1), "--trainer.strategy.init_args.max_grad_norm", "0.3")
    assert run_cli(["fit", *args]).trainer.strategy.max_grad_norm == 0.3


def _two_runs(tmp_path: Path, *extra: str) -> list[dict[str, torch.Tensor]]:
    states = []
    for run in range(2):
        args = quickstart_args(tmp_path / str(run), *steps(2), "--seed_everything", "7", *extra)
        states.append(run_cli(["fit", *args]).model.state_dict())
    return states


def test_seed_everything_does_not_make_the_noise_predictable(tmp_path: Path) -> None:
    states = _two_runs(tmp_path)
    assert not all(torch.equal(states[0][key], states[1][key]) for key in states[0])


def test_an_explicit_strategy_seed_makes_runs_identical(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="do not release"):
        states = _two_runs(tmp_path, "--trainer.strategy.init_args.seed", "3")
    assert all(torch.equal(states[0][key], states[1][key]) for key in states[0])


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_validate_and_test_subcommands(subcommand: str, tmp_path: Path) -> None:
    cli = run_cli([subcommand, *quickstart_args(tmp_path)])
    assert f"{'val' if subcommand == 'validate' else 'test'}/acc" in cli.trainer.callback_metrics


def test_unknown_task_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.task"):
        run_cli(["fit", *quickstart_args(tmp_path, "--data.task", "mnli")])


def test_gradient_clipping_beside_dp_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gradient_clip_val"):
        run_cli(["fit", *quickstart_args(tmp_path, "--trainer.gradient_clip_val", "1.0")])


@pytest.mark.parametrize(
    ("argv", "command", "arguments"),
    [
        (["fit", "--config", "q.yaml"], "fit", ["--config", "q.yaml"]),
        (["lm", "generate", "--model", "m"], "lm generate", ["--model", "m"]),
        (["export", "--ckpt_path", "audit"], "export", ["--ckpt_path", "audit"]),
        (["-c", "q.yaml", "fit"], "", ["-c", "q.yaml", "fit"]),  # flags first: the group's LightningCLI reads them
        (["lm", "-c", "q.yaml", "fit"], "lm", ["-c", "q.yaml", "fit"]),
    ],
)
def test_a_command_line_splits_into_the_command_and_its_arguments(
    argv: list[str], command: str, arguments: list[str]
) -> None:
    # dplit.cli.main imports dplit.audit: imported in the tests, since test_audit.py checks that a fit run by a
    # script importing this module imports no audit code
    from dplit.cli.main import split_command

    assert split_command(argv) == (command, arguments)


def test_every_command_of_the_help_has_a_runner() -> None:
    from dplit.cli.main import RUNNERS
    from dplit.cli.terminal import COMMANDS

    assert set(RUNNERS) == set(COMMANDS) | {"", "lm", "dpo"}


def test_main_runs_the_command_of_the_table_on_the_arguments_after_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from dplit.cli.main import RUNNERS, lightning, main

    monkeypatch.setattr("dplit.cli.main.drop_inherited_launch_variables", list)  # leave this process's variables
    calls: list[tuple[str, list[str]]] = []
    for name in ("lm audit", "validate"):
        monkeypatch.setitem(RUNNERS, name, lambda args, name=name: calls.append((name, args)))
    main(["lm", "audit", "--config", "x.yaml", "--debug"])
    main(["validate", "--ckpt_path", "last"])
    assert calls == [("lm audit", ["--config", "x.yaml"]), ("validate", ["--ckpt_path", "last"])]
    assert lightning(lambda args: calls.append(("cli", args)), "test")(["--x", "1"]) is None
    assert calls[-1] == ("cli", ["test", "--x", "1"])  # LightningCLI reads its subcommand itself


@pytest.mark.slow
def test_python_dash_m_and_console_script_entry(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "dplit", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and "fit" in result.stdout and "validate" in result.stdout


def test_quickstart_learns_the_synthetic_task_within_its_budget(tmp_path: Path) -> None:
    args = [
        "--config", str(CONFIGS / "quickstart.yaml"),
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
        "--trainer.max_epochs", "1",
    ]  # fmt: skip
    cli = run_cli(["fit", *args])
    metrics = cli.trainer.callback_metrics
    assert metrics["val/acc"] >= 0.8
    assert 7.0 < metrics["privacy/epsilon"] <= 8.0 and cli.trainer.strategy.accountant.steps == 40


@pytest.mark.parametrize(
    "override",
    [
        ["--trainer.precision", "bf16-mixed"],
        ["--model.freeze", '["backbone.transformer.wpe", "backbone.transformer.wte"]'],
        ["--model.embeddings", "dplit.embeddings.TiedEmbeddings", "--model.head", "linear"],
    ],
    ids=["bf16-autocast", "frozen-embeddings", "tied-linear-head"],
)
def test_quickstart_variants_take_a_ghost_clipped_step(override: list[str], tmp_path: Path) -> None:
    cli = run_cli(["fit", *quickstart_args(tmp_path, *steps(2), *override)])
    assert cli.trainer.strategy.accountant.steps == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trainer.strategy.init_args.max_physical_batch_size", "0"], "max_physical_batch_size must be ≥ 1"),
        (["--trainer.strategy.init_args.max_grad_norm", "-1"], "DPStrategy.max_grad_norm must be a finite number"),
    ],
)
def test_dplit_prints_a_refusal_as_one_line_and_its_traceback_with_debug(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    """Through the console script's function in this process (the executable's end-to-end rows: test_bad_inputs.py)."""
    args = ["fit", *quickstart_args(tmp_path, *extra)]
    result = run_dplit_in_process(*args)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("dplit: error:")]
    assert len(errors) == 1 and message in errors[0]
    debug = run_dplit_in_process(*args, "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stdout + debug.stderr


def test_a_plain_typed_flag_given_another_type_is_one_line(tmp_path: Path) -> None:
    result = run_dplit_in_process("fit", *quickstart_args(tmp_path, "--trainer.max_steps", "abc"))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1:] == [
        "dplit: error: trainer.max_steps='abc': expected an integer"
    ], result.stderr


def test_the_default_progress_bar_shows_no_v_num_and_a_configured_one_is_kept(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import TQDMProgressBar

    shown = ["--trainer.enable_progress_bar", "true"]
    cli = run_cli(["fit", *quickstart_args(tmp_path / "default", *steps(1), *shown)])
    bar = cli.trainer.progress_bar_callback
    assert bar is not None and "v_num" not in bar.get_metrics(cli.trainer, cli.model)
    assert cli.trainer.logger is not None and cli.trainer.logger.version == 0  # there was a version to show
    configured = '[{"class_path": "lightning.pytorch.callbacks.TQDMProgressBar", "init_args": {"refresh_rate": 5}}]'
    mine = run_cli(["fit", *quickstart_args(tmp_path / "mine", *steps(1), *shown), "--trainer.callbacks", configured])
    assert type(mine.trainer.progress_bar_callback) is TQDMProgressBar and mine.trainer.progress_bar_callback.refresh_rate == 5


def test_the_default_model_summary_has_no_column_of_zero_flops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from dplit.callbacks import ParameterSummary

    summary = ["--trainer.enable_model_summary", "true"]
    with caplog.at_level("INFO"):
        cli = run_cli(["fit", *quickstart_args(tmp_path, *steps(1), *summary)])
    assert any(type(callback) is ParameterSummary for callback in cli.trainer.callbacks)
    table = next(record.getMessage() for record in caplog.records if "Trainable params" in record.getMessage())
    assert "Total params" in table and "backbone" in table and "FLOPs" not in table and "Flops" not in table
