"""A GGUF checkpoint through ``dplit fit`` and export: the model and its tokenizer both read from the one file.

The file is a tiny random Llama written by :mod:`tests.helpers.gguf_files`, so this runs without the shared data;
``tests/test_real_data.py`` reads the real SmolLM2-135M GGUF with the same loaders.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM

from dplit.backbone.embeddings import is_tied
from dplit.cli.lightning_cli import run_cli
from dplit.data.tokenizer import label_word_ids, load_tokenizer
from dplit.release.export import export_checkpoint
from tests.helpers.commands import CONFIGS, checkpoint_of, glue_args
from tests.helpers.gguf_files import TINY_GGUF, write_tiny_llama_gguf


def test_a_gguf_file_takes_a_self_checked_private_step_and_exports_as_a_plain_folder(
    tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    folder = tmp_path / "gguf"
    write_tiny_llama_gguf(folder, tiny_bpe_dir)
    config = CONFIGS / "smollm2_sst2_tied.yaml"  # the config whose header reads SmolLM2's GGUF offline
    cli = run_cli([
        "fit", *glue_args(config, tmp_path / "run", tiny_bpe_dir),
        "--model.pretrained", str(folder), "--model.config", "null", "--model.gguf_file", TINY_GGUF,
        "--data.tokenizer", str(folder), "--data.gguf_file", TINY_GGUF,
        "--trainer.strategy.init_args.self_check", "true",  # ghost norms against autograd on the GGUF's weights
    ])  # fmt: skip
    backbone = cli.model.backbone
    assert type(backbone).__name__ == "LlamaForCausalLM" and len(backbone.model.layers) == 2 and is_tied(backbone)
    words = yaml.safe_load(config.read_text())["data"]["label_words"]  # " negative", " positive"
    assert cli.model.hparams.label_word_ids == label_word_ids(load_tokenizer(tiny_bpe_dir), words)  # the file's vocab
    assert cli.trainer.strategy.accountant.steps == 1 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    export_checkpoint(checkpoint_of(tmp_path / "run"), tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, backbone.eval()(input_ids=ids).logits)
