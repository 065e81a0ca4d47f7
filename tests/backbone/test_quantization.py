"""model.quantization (QLoRA): a bitsandbytes 4-bit or 8-bit frozen base under LoRA adapters, clipped exactly."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import dplit.backbone.quantization as quantization_module
from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.backbone.quantization import is_quantized, keep_weights_as_loaded
from dplit.backbone.sharding import shard_task
from dplit.cli.lightning_cli import run_cli
from dplit.data.tokenizer import load_tokenizer
from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.release.export import export_checkpoint
from dplit.release.guarantee import GUARANTEE_FILE
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients
from tests.helpers.commands import CONFIGS, checkpoint_of, glue_args, steps
from tests.helpers.executable import refusal_line, run_dplit_in_process
from tests.helpers.families import SMALL
from tests.helpers.oracles import assert_close, padded_batch, run
from tests.privacy.clipping.test_packed_units import MIXES, check_packed, documents

VOCAB = 64
NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
INT8 = {"load_in_8bit": True}
TARGETS = ["q_proj", "v_proj", "down_proj"]
QLORA_CONFIG = CONFIGS / "llama8b_sst2_qlora.yaml"


def save_llama(folder: Path, *, vocab: int, tied: bool, **config: Any) -> Path:
    """A tiny random Llama saved as a local pretrained folder (seed 0)."""
    torch.manual_seed(0)
    settings = {**SMALL, "vocab_size": vocab, "tie_word_embeddings": tied, **config}
    LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama folders: tied and untied input/output embedding."""
    root = tmp_path_factory.mktemp("llama")
    return {policy: save_llama(root / policy, vocab=VOCAB, tied=policy == "tied") for policy in ("tied", "untied")}


def qlora_classifier(folder: Path, policy: str, quantization: dict[str, Any], **kwargs: Any) -> CausalLMClassifier:
    """A float32 classifier on the quantised ``folder``, LoRA on three projections (+ the tied embedding)."""
    torch.manual_seed(1)
    return CausalLMClassifier(
        pretrained=str(folder),
        vocab_size=VOCAB,
        label_word_ids=[3, 7],
        embeddings=TiedEmbeddings() if policy == "tied" else UntiedEmbeddings(),
        quantization=quantization,
        peft=LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False),  # B ≠ 0: every adapter has a gradient
        train_embeddings=policy == "tied",
        **kwargs,
    ).train()


@pytest.mark.parametrize(("policy", "quantization"), [("tied", NF4), ("untied", NF4), ("tied", INT8)])
def test_the_adapters_norms_and_clipped_sum_equal_a_loop_over_the_same_quantised_model(
    folders: dict[str, Path], policy: str, quantization: dict[str, Any]
) -> None:
    """float32 (bitsandbytes computes in float32 on the CPU): one backward pass per example, the same dequantised weights."""
    model = qlora_classifier(folders[policy], policy, quantization)
    quantized = [name for name, p in model.named_parameters() if is_quantized(p)]
    assert len(quantized) == 14 and all(".layers." in name for name in quantized)  # 7 linear layers × 2 blocks
    assert not is_quantized(model.backbone.get_input_embeddings().weight)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in name for name in trained - {"backbone.model.embed_tokens.weight"})
    batch = padded_batch([5, 9, 2, 7], "right", vocab=VOCAB)
    stats, grads = run(GhostEngine(model, max_grad_norm=0.05), model, model.per_example_loss, batch)
    examples = per_example_gradients(model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(examples), rtol=1e-5)
    assert bool((stats.norms > 0.05).all())
    expected = clipped_sum(examples, 0.05)
    assert grads.keys() == expected.keys() == trained
    for name, grad in grads.items():
        assert_close(grad, expected[name], rtol=1e-4)


@pytest.mark.parametrize("policy", ["tied", "untied"])
def test_packed_documents_on_a_quantised_base_are_clipped_per_document(folders: dict[str, Path], policy: str) -> None:
    """QLoRA (NF4, float32 on the CPU) on packed rows, one document spanning two rows: the unpacked loop's norms."""
    torch.manual_seed(1)
    model = CausalLanguageModel(
        pretrained=str(folders[policy]), vocab_size=VOCAB, quantization=NF4, attn_implementation="sdpa",
        embeddings=TiedEmbeddings() if policy == "tied" else UntiedEmbeddings(), sample_prompts=[],
        peft=LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False), train_embeddings=policy == "tied",
    ).train()  # fmt: skip
    assert any(is_quantized(p) for p in model.parameters())
    check_packed(model, documents(MIXES["spanning_rows"]), clip=0.05, rtol=(1e-4, 1e-4))  # float32: ~2e-5 seen


