"""CausalLMModule declares the arguments every task shares once; a task adds its own and passes **kwargs on."""

from __future__ import annotations

import inspect

import pytest

from dplit.privacy.history import HISTORY_KEY, PrivacyHistory
from dplit.tasks.base import CausalLMModule
from dplit.tasks.classifier import CausalLMClassifier, GPT2Classifier
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB

SHARED = {
    "pretrained", "gguf_file", "config", "embeddings", "vocab_size", "max_length", "dropout", "peft",
    "train_embeddings", "freeze", "attn_implementation", "quantization", "gradient_checkpointing",
    "checkpointed_share", "lr", "weight_decay", "betas", "warmup_steps", "lr_schedule",
}  # fmt: skip
OWN = {
    CausalLMClassifier: {"head", "label_word_ids", "num_classes", "task"},
    GPT2Classifier: {"head", "label_word_ids", "num_classes", "task"},
    CausalLanguageModel: {"loss_reduction", "sample_prompts", "sample_tokens"},
}


def build(task: type[CausalLMModule], **kwargs: object) -> CausalLMModule:
    own = {"label_word_ids": LABEL_WORDS} if issubclass(task, CausalLMClassifier) else {"sample_prompts": []}
    return task(config=TINY_GPT2, vocab_size=VOCAB, **own, **kwargs)


def test_the_base_takes_the_shared_arguments_keyword_only() -> None:
    parameters = list(inspect.signature(CausalLMModule.__init__).parameters.values())[1:]
    assert {p.name for p in parameters} == SHARED
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters)
    assert CausalLMModule.argument_names() == SHARED


@pytest.mark.parametrize("task", list(OWN), ids=lambda task: task.__name__)
def test_a_task_takes_its_own_arguments_and_the_shared_ones(task: type[CausalLMModule]) -> None:
    own = [p for p in inspect.signature(task.__init__).parameters.values() if p.name not in ("self", "kwargs")]
    assert {p.name for p in own} == OWN[task] and all(p.kind is p.KEYWORD_ONLY for p in own)
    assert task.argument_names() == SHARED | OWN[task]
    model = build(task, lr=1e-3, freeze=["backbone.transformer.wpe"])
    assert set(model.hparams) == (SHARED | OWN[task]) - {"embeddings"}  # the policy object stays out of hparams
    assert model.hparams.lr == 1e-3 and model.hparams.freeze == ["backbone.transformer.wpe"]
    assert not model.backbone.transformer.wpe.weight.requires_grad


@pytest.mark.parametrize("task", [CausalLMClassifier, CausalLanguageModel], ids=lambda task: task.__name__)
def test_a_peft_config_is_kept_in_plain_types_in_the_hyperparameters(task: type[CausalLMModule]) -> None:
    peft = pytest.importorskip("peft")
    model = build(task, peft=peft.LoraConfig(r=2, target_modules=["c_attn"]))
    for saved in (model.hparams.peft, model.hparams_initial.peft):  # what the checkpoint and the loggers get
        assert isinstance(saved, dict) and saved["class_path"].endswith("LoraConfig")
        assert saved["init_args"]["r"] == 2 and saved["init_args"]["target_modules"] == ["c_attn"]


def test_the_base_is_abstract_without_a_per_example_loss() -> None:
    with pytest.raises(TypeError, match="per_example_loss"):
        CausalLMModule(config=TINY_GPT2)  # type: ignore[abstract]


def test_task_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        CausalLMClassifier("linear")  # type: ignore[misc]


def test_the_language_model_refuses_its_own_settings_before_building_a_backbone() -> None:
    with pytest.raises(ValueError, match=r"^model.loss_reduction must be 'sum' or 'mean', got 'max'$"):
        CausalLanguageModel(loss_reduction="max")  # type: ignore[arg-type]  # no backbone setting at all


def test_a_restored_history_reaches_a_dp_run_built_before_the_restore() -> None:
    """Lightning's FSDP2 strategy builds DP-SGD before it restores the checkpoint: the history must be one object."""
    module = build(CausalLMClassifier)
    held = module.privacy_history  # what a DPSGD built at setup holds
    saved = PrivacyHistory()
    saved.open_dp_segment(run_id="earlier", facts={})
    for _ in range(3):
        saved.record_dp_step(noise_multiplier=1.0, sample_rate=0.1)
    module.on_load_checkpoint({HISTORY_KEY: saved.state_dict()})
    assert module.privacy_history is held and held.dp_steps == 3


@pytest.mark.parametrize("schedule", ["linear", "constant"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (5, 5), (2, 1)])
def test_the_lr_schedule_is_transformers_one_step_on(schedule: str, warmup: int, total: int) -> None:
    """The schedule of transformers with one more warm-up and planned step, read one step on: the first DP step learns."""
    import torch
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    from dplit.tasks.base import lr_scale

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if schedule == "linear":
        theirs = get_linear_schedule_with_warmup(optimizer, warmup + 1, total + 1).lr_lambdas[0]
    else:
        theirs = get_constant_schedule_with_warmup(optimizer, warmup + 1).lr_lambdas[0]
    ours = [lr_scale(step, warmup=warmup, total=total, schedule=schedule) for step in range(total + 3)]
    assert ours == pytest.approx([theirs(step + 1) for step in range(total + 3)], abs=1e-15)
    assert ours[0] > 0  # theirs(0) == 0: a DP step that spends ε and moves nothing
