"""Llama, Qwen2 and Mistral backbones: ghost clipping against the brute-force loop, in float64, tied and untied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from dplit.backbone.embeddings import EmbeddingPolicy, TiedEmbeddings, UntiedEmbeddings, is_tied
from dplit.privacy.clipping.engine import Batch
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.tasks.classifier import CausalLMClassifier
from tests.helpers.families import FAMILIES, SMALL, attention_for, check
from tests.helpers.oracles import padded_batch, record_materialise_choices

VOCAB = 50
LABEL_WORDS = [3, 7]
POLICIES = [TiedEmbeddings(), UntiedEmbeddings()]


def classifier(
    family: str, policy: EmbeddingPolicy, head: str = "label_words", attention: str = "eager"
) -> CausalLMClassifier:
    """A tiny float64 classifier on a random ``family`` backbone."""
    torch.manual_seed(0)
    model = CausalLMClassifier(
        config=FAMILIES[family],
        vocab_size=VOCAB,
        embeddings=policy,
        head=head,
        label_word_ids=LABEL_WORDS,
        attn_implementation=attention,
    )
    return model.double()






class NextTokenLM(nn.Module):
    """Any causal LM with a per-example next-token loss over the full vocabulary (padding masked)."""

    def __init__(self, family: str, policy: EmbeddingPolicy, vocab: int = VOCAB, attention: str = "eager") -> None:
        super().__init__()
        torch.manual_seed(1)
        settings = {key: value for key, value in FAMILIES[family].items() if key != "model_type"}
        config = AutoConfig.for_model(FAMILIES[family]["model_type"], **settings, vocab_size=vocab, bos_token_id=0)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        policy.apply(self.model)

    def per_example_loss(self, batch: Batch) -> Tensor:
        """Summed next-token cross-entropy over each example's real tokens [B]."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]
        pairs = (mask[:, 1:] * mask[:, :-1]).to(logits.dtype)  # [B, T-1]: both tokens real
        losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        return (losses * pairs).sum(1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
@pytest.mark.parametrize("head", ["label_words", "linear"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_classifier_matches_brute_force(family: str, policy: EmbeddingPolicy, head: str, side: str) -> None:
    model = classifier(family, policy, head, attention_for(side))
    assert is_tied(model.backbone) == isinstance(policy, TiedEmbeddings)
    check(model, model.per_example_loss, padded_batch([5, 1, 9, 3], side), clip=0.05, side=side)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
def test_next_token_loss_across_the_break_even(
    family: str, policy: EmbeddingPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    choices = record_materialise_choices(monkeypatch)
    for side in ("right", "left"):
        model = NextTokenLM(family, policy, attention=attention_for(side)).double()  # Grams below T ≈ 11-14
        batch = padded_batch([30, 2, 17, 9], side, seed=3)
        check(model, model.per_example_loss, batch, clip=1.0, side=side)
    assert choices == {False, True}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_duplicate_tokens_with_tied_embeddings(family: str) -> None:
    for side in ("right", "left"):
        model = NextTokenLM(family, TiedEmbeddings(), vocab=6, attention=attention_for(side)).double()  # many repeats
        batch = padded_batch([12, 9, 12], side, vocab=6)
        batch["input_ids"][0] = 4  # one example is a single token repeated
        check(model, model.per_example_loss, batch, clip=1.0, side=side)


def test_norm_layers_are_covered_and_uncovered_ones_refused() -> None:
    model = classifier("llama", TiedEmbeddings())
    GhostEngine(model, max_grad_norm=1.0).check_parameters()  # RMSNorms, bias-free Linear, GQA: all covered
    model.backbone.model.layers[0].mlp.act_fn = nn.PReLU().double()  # a parameterised layer with no rule
    with pytest.raises(ValueError, match=r"'backbone.model.layers.0.mlp.act_fn.weight'.*PReLU.*no ghost clipping rule"):
        GhostEngine(model, max_grad_norm=1.0).check_parameters()


def test_untied_copy_and_tied_policy_on_any_family() -> None:
    untied = classifier("qwen2", UntiedEmbeddings(init="copy"))
    head, embedding = untied.backbone.get_output_embeddings().weight, untied.backbone.get_input_embeddings().weight
    assert head is not embedding and torch.equal(head, embedding) and not untied.backbone.config.tie_word_embeddings
    tied = classifier("qwen2", TiedEmbeddings()).backbone
    with pytest.raises(ValueError, match="no separate pretrained head to keep"):
        UntiedEmbeddings(init="pretrained").apply(tied)
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **{k: v for k, v in SMALL.items()}, vocab_size=VOCAB, tie_word_embeddings=False)
    )
    assert not is_tied(backbone)
    backbone.config.name_or_path = "a-checkpoint"  # as from_pretrained sets it
    with pytest.warns(UserWarning, match="pretrained LM head weights are discarded"):
        TiedEmbeddings().apply(backbone)
    assert is_tied(backbone) and backbone.config.tie_word_embeddings


PHI3 = {
    "model_type": "phi3", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
}  # fmt: skip
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}  # head size 8: 4 frequencies


def test_a_longrope_backbone_is_refused_at_construction_naming_the_rope_type() -> None:
    config = {**PHI3, "rope_scaling": LONGROPE, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match=r"^model\.config: rope type 'longrope' \(backbone\.model\.rotary_emb\) rewrites .*inv_freq"):
        CausalLMClassifier(config=config, vocab_size=VOCAB, label_word_ids=LABEL_WORDS)
    plain = CausalLMClassifier(config=PHI3, vocab_size=VOCAB, label_word_ids=LABEL_WORDS)  # Phi-3 without longrope
    assert plain.backbone.config.model_type == "phi3"
