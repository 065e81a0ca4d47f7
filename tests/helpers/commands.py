"""Command lines for dplit's tests: the shipped configs, tiny models, quickstart/GLUE/LM arguments."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.helpers.glue_files import (
    QNLI_HEADER,
    QNLI_ROWS,
    QQP_HEADER,
    QQP_ROWS,
    SST2_HEADER,
    SST2_ROWS,
    write_glue_task,
)

CONFIGS = Path(__file__).parents[2] / "configs"


TINY = json.dumps({"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 256})


TINY_LLAMA = json.dumps(
    {"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
)  # fmt: skip


GLUE_FILES = {"sst2": (SST2_HEADER, SST2_ROWS), "qnli": (QNLI_HEADER, QNLI_ROWS), "qqp": (QQP_HEADER, QQP_ROWS)}


def steps(count: int) -> list[str]:
    """A short run of ``count`` DP steps then one validation batch (what ``fast_dev_run`` did; it is refused beside DP)."""
    return [
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(count), "--trainer.limit_val_batches", "1",
    ]  # fmt: skip


def quickstart_args(tmp_path: Path, *extra: str) -> list[str]:
    """``dplit fit`` arguments for the quickstart config, offline, in ``tmp_path``, plus ``extra``."""
    return [
        "--config", str(CONFIGS / "quickstart.yaml"),
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
        "--data.synthetic_train_size", "200",
        "--data.synthetic_val_size", "40",
        "--data.batch_size", "20",
        *extra,
    ]  # fmt: skip


def is_sharded(config: Path) -> bool:
    """Whether a shipped config trains with ``ShardedDPStrategy`` (its tests need two processes)."""
    strategy = yaml.safe_load(config.read_text())["trainer"].get("strategy") or {}
    return isinstance(strategy, dict) and strategy.get("class_path") == "dplit.strategy.ShardedDPStrategy"


def is_quantized(config: Path) -> bool:
    """Whether a shipped config loads a quantised base (its tests need a local ``model.pretrained`` folder)."""
    return bool(yaml.safe_load(config.read_text())["model"].get("quantization"))


def config_task(config: Path) -> str:
    """The GLUE task a shipped config trains on."""
    return yaml.safe_load(config.read_text())["data"]["task"]


def glue_args(config: Path, tmp_path: Path, tokenizer_dir: Path) -> list[str]:
    """``dplit fit`` arguments for a shipped GLUE config on tiny local TSVs and a tiny model, one step."""
    task = config_task(config)
    header, rows = GLUE_FILES[task]
    folder = write_glue_task(tmp_path / task, header, rows * 4)
    return [
        "--config", str(config),
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false",
        *steps(1),
        "--model.pretrained", "null",
        "--model.config", TINY_LLAMA if config.stem.startswith(("smollm2", "llama")) else TINY,
        "--data.data_dir", str(folder),
        "--data.tokenizer", str(tokenizer_dir),
        "--data.batch_size", "4",
        "--data.eval_batch_size", "4",
    ]  # fmt: skip


def lm_args(run: Path, *extra: str) -> list[str]:
    """``dplit lm fit`` arguments for the LM quickstart config in ``run``, plus ``extra``."""
    return _small_builtin_run("lm_quickstart.yaml", run, train_size=200, extra=extra)


def dpo_args(run: Path, *extra: str) -> list[str]:
    """``dplit dpo fit`` arguments for the DPO quickstart config in ``run`` (a small built-in set), plus ``extra``."""
    return _small_builtin_run("dpo_quickstart.yaml", run, train_size=100, extra=extra)


def _small_builtin_run(config: str, run: Path, *, train_size: int, extra: tuple[str, ...]) -> list[str]:
    """A shipped config's run in ``run`` on a small built-in set (20 validation items, 20 a batch), plus ``extra``."""
    return [
        "--config", str(CONFIGS / config), "--trainer.default_root_dir", str(run),
        "--trainer.enable_progress_bar", "false", "--data.builtin_train_size", str(train_size),
        "--data.builtin_val_size", "20", "--data.batch_size", "20", *extra,
    ]  # fmt: skip


def lora_on(*modules: str) -> str:
    """``--model.peft`` for rank-4 LoRA on ``modules``."""
    targets = ", ".join(f'"{module}"' for module in modules)
    return f'{{"class_path": "peft.LoraConfig", "init_args": {{"r": 4, "target_modules": [{targets}]}}}}'


def checkpoint_of(root: Path) -> Path:
    """The newest checkpoint a run under ``root`` wrote."""
    return max(root.rglob("*.ckpt"), key=lambda path: path.stat().st_mtime)
