"""Model settings refused at construction or setup (before any DP step), in one line naming the flag."""

from __future__ import annotations

import pytest
import torch
import transformers.configuration_utils
from transformers import AutoConfig

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.privacy.clipping import GhostEngine, PerExampleEngine
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers.families import FAMILIES
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB


def make_model(**kwargs: object) -> GPT2Classifier:
    torch.manual_seed(0)
    settings = {"config": TINY_GPT2, "vocab_size": VOCAB, "label_word_ids": LABEL_WORDS, **kwargs}
    return GPT2Classifier(**settings)


def refused(message: str, **kwargs: object) -> str:
    """The one-line message ``make_model(**kwargs)`` is refused with (checked against the ``message`` regex)."""
    with pytest.raises(ValueError, match=message) as error:
        make_model(**kwargs)
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**TINY_GPT2, "n_layers": 3}, r"^model.config: unknown key 'n_layers' for model_type 'gpt2' \(did you mean 'n_layer'\?\)$"),
        ({**FAMILIES["qwen2"], "num_layers": 1}, r"^model.config: unknown key 'num_layers' for model_type 'qwen2' \(did you mean 'num_hidden_layers'\?\)$"),
        ({**TINY_GPT2, "dropout": 0.1}, r"unknown key 'dropout' for model_type 'gpt2' \(did you mean model.dropout"),
        ({**TINY_GPT2, "n_emb": 8, "zzz": 1}, r"^model.config: unknown keys for model_type 'gpt2': 'n_emb' \(did you mean 'n_embd'\?\), 'zzz'$"),
    ],
    ids=["gpt2-typo", "qwen2-typo", "dropout-key", "two-keys"],
)  # fmt: skip
def test_unknown_config_keys_are_refused_with_the_closest_key(config: dict, message: str) -> None:
    refused(message, config=config)


def test_aliases_and_keywords_a_family_consumes_are_known() -> None:
    alias = {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "max_position_embeddings": 24}
    assert make_model(config=alias).backbone.config.n_layer == 1  # GPT-2's attribute_map
    llama = {**FAMILIES["llama"], "rope_theta": 1e5, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    assert make_model(config=llama).backbone.config.rope_parameters["rope_theta"] == 1e5  # a legacy keyword


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**TINY_GPT2, "n_layer": "two"}, r"^model.config.n_layer='two': expected int, got str \(value: 'two'\)$"),
        ({**FAMILIES["llama"], "hidden_size": 15}, r"^model.config: The hidden size \(15\) is not a multiple of the number of attention heads \(4\)$"),
        ({**TINY_GPT2, "n_embd": 15}, r"^model.config: `embed_dim` must be divisible by num_heads"),
    ],
    ids=["wrong-type", "llama-heads", "gpt2-heads"],
)  # fmt: skip
def test_transformers_validation_errors_become_one_line(config: dict, message: str) -> None:
    refused(message, config=config)


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("lama", r"^model.config: unknown model_type 'lama' \(did you mean 'llama', .*\? common families: gpt2, llama, qwen2, mistral\)$"),
        ("no-such-family", r"^model.config: unknown model_type 'no-such-family' \(common families: gpt2, llama, qwen2, mistral\)$"),
        ("vit", r"^model.config: model_type 'vit' has no causal LM in transformers \(common families: "),
    ],
)  # fmt: skip
def test_unknown_model_type_gets_a_short_hint(model_type: str, message: str) -> None:
    assert len(refused(message, config={"model_type": model_type})) < 200


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dropout": 1.5}, r"^model.dropout=1.5: must be a probability in \[0, 1\]$"),
        ({"dropout": -0.1}, r"^model.dropout=-0.1: must be a probability in \[0, 1\]$"),
        ({"dropout": float("nan")}, r"^model.dropout=nan: must be a probability"),
        ({"config": {**TINY_GPT2, "resid_pdrop": 2.0}}, r"^model.config.resid_pdrop=2.0: must be a probability in \[0, 1\]$"),
        ({"config": {**FAMILIES["llama"], "attention_dropout": -1}, "dropout": None}, r"^model.config.attention_dropout=-1: must be a probability"),
        ({"config": {**TINY_GPT2, "attn_pdrop": "0.1"}}, r"^model.config.attn_pdrop='0.1': doesn't match any type in \(float, int\)$"),
    ],
    ids=["above-one", "negative", "nan", "config-gpt2", "config-llama", "config-string"],
)  # fmt: skip
def test_dropout_outside_zero_one_is_refused(kwargs: dict, message: str) -> None:
    refused(message, **kwargs)


