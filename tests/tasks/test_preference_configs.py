"""The shipped DPO configs (SmolLM2 LoRA, 8B QLoRA) run one DP step on tiny random models of their families (issue 53)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from dplit.backbone.embeddings import is_tied
from dplit.backbone.quantization import is_quantized
from dplit.cli.lightning_cli import run_dpo_cli
from dplit.data.tokenizer import load_tokenizer
from tests.helpers.commands import CONFIGS
from tests.helpers.families import FAMILIES, SMALL

DPO_CONFIGS = ("smollm2_dpo_lora.yaml", "llama8b_dpo_qlora.yaml")


def write_pairs(path: Path, count: int) -> Path:
    """``count`` preference pairs as JSONL, each prompt its own, the chosen answer never the rejected one."""
    rows = [{"prompt": f"Review {i}:", "chosen": f"A warm film {i}.", "rejected": "A dull mess."} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_llama_folder(folder: Path, vocab: int) -> Path:
    """A tiny random untied Llama saved as a local folder (a quantised base must be loaded from one)."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": vocab, "max_position_embeddings": 256})).save_pretrained(
        folder
    )
    return folder


def model_args(config: Path, tmp_path: Path, tokenizer: Path) -> list[str]:
    """The tiny model in the config's family: a random config, or a saved folder for a quantised base (compute fp32)."""
    if not yaml.safe_load(config.read_text())["model"].get("quantization"):
        llama = {**FAMILIES["llama"], "max_position_embeddings": 256}
        return ["--model.pretrained", "null", "--model.config", json.dumps(llama)]
    folder = tiny_llama_folder(tmp_path / "base", len(load_tokenizer(tokenizer)))
    return ["--model.pretrained", str(folder), "--model.quantization.bnb_4bit_compute_dtype", "float32"]


@pytest.mark.parametrize("name", DPO_CONFIGS)
def test_shipped_dpo_config_runs_a_private_step_on_a_tiny_model_of_its_family(
    name: str, tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    config = CONFIGS / name
    pairs = write_pairs(tmp_path / "pairs.jsonl", 16)
    cli = run_dpo_cli([
        "fit", "--config", str(config), *model_args(config, tmp_path, tiny_bpe_dir),
        "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "1",
        "--data.tokenizer", str(tiny_bpe_dir), "--data.train_file", str(pairs), "--data.val_file", str(pairs),
        "--data.batch_size", "4", "--data.eval_batch_size", "4", "--data.max_length", "32",
    ])  # fmt: skip
    model, strategy = cli.model, cli.trainer.strategy
    assert strategy.accountant.steps == 1 and strategy.dpsgd.dataset_size == 16
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)  # adapters only: the reference is the base
    assert model.reference.uses_adapters and model.reference.copy is None
    assert "val/reward_accuracy" in cli.trainer.callback_metrics
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    assert ledger["privacy_unit"] == "pair"
    quantized = [name for name, p in model.named_parameters() if is_quantized(p)]
    if name.startswith("llama8b"):
        assert quantized and model.backbone.is_activation_checkpointing and not is_tied(model.backbone)
    else:
        assert not quantized and is_tied(model.backbone)
