"""dplit on the real files of ``DPLIT_DATA_DIR``: SST-2 with GPT-2's tokenizer, SmolLM2-135M (GGUF) trained and exported.

They span the command line and the release, and load real models: kept together, a parallel run gives them one
worker (and converts SmolLM2 once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dplit.backbone.embeddings import is_tied
from dplit.cli.lightning_cli import run_cli, run_lm_cli
from dplit.release.export import export_checkpoint
from tests.helpers.commands import CONFIGS, TINY, checkpoint_of, steps

pytestmark = pytest.mark.slow  # real models: tens of seconds each


def test_real_sst2_with_gpt2_tokenizer_trains_privately(shared_data_dir: Path, tmp_path: Path) -> None:
    cli = run_cli([
        "fit",
        "--config", str(CONFIGS / "sst2_untied.yaml"),
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false",
        "--trainer.max_steps", "3",
        "--trainer.limit_val_batches", "2",
        "--trainer.val_check_interval", "3",
        "--model.pretrained", "null",
        "--model.config", TINY,
        "--data.data_dir", str(shared_data_dir / "glue" / "sst2"),
        "--data.tokenizer", str(shared_data_dir / "gpt2-tokenizer"),
        "--data.max_train_examples", "2000",
        "--data.max_eval_examples", "64",
        "--data.batch_size", "64",
        "--data.eval_batch_size", "32",
    ])  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.model.hparams.vocab_size == 50257 and cli.model.hparams.label_word_ids == [7818, 1049]
    assert cli.trainer.strategy.accountant.steps == 3 and 0 < metrics["privacy/epsilon"] <= 8.0
    assert torch.isfinite(metrics["train/loss"]) and "val/acc" in metrics


@pytest.mark.parametrize("policy", ["tied", "untied"])
def test_real_smollm2_takes_a_private_step_on_real_sst2(
    policy: str, shared_data_dir: Path, smollm2_folder: Path, tmp_path: Path
) -> None:
    """SmolLM2 as read once from its GGUF file (``smollm2_folder``); tied: with the ghost self-check on the real model.

    The GGUF file through ``dplit fit`` itself (``--model.gguf_file``/``--data.gguf_file``) is
    ``tests/backbone/test_gguf.py``'s, on a tiny file: reading this one takes ~20 s each time.
    """
    folder = smollm2_folder
    source = [] if policy == "tied" else ["--trainer.strategy.init_args.self_check", "false"]
    cli = run_cli([
        "fit",
        "--config", str(CONFIGS / f"smollm2_sst2_{policy}.yaml"),  # the offline override of its header
        "--model.pretrained", str(folder), "--data.tokenizer", str(folder), *source,
        "--data.data_dir", str(shared_data_dir / "glue" / "sst2"),
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false",
        *steps(1),
        # no checkpoint (two 0.5 GB files; the export tests write one); the one validation batch still runs
        "--trainer.enable_checkpointing", "false",
        "--trainer.callbacks", '[{"class_path": "dplit.callbacks.ResourceMonitor"}]',
        "--data.max_train_examples", "64",
        "--data.max_eval_examples", "4",
        "--data.batch_size", "8",  # q = 1/8: a Poisson batch of 64 rows is empty with probability 2e-4, not 2%
        "--data.eval_batch_size", "4",
        "--data.max_length", "32",
    ])  # fmt: skip
    backbone = cli.model.backbone
    assert type(backbone).__name__ == "LlamaForCausalLM" and len(backbone.model.layers) == 30
    assert is_tied(backbone) == (policy == "tied")
    assert cli.model.hparams.label_word_ids == [3524, 2731]  # " negative", " positive" in SmolLM2's own tokenizer
    if policy == "untied":  # started as a copy, then each got its own (noisy) update
        assert not torch.equal(backbone.lm_head.weight, backbone.model.embed_tokens.weight)
    assert cli.trainer.strategy.accountant.steps == 1 and 0 < cli.trainer.callback_metrics["privacy/epsilon"] <= 8
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_real_smollm2_exports_untied_and_loads_untied(smollm2_folder: Path, tmp_path: Path) -> None:
    folder = smollm2_folder  # read once from the GGUF file by dplit's loaders
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"text": f"A fine film, number {i}."}) + "\n" for i in range(40)))
    cli = run_lm_cli([
        "fit", "--config", str(CONFIGS / "smollm2_lm.yaml"),
        "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
        "--model.pretrained", str(folder), "--data.tokenizer", str(folder),
        "--data.train_file", str(rows), "--data.val_file", str(rows), "--trainer.strategy.init_args.self_check", "false",
        "--data.batch_size", "4", "--data.eval_batch_size", "4", "--data.max_length", "32",
        "--model.embeddings", "dplit.embeddings.UntiedEmbeddings", "--model.sample_prompts", "[]",
        # one checkpoint file (the config's best + last would write the 1.6 GB of weights and AdamW state twice)
        "--trainer.callbacks", '[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]',
    ])  # fmt: skip
    export_checkpoint(checkpoint_of(tmp_path), tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert not is_tied(model) and model.config.tie_word_embeddings is False
    ids = torch.tensor([tokenizer.encode("A fine film")])
    with torch.no_grad():
        expected = cli.model.eval().backbone(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