def test_dropout_bounds_are_accepted() -> None:
    assert make_model(dropout=1.0, config={**TINY_GPT2, "resid_pdrop": 0.0}).backbone.config.resid_pdrop == 1.0
    assert make_model(dropout=None, config={**TINY_GPT2, "embd_pdrop": 0.5}).backbone.config.embd_pdrop == 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1e-3}, r"^model.lr=-0.001: must be a finite number > 0$"),
        ({"lr": 0.0}, r"^model.lr=0.0: must be a finite number > 0$"),
        ({"lr": float("inf")}, r"^model.lr=inf: must be a finite number > 0$"),
        ({"lr": float("nan")}, r"^model.lr=nan: must be a finite number > 0$"),
        ({"weight_decay": -0.1}, r"^model.weight_decay=-0.1: must be a finite number ≥ 0$"),
        ({"betas": (0.9, 1.0)}, r"^model.betas=\[0.9, 1.0\]: must be two numbers in \[0, 1\)$"),
        ({"betas": (-0.1, 0.999)}, r"^model.betas=\[-0.1, 0.999\]: must be two numbers in \[0, 1\)$"),
        ({"betas": (0.9,)}, r"^model.betas=\[0.9\]: must be two numbers"),
        ({"warmup_steps": -1}, r"^model.warmup_steps=-1: must be an integer ≥ 0$"),
        ({"lr_schedule": "cosine"}, r"^model.lr_schedule='cosine': must be 'linear' or 'constant'$"),
    ],
    ids=["lr-negative", "lr-zero", "lr-inf", "lr-nan", "weight-decay", "beta2-one", "beta1-negative", "one-beta",
         "warmup", "schedule"],
)  # fmt: skip
def test_optimizer_settings_are_refused_at_construction(kwargs: dict, message: str) -> None:
    refused(message, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"freeze": ["backbone"]}, r"^model.freeze=\['backbone'\] froze every parameter: nothing to train$"),
        ({"freeze": ["backbone.transformer"], "embeddings": TiedEmbeddings()}, r"^model.freeze=\['backbone.transformer'\] froze every"),
        ({"freeze": ["backbone.transformer", "score"], "head": "linear"},
         r"^model.freeze=\['backbone.transformer', 'score'\] and model.head='linear' \(which freezes the unused untied LM head\) froze every parameter: nothing to train$"),
    ],
    ids=["backbone", "tied-embedding", "linear-head"],
)  # fmt: skip
def test_freezing_every_parameter_is_refused(kwargs: dict, message: str) -> None:
    refused(message, **kwargs)


def test_freezing_all_but_the_score_layer_trains_the_score_layer() -> None:
    model = make_model(freeze=["backbone"], head="linear")
    assert [name for name, p in model.named_parameters() if p.requires_grad] == ["score.weight"]


@pytest.mark.parametrize(
    ("prefix", "hint"),
    [
        ("backbone.transfomer.wpe", r"\(did you mean 'backbone.transformer.wpe'\?\)"),
        ("transformer.h.0", r"\(did you mean 'backbone.transformer.h.0'\?\)"),
        ("zzzzzz", r"\(parameter names start with 'backbone.lm_head', 'backbone.transformer'\)"),
    ],
)
def test_freeze_prefix_that_matches_nothing_suggests_a_name(prefix: str, hint: str) -> None:
    refused(rf"^model.freeze: no parameter name starts with '{prefix}' {hint}$", freeze=[prefix])


def test_optimizer_with_nothing_to_train_names_the_freeze_setting() -> None:
    model = make_model(freeze=["backbone.transformer.h"])
    model.requires_grad_(False)  # frozen after construction: configure_optimizers refuses too
    with pytest.raises(ValueError, match=r"^model.freeze=\['backbone.transformer.h'\] froze every parameter"):
        model.configure_optimizers()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_per_example_engine_refuses_sdpa_and_ghost_accepts_it(family: str) -> None:
    config = TINY_GPT2 if family == "gpt2" else FAMILIES["llama"]
    sdpa = make_model(config=config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"^DPStrategy.clipping=per_example cannot run model.attn_implementation='sdpa'.*"
                       r"use model.attn_implementation=eager or DPStrategy.clipping=ghost$"):  # fmt: skip
        PerExampleEngine(sdpa, max_grad_norm=1.0).check_parameters()
    GhostEngine(sdpa, max_grad_norm=1.0).check_parameters()
    PerExampleEngine(make_model(config=config), max_grad_norm=1.0).check_parameters()  # eager: traceable


@pytest.mark.parametrize("config", [TINY_GPT2, FAMILIES["qwen2"]], ids=["gpt2", "qwen2"])
def test_tiny_vocabulary_gives_no_special_token_warning(config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    logger = transformers.configuration_utils.logger
    monkeypatch.setattr(logger, "warning_once", lambda message, *args: warnings.append(message))
    AutoConfig.for_model("gpt2", vocab_size=VOCAB + 1)  # what the config used to be built with
    assert any("bos_token_id must be" in message for message in warnings)
    warnings.clear()
    backbone = make_model(config=config, embeddings=UntiedEmbeddings()).backbone
    assert not [message for message in warnings if "_token_id" in message]
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(backbone.config, key)
        assert value is None or 0 <= value < VOCAB
