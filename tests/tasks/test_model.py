"""CausalLMClassifier (GPT2Classifier) and the embedding policies."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.data.tokenizer import load_tokenizer
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, PadCollate, RandomTokens


def make_model(**kwargs: object) -> GPT2Classifier:
    torch.manual_seed(0)
    settings = {"config": TINY_GPT2, "vocab_size": VOCAB, "label_word_ids": LABEL_WORDS, **kwargs}
    return GPT2Classifier(**settings).double()


def test_tied_is_one_parameter() -> None:
    model = make_model(embeddings=TiedEmbeddings())
    assert model.backbone.lm_head.weight is model.backbone.transformer.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "backbone.lm_head.weight" not in names and "backbone.transformer.wte.weight" in names


def test_untied_copy_starts_equal_then_moves_independently() -> None:
    model = make_model(embeddings=UntiedEmbeddings(init="copy"))
    wte, head = model.backbone.transformer.wte.weight, model.backbone.lm_head.weight
    assert head is not wte and head.data_ptr() != wte.data_ptr()
    assert torch.equal(head, wte)
    batch = PadCollate()([RandomTokens(8)[i] for i in range(8)])
    model.per_example_loss(batch).sum().backward()
    with torch.no_grad():
        for param in (wte, head):
            param -= 0.1 * param.grad
    assert not torch.equal(head, wte)
    assert not torch.allclose(head.grad, wte.grad)


def test_untied_random_differs_from_wte() -> None:
    model = make_model(embeddings=UntiedEmbeddings(init="random"))
    assert not torch.allclose(model.backbone.lm_head.weight, model.backbone.transformer.wte.weight)


def test_untied_init_is_validated() -> None:
    with pytest.raises(ValueError, match="init"):
        UntiedEmbeddings(init="zeros")  # type: ignore[arg-type]


@pytest.mark.parametrize("head", ["label_words", "linear"])
def test_left_and_right_padding_give_the_same_logits(head: str) -> None:
    model = make_model(head=head).eval()
    examples = [RandomTokens(6)[i] for i in range(6)]
    right, left = PadCollate("right")(examples), PadCollate("left")(examples)
    assert not torch.equal(right["input_ids"], left["input_ids"])
    logits_right = model(right["input_ids"], right["attention_mask"])
    logits_left = model(left["input_ids"], left["attention_mask"])
    assert logits_right.shape == (6, 2)
    torch.testing.assert_close(logits_right, logits_left, rtol=1e-10, atol=1e-10)


def test_label_word_logits_are_lm_head_logits_at_last_token() -> None:
    model = make_model().eval()
    ids = torch.tensor([[5, 9, 11]])
    full = model.backbone(input_ids=ids).logits[0, -1]  # [V]: the LM's next-token logits
    torch.testing.assert_close(model(ids, torch.ones_like(ids))[0], full[LABEL_WORDS])


def test_linear_head_freezes_unused_untied_lm_head() -> None:
    model = make_model(head="linear")
    assert not model.backbone.lm_head.weight.requires_grad
    assert model.score is not None and model.score.weight.shape == (2, TINY_GPT2["n_embd"])


def test_freeze_by_prefix_and_unknown_prefix() -> None:
    model = make_model(freeze=["backbone.transformer.wpe"])
    assert not model.backbone.transformer.wpe.weight.requires_grad
    with pytest.raises(ValueError, match="model.freeze"):
        make_model(freeze=["nothing.here"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": None}, "exactly one of model.pretrained"),
        ({"label_word_ids": None}, "model.label_word_ids"),
        ({"label_word_ids": [3, 3]}, "distinct"),
        ({"label_word_ids": [3, VOCAB + 5]}, "outside the vocabulary"),
    ],
)
def test_bad_model_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_model(**kwargs)


def test_missing_pretrained_folder_or_offline_hub_name_is_named() -> None:
    with pytest.raises(ValueError, match=r"model.pretrained='/nonexistent/gpt2-folder': the folder does not exist"):
        GPT2Classifier(pretrained="/nonexistent/gpt2-folder", label_word_ids=LABEL_WORDS)
    with pytest.raises(ValueError, match=r"model.pretrained='no-such-org/no-such-model' could not be loaded"):
        GPT2Classifier(pretrained="no-such-org/no-such-model", label_word_ids=LABEL_WORDS)


def test_checkpoint_loading_errors_name_the_flag_package_or_id(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"model.label_word_ids \[999\] are outside the vocabulary of size 40"):
        make_model(label_word_ids=[3, 999])
    with pytest.raises(ValueError, match=r"model.config: unknown model_type 'no-such-family'"):
        make_model(config={"model_type": "no-such-family"})
    with pytest.raises(ValueError, match=r"model.gguf_file: .*missing.gguf is not a file"):
        GPT2Classifier(pretrained=str(tmp_path), gguf_file="missing.gguf", label_word_ids=LABEL_WORDS)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"model.gguf_file='model.gguf' needs the 'gguf' package"):
        GPT2Classifier(pretrained=str(tmp_path), gguf_file="model.gguf", label_word_ids=LABEL_WORDS)
    with pytest.raises(ValueError, match=r"data.gguf_file='model.gguf' needs the 'gguf' package"):
        load_tokenizer(tmp_path, gguf_file="model.gguf")


def test_config_backbones_of_other_families_and_their_position_limit() -> None:
    llama = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 48}  # fmt: skip
    model = make_model(config=llama, embeddings=TiedEmbeddings())
    assert type(model.backbone).__name__ == "LlamaForCausalLM" and model.max_positions == 48
    assert model.backbone.get_output_embeddings().weight is model.backbone.get_input_embeddings().weight
    assert make_model().max_positions == TINY_GPT2["n_positions"]  # GPT-2's n_positions