def _quantised(**settings: Any) -> CausalLMClassifier:
    """A classifier with a quantised base: LoRA and NF4 unless ``settings`` say otherwise."""
    peft = settings.pop("peft", LoraConfig(r=4, target_modules=TARGETS))
    return CausalLMClassifier(
        vocab_size=VOCAB, label_word_ids=[3, 7], quantization=settings.pop("quantization", NF4), peft=peft, **settings
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"config": {"model_type": "llama", **SMALL}}, "model.quantization needs model.pretrained"),
        ({"gguf_file": "model.gguf"}, "cannot quantise a GGUF file"),
        ({"peft": None}, "model.quantization needs model.peft"),
        ({"quantization": {"load_in_4bits": True}}, "unknown key 'load_in_4bits' \\(did you mean 'load_in_4bit'"),
        ({"quantization": {"load_in_4bit": True, "load_in_8bit": True}}, "exactly one of load_in_4bit"),
        ({"quantization": {}}, "exactly one of load_in_4bit"),
        ({"quantization": {**NF4, "bnb_4bit_quant_type": "nf5"}}, "bnb_4bit_quant_type must be one of nf4, fp4"),
        ({"quantization": {**NF4, "bnb_4bit_compute_dtype": "float8"}}, "bnb_4bit_compute_dtype must be one of"),
    ],
)
def test_a_bad_quantisation_is_refused_in_one_line(
    folders: dict[str, Path], settings: dict[str, Any], message: str
) -> None:
    source = {} if "config" in settings else {"pretrained": str(folders["untied"])}
    with pytest.raises(ValueError, match=message) as refused:
        _quantised(**source, **settings)
    assert "\n" not in str(refused.value)


def test_a_missing_bitsandbytes_is_named(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    found = quantization_module.importlib.util.find_spec
    monkeypatch.setattr(
        quantization_module.importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else found(name)
    )
    with pytest.raises(ValueError, match=r"model.quantization needs the 'bitsandbytes' package: pip install"):
        _quantised(pretrained=str(folders["untied"]))


def test_a_trainable_quantised_layer_is_refused_by_name(tmp_path: Path) -> None:
    """Qwen2's attention projections have biases: LoRA with ``bias="all"`` would train a quantised layer's bias."""
    torch.manual_seed(0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(**SMALL, vocab_size=VOCAB)).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(ValueError, match=r"q_proj\.base_layer\.bias belongs to a quantised layer and is trainable"):
        _quantised(pretrained=str(tmp_path / "qwen2"), peft=LoraConfig(r=4, target_modules=TARGETS, bias="all"))


def test_dplit_refuses_an_unknown_quantisation_key_in_one_line(
    tmp_path: Path, tiny_bpe_dir: Path, qlora_base: Path
) -> None:
    args = [
        *glue_args(QLORA_CONFIG, tmp_path, tiny_bpe_dir),
        "--model.config",
        "null",
        "--model.pretrained",
        str(qlora_base),
    ]
    done = run_dplit_in_process("fit", *args, "--model.quantization", '{"load_in_4bits": true}')
    assert done.returncode == 2
    assert "model.quantization: unknown key 'load_in_4bits'" in refusal_line(done)


@pytest.fixture
def qlora_base(tmp_path: Path, tiny_bpe_dir: Path) -> Path:
    """A tiny untied Llama with the tiny BPE tokenizer's vocabulary, as the shipped QLoRA config's base."""
    vocab = len(load_tokenizer(tiny_bpe_dir))
    return save_llama(tmp_path / "base", vocab=vocab, tied=False, max_position_embeddings=256)


@pytest.mark.slow
def test_the_qlora_config_trains_adapters_only_resumes_and_exports_them(
    tmp_path: Path, tiny_bpe_dir: Path, qlora_base: Path
) -> None:
    """The shipped config on a tiny Llama (4-bit NF4, checkpointing): frozen integers, moving adapters, ε continued."""
    run = tmp_path / "run"
    args = [
        *glue_args(QLORA_CONFIG, run, tiny_bpe_dir), "--model.config", "null", "--model.pretrained", str(qlora_base),
        "--model.quantization.bnb_4bit_compute_dtype", "float32", "--model.peft.init_args.init_lora_weights", "false",
        "--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1.0",
    ]  # fmt: skip
    first = run_cli(["fit", *args, *steps(2)])
    assert first.trainer.strategy.accountant.steps == 2
    base = AutoModelForCausalLM.from_pretrained(
        str(qlora_base),
        quantization_config=BitsAndBytesConfig(**NF4, bnb_4bit_compute_dtype="float32", bnb_4bit_use_double_quant=True),
    )  # the config's quantisation, computed in float32
    keep_weights_as_loaded(base)  # as dplit loads it: no repacking for bitsandbytes' AVX512-BF16 CPU kernel
    fresh = {name: p for name, p in base.named_parameters() if is_quantized(p)}
    trained = {name.removeprefix("backbone.").replace(".base_layer", ""): p
               for name, p in first.model.named_parameters() if is_quantized(p)}  # fmt: skip
    assert trained.keys() == fresh.keys() and all(torch.equal(trained[k], fresh[k]) for k in fresh)  # bit-identical
    assert all(torch.equal(trained[k].quant_state.absmax, fresh[k].quant_state.absmax) for k in fresh)  # and scales
    checkpoint = checkpoint_of(run)
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert not any(".base_layer.weight" in key for key in saved)  # the 4-bit base is model.pretrained's, not saved
    assert any("lora_B" in key and saved[key].abs().sum() > 0 for key in saved)

    resumed = run_cli(["fit", *args, *steps(2), "--trainer.max_epochs", "2", "--ckpt_path", str(checkpoint)])
    assert resumed.trainer.strategy.accountant.steps == 4
    assert resumed.trainer.strategy.dpsgd.budget.epsilon_spent > first.trainer.strategy.dpsgd.budget.epsilon_spent

    export_checkpoint(checkpoint_of(run), tmp_path / "adapter", adapter_only=True)
    card = json.loads((tmp_path / "adapter" / GUARANTEE_FILE).read_text())
    assert card["base_model_quantization"] == "bitsandbytes 4-bit nf4, compute float32, double quantisation"
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        expected = resumed.model.eval().backbone(input_ids=ids).logits
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(
        ValueError, match="base is quantised \\(model.quantization\\): export its adapters with --adapter_only"
    ):
        export_checkpoint(checkpoint_of(run), tmp_path / "merged")


def test_a_quantised_base_is_not_sharded(folders: dict[str, Path]) -> None:
    """FSDP2 cannot shard bitsandbytes' packed weights: refused in one line before any collective."""
    with pytest.raises(ValueError, match="model.quantization cannot be sharded by FSDP2") as refused:
        shard_task(qlora_classifier(folders["tied"], "tied", NF4), mesh=None)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


def test_the_per_example_engine_refuses_a_quantised_base_at_setup(folders: dict[str, Path]) -> None:
    engine = build_engine("per_example", qlora_classifier(folders["tied"], "tied", NF4), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="clipping=per_example cannot run model.quantization") as refused:
        engine.check_parameters()
    assert "\n" not in str(refused.value)


CAST = "MatMul8bitLt: inputs will be cast from %s to float16 during quantization"
"""The warning bitsandbytes' CUDA 8-bit matmul logs on every quantised layer's every call (its CPU path has none)."""


@pytest.mark.parametrize("quantization", [NF4, INT8], ids=["nf4", "int8"])
def test_a_quantised_base_is_announced_once(
    folders: dict[str, Path], quantization: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 50: a 4-bit base was never announced."""
    with caplog.at_level(logging.INFO):
        model = qlora_classifier(folders["untied"], "untied", quantization)
        batch = padded_batch([5, 3], "right", vocab=VOCAB)
        model.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.sum().backward()
    kind = "8-bit (LLM.int8)" if quantization is INT8 else "4-bit nf4, compute float32"
    announced = [m for m in caplog.messages if m.startswith("model.quantization: model.pretrained=")]
    assert len(announced) == 1 and f"bitsandbytes {kind} base, frozen" in announced[0], caplog.messages


def test_bitsandbytes_per_layer_warnings_are_shown_once(
    folders: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 50: 8-bit QLoRA printed bitsandbytes' cast warning per layer per pass (16 lines in 2 steps)."""
    qlora_classifier(folders["untied"], "untied", INT8)
    with caplog.at_level(logging.INFO):
        for _ in range(16):  # as its CUDA matmul logs it: 8 layers, 2 passes
            logging.getLogger("bitsandbytes.autograd._functions").warning(CAST, torch.float32)
        logging.getLogger("bitsandbytes.nn.modules").warning("another message")
    shown = [record.getMessage() for record in caplog.records if record.name.startswith("bitsandbytes")]
    assert shown == [CAST % torch.float32, "another message"]


@pytest.mark.gpu
def test_8_bit_passes_on_a_gpu_show_the_cast_warning_once(
    folders: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (bitsandbytes' 8-bit cast warning is on its CUDA path)")
    with caplog.at_level(logging.INFO):
        model = qlora_classifier(folders["untied"], "untied", INT8).cuda()
        batch = padded_batch([5, 3], "right", vocab=VOCAB)
        for _ in range(2):
            logits = model.backbone(input_ids=batch["input_ids"].cuda(), attention_mask=batch["attention_mask"].cuda())
            logits.logits.sum().backward()
    assert len([m for m in caplog.messages if m.startswith("MatMul8bitLt: inputs will be cast")]) == 1, caplog.messages
