"""peft adapters under DP: LoRA (GPT-2 Conv1D, Llama Linear) beside a tied or untied, trained or frozen embedding.

Float64, σ = 0, against the brute-force loop (one backward per example, whole-gradient clipping); then DPStrategy
end to end: the adapters get exactly the clipped noisy update, the frozen base weights never change.
"""

from __future__ import annotations

import abc
import copy
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from jsonargparse import ArgumentError, ArgumentParser
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from peft import IA3Config, LoraConfig
from torch import Tensor

from dplit.backbone.adapters import AdapterConfig, adapter_parameters, trainable_counts
from dplit.backbone.embeddings import EmbeddingPolicy, TiedEmbeddings, UntiedEmbeddings, embedding_pair, is_tied
from dplit.privacy.clipping import PerExampleEngine
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.self_check import check_ghost_norms
from dplit.strategy import DPStrategy
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers import brute_force
from tests.helpers.families import FAMILIES, attention_for, check
from tests.helpers.fitting import BatchRecorder, fit
from tests.helpers.oracles import TINY, assert_close, padded_batch, run
from tests.helpers.paths import REPOSITORY
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, RandomTokenData

TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]}
BACKBONES = {"gpt2": {"model_type": "gpt2", **TINY}, "llama": FAMILIES["llama"]}
POLICIES = [TiedEmbeddings(), UntiedEmbeddings()]


def lora(family: str, **options: Any) -> LoraConfig:
    """Rank-4 LoRA on the family's projections with random (not zero) B, so every adapter gets a gradient."""
    settings = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS[family], "init_lora_weights": False}
    return LoraConfig(**settings, fan_in_fan_out=family == "gpt2", **options)


def classifier(
    family: str, policy: EmbeddingPolicy, peft: Any, *, train_embeddings: bool | None = None, side: str = "right",
    head: str = "label_words",
) -> CausalLMClassifier:  # fmt: skip
    torch.manual_seed(0)
    model = CausalLMClassifier(
        config=BACKBONES[family], vocab_size=50, embeddings=policy, label_word_ids=[3, 7], head=head, peft=peft,
        train_embeddings=train_embeddings, attn_implementation=attention_for(side) if family == "llama" else "eager",
    )  # fmt: skip
    return model.double()


def language_model(
    family: str, policy: EmbeddingPolicy, peft: Any, *, train_embeddings: bool | None, side: str
) -> CausalLanguageModel:
    torch.manual_seed(0)
    model = CausalLanguageModel(
        config=BACKBONES[family], vocab_size=50, embeddings=policy, peft=peft, train_embeddings=train_embeddings,
        attn_implementation=attention_for(side) if family == "llama" else "eager",
    )  # fmt: skip
    return model.double()


def lm_batch(lengths: list[int], side: str) -> dict[str, Tensor]:
    """A next-token batch whose loss covers each example's second half only (a prompt/response split)."""
    batch = padded_batch(lengths, side)
    steps = batch["attention_mask"].cumsum(1)  # [B, T]: 1..length on real tokens
    half = torch.tensor(lengths).unsqueeze(1) // 2  # [B, 1]
    batch["loss_mask"] = ((steps > half) & (batch["attention_mask"] > 0)).long()
    return batch


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
@pytest.mark.parametrize("train_embeddings", [True, False], ids=["embeddings-trained", "embeddings-frozen"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_lora_classifier_matches_brute_force(family: str, policy: EmbeddingPolicy, train_embeddings: bool, side: str) -> None:
    model = classifier(family, policy, lora(family), train_embeddings=train_embeddings, side=side)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    embeddings = {f"backbone.{name}" for name, p in model.backbone.named_parameters() if p.dim() == 2 and p.shape[0] == 50}
    assert any("lora_A" in name for name in trainable) and bool(trainable & embeddings) == train_embeddings
    assert is_tied(model.backbone) == isinstance(policy, TiedEmbeddings)
    check(model, model.per_example_loss, padded_batch([5, 1, 9, 3], side), clip=0.5, side=side)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
@pytest.mark.parametrize("train_embeddings", [True, False], ids=["embeddings-trained", "embeddings-frozen"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_lora_next_token_loss_matches_brute_force(
    family: str, policy: EmbeddingPolicy, train_embeddings: bool, side: str
) -> None:
    model = language_model(family, policy, lora(family), train_embeddings=train_embeddings, side=side)
    check(model, model.per_example_loss, lm_batch([7, 2, 11, 4], side), clip=1.0, side=side)


def test_lora_beside_a_linear_head_matches_brute_force() -> None:
    model = classifier("gpt2", UntiedEmbeddings(), lora("gpt2", bias="lora_only"), head="linear")
    assert model.score.weight.requires_grad and not model.backbone.lm_head.weight.requires_grad
    check(model, model.per_example_loss, padded_batch([5, 1, 9, 3], "right"), clip=0.5, side="right")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_dropout_in_train_mode_matches_brute_force_under_the_same_masks(family: str) -> None:
    model = classifier(family, TiedEmbeddings(), lora(family, lora_dropout=0.5), train_embeddings=True).train()
    batch = padded_batch([5, 1, 9, 3], "right")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(7)  # one batched forward draws the dropout masks; one backward per example then reads them
    losses = model.per_example_loss(batch)
    grads = []
    for loss in losses:
        grad = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
        grads.append(dict(zip(params, grad, strict=True)))
    torch.manual_seed(7)  # the ghost engine's one forward draws the very same masks
    stats, ghost = run(GhostEngine(model, max_grad_norm=0.5), model, model.per_example_loss, batch)
    assert_close(stats.norms, brute_force.gradient_norms(grads))
    expected = brute_force.clipped_sum(grads, 0.5)
    for name, grad in ghost.items():
        assert_close(grad, expected[name])
    model.eval()  # the masks mattered: without dropout the norms differ, so the comparison above can fail
    assert not torch.allclose(GhostEngine(model, max_grad_norm=0.5).accumulate(model.per_example_loss, batch).norms, stats.norms)


def test_lora_on_an_embedding_is_exact_per_example_and_refused_by_ghost_by_name() -> None:
    model = classifier("gpt2", TiedEmbeddings(), LoraConfig(r=4, target_modules=["wte"], init_lora_weights=False))
    with pytest.raises(ValueError, match=r"'backbone.transformer.wte.lora_embedding_A.default'.*peft.tuners.lora.layer.Embedding.*model.peft"):
        GhostEngine(model, max_grad_norm=1.0).check_parameters()
    batch = padded_batch([5, 1, 9, 3], "right")
    grads = brute_force.per_example_gradients(model, model.per_example_loss, batch)
    stats, clipped = run(PerExampleEngine(model, max_grad_norm=0.5), model, model.per_example_loss, batch)
    assert_close(stats.norms, brute_force.gradient_norms(grads))
    expected = brute_force.clipped_sum(grads, 0.5)
    for name, grad in clipped.items():
        assert_close(grad, expected[name])


@pytest.mark.parametrize(
    ("peft", "culprit"),
    [
        (IA3Config(target_modules=["c_attn"], feedforward_modules=[], fan_in_fan_out=True), r"c_attn.ia3_l.default'.*peft.tuners.ia3"),
        (LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=True), r"c_attn.lora_magnitude_vector.*without use_dora"),
    ],
    ids=["ia3", "dora"],
)  # fmt: skip
def test_peft_methods_no_rule_covers_are_refused_by_name(peft: Any, culprit: str) -> None:
    model = classifier("gpt2", TiedEmbeddings(), peft)
    with pytest.raises(ValueError, match=culprit):
        GhostEngine(model, max_grad_norm=1.0).check_parameters()


def test_self_check_passes_on_a_lora_model_and_catches_a_hidden_use() -> None:
    model = classifier("llama", TiedEmbeddings(), lora("llama"), train_embeddings=True)
    batch = padded_batch([5, 1, 9, 3], "right")
    engine = GhostEngine(model, max_grad_norm=1.0)
    check_ghost_norms(engine, model, model.per_example_loss, batch)
    layer = model.backbone.model.layers[0].self_attn.q_proj
    lora_b = layer.lora_B["default"]
    lora_b.register_forward_hook(lambda module, args, output: output + output.detach() * 0 + module.weight.sum())
    with pytest.raises(ValueError, match="lora_B.default.weight"):  # a use outside the layer's own forward
        check_ghost_norms(engine, model, model.per_example_loss, batch)


def test_trainable_counts_say_which_regime_it_is() -> None:
    for train_embeddings, policy in [(False, TiedEmbeddings()), (True, TiedEmbeddings()), (True, UntiedEmbeddings())]:
        model = classifier("gpt2", policy, lora("gpt2"), train_embeddings=train_embeddings)
        counts = trainable_counts(model, model.backbone)
        adapters = sum(p.numel() for p in adapter_parameters(model.backbone))
        embedding = sum(m.weight.numel() for m in {id(m.weight): m for m in embedding_pair(model.backbone)}.values())
        assert adapters > 0 and counts.adapter == adapters and counts.other == 0
        assert counts.embedding == (embedding if train_embeddings else 0)
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        assert counts.adapter + counts.embedding + counts.other + counts.frozen == total
    full = classifier("gpt2", TiedEmbeddings(), None)
    assert trainable_counts(full, full.backbone).adapter == 0 and trainable_counts(full, full.backbone).frozen == 0


class HyperparameterRecorder(Logger):
    """A logger keeping every hyperparameter logged (what TensorBoard's hparams tab would show)."""

    def __init__(self) -> None:
        super().__init__()
        self.hyperparameters: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.hyperparameters.update(params if isinstance(params, dict) else vars(params))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


def test_a_run_logs_which_parameters_it_trains_as_hyperparameters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, recorder = gpt2_lora_classifier(True), HyperparameterRecorder()
    trainer = L.Trainer(
        strategy=DPStrategy(accelerator="cpu", max_grad_norm=0.1, noise_multiplier=1.0), devices=1,
        precision="64-true", max_steps=1, logger=recorder, default_root_dir=tmp_path, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(model, RandomTokenData())
    counts = trainable_counts(model, model.backbone)
    assert counts.adapter > 0 and counts.embedding == VOCAB * TINY_GPT2["n_embd"]
    assert {f"trainable/{kind}": value for kind, value in vars(counts).items()}.items() <= recorder.hyperparameters.items()
    assert recorder.hyperparameters["peft"]["class_path"] == "peft.tuners.lora.config.LoraConfig"
    assert counts.describe() in caplog.text


class GradientRecorder(Callback):
    """Keeps each trainable parameter's (privatised) gradient just before the optimizer applies it."""

    def __init__(self) -> None:
        self.grads: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.requires_grad})


def gpt2_lora_classifier(train_embeddings: bool) -> CausalLMClassifier:
    torch.manual_seed(0)
    model = CausalLMClassifier(
        config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS, embeddings=TiedEmbeddings(),
        peft=lora("gpt2"), train_embeddings=train_embeddings,
    )  # fmt: skip
    return model.double()


@pytest.mark.parametrize("train_embeddings", [True, False], ids=["embeddings-trained", "embeddings-frozen"])
def test_adapters_get_exactly_the_clipped_noisy_update_and_base_weights_never_change(
    tmp_path: Path, train_embeddings: bool
) -> None:
    model = gpt2_lora_classifier(train_embeddings)
    initial = copy.deepcopy(model)
    batches, grads = BatchRecorder(), GradientRecorder()
    fit(tmp_path, model, max_steps=1, callbacks=[batches, grads], noise_multiplier=2.0, max_grad_norm=0.5)
    trained = {n for n, p in initial.named_parameters() if p.requires_grad}
    before_state = initial.state_dict(keep_vars=True)  # a tied weight appears under both its names
    for name, after in model.state_dict().items():
        if not before_state[name].requires_grad:
            assert torch.equal(after, before_state[name]), f"{name} is frozen but changed"
    assert sum(not t.requires_grad for t in before_state.values()) > 10
    per_example = brute_force.per_example_gradients(initial, initial.per_example_loss, batches.batches[0])
    expected = brute_force.clipped_sum(per_example, 0.5)
    noise = torch.cat([(grads.grads[0][n] - expected[n] / 16).flatten() for n in trained])
    assert noise.numel() > 2000
    assert noise.std().item() == pytest.approx(2.0 * 0.5 / 16, rel=0.1)  # σC / expected batch
    hp = initial.hparams
    reference = torch.optim.AdamW([p for p in initial.parameters() if p.requires_grad], lr=hp.lr, weight_decay=hp.weight_decay, betas=hp.betas)
    for name, param in initial.named_parameters():
        if param.requires_grad:
            param.grad = grads.grads[0][name]
    reference.step()  # the optimizer's step from the privatised gradient, and nothing else, moved the adapters
    for (name, after), (_, before) in zip(model.named_parameters(), initial.named_parameters(), strict=True):
        if name in trained:
            torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-15)


def test_lora_checkpoint_holds_the_adapters_and_resume_continues_epsilon(tmp_path: Path) -> None:
    trainer, first = fit(tmp_path, gpt2_lora_classifier(True), max_steps=2, noise_multiplier=1.0)
    checkpoint = tmp_path / "two.ckpt"
    trainer.save_checkpoint(checkpoint)
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert any("lora_A.default" in key for key in state) and any("lora_B.default" in key for key in state)
    _, resumed = fit(tmp_path, gpt2_lora_classifier(True), max_steps=4, noise_multiplier=1.0, ckpt_path=str(checkpoint))
    assert first.accountant.steps == 2 and resumed.accountant.steps == 4


def test_a_checkpoint_peft_hyperparameter_rebuilds_the_config() -> None:
    model = classifier("gpt2", TiedEmbeddings(), {"class_path": "peft.LoraConfig", "init_args": {"r": 2, "target_modules": ["c_attn"]}})
    assert adapter_parameters(model.backbone) and not model.backbone.transformer.wte.weight.requires_grad
    with pytest.raises(ValueError, match=r"^model.peft: class_path 'torch.nn.Linear' is not a peft config"):
        classifier("gpt2", TiedEmbeddings(), {"class_path": "torch.nn.Linear"})


def test_train_embeddings_without_adapters_freezes_or_trains_the_embedding() -> None:
    frozen = classifier("llama", UntiedEmbeddings(), None, train_embeddings=False)
    assert not any(m.weight.requires_grad for m in embedding_pair(frozen.backbone))
    assert frozen.backbone.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert all(m.weight.requires_grad for m in embedding_pair(classifier("llama", UntiedEmbeddings(), None).backbone))


def test_empty_poisson_batches_still_take_noisy_steps_with_adapters(tmp_path: Path) -> None:
    batches = RandomTokenData(size=64, batch_size=1)  # q = 1/64: most batches are empty
    _, strategy = fit(tmp_path, gpt2_lora_classifier(False), max_steps=3, data=batches, noise_multiplier=1.0)
    assert strategy.accountant.steps == 3


def gpt2_lora(**options: Any) -> LoraConfig:
    """Rank-4 LoRA on GPT-2's attention projection, plus ``options``."""
    return LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, **options)


@pytest.mark.parametrize("train_embeddings", [True, False], ids=["embeddings-trained", "embeddings-frozen"])
def test_a_weight_tied_modules_to_save_copy_is_refused_in_one_line(train_embeddings: bool) -> None:
    peft = gpt2_lora(modules_to_save=["lm_head"], ensure_weight_tying=True)
    with pytest.raises(ValueError, match=r"^model\.peft: modules_to_save=\['lm_head'\] with ensure_weight_tying=True .*model\.train_embeddings: true") as refusal:
        classifier("gpt2", TiedEmbeddings(), peft, train_embeddings=train_embeddings)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize(
    ("options", "cause"),
    [
        ({"trainable_token_indices": [1, 2]}, r"^model\.peft: trainable_token_indices \(peft's trainable tokens\) is not supported: .*trainable_tokens_delta"),
        ({"alora_invocation_tokens": [1, 2]}, r"^model\.peft: alora_invocation_tokens \(activated LoRA\) is not supported: .*invocation"),
    ],
    ids=["trainable-tokens", "alora"],
)  # fmt: skip
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
def test_peft_options_dplit_cannot_train_are_refused_naming_their_real_cause(
    options: dict[str, Any], cause: str, policy: EmbeddingPolicy
) -> None:
    with pytest.raises(ValueError, match=cause):
        classifier("gpt2", policy, gpt2_lora(**options), train_embeddings=True)


@pytest.mark.parametrize("module", ["lm_head", "wte"])
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
@pytest.mark.parametrize("train_embeddings", [False, None], ids=["false", "default"])
def test_modules_to_save_on_an_embedding_beside_frozen_embeddings_is_refused_naming_both(
    module: str, policy: EmbeddingPolicy, train_embeddings: bool | None
) -> None:
    with pytest.raises(ValueError, match=rf"^model\.peft: modules_to_save=\['{module}'\] .* model\.train_embeddings is false"):
        classifier("gpt2", policy, gpt2_lora(modules_to_save=[module]), train_embeddings=train_embeddings)


def test_modules_to_save_on_the_lm_head_trains_its_copy_beside_trained_embeddings() -> None:
    model = classifier("gpt2", UntiedEmbeddings(), gpt2_lora(modules_to_save=["lm_head"]), train_embeddings=True)
    head = model.backbone.lm_head
    assert head.modules_to_save["default"].weight.requires_grad and not head.original_module.weight.requires_grad
    check(model, model.per_example_loss, padded_batch([5, 1, 9, 3], "right"), clip=0.5, side="right")


def test_model_peft_takes_exactly_peft_configs_by_class_path_or_short_name() -> None:
    assert issubclass(LoraConfig, AdapterConfig) and isinstance(IA3Config(), AdapterConfig)
    assert not issubclass(torch.nn.Linear, AdapterConfig) and not isinstance({"r": 4}, AdapterConfig)
    assert issubclass(AdapterConfig, AdapterConfig) and not issubclass(LoraConfig, abc.ABC)  # no ABC-wide effect
    with pytest.raises(TypeError, match="abstract"):
        AdapterConfig()  # the type itself is never a config
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--peft", type=Optional[AdapterConfig])  # noqa: UP045 (as a LightningModule declares it)
    for class_path in ("peft.LoraConfig", "LoraConfig"):  # jsonargparse resolves the short name among peft's configs
        given = parser.parse_args(["--peft", json.dumps({"class_path": class_path, "init_args": {"r": 3}})])
        built = parser.instantiate_classes(given).peft
        assert type(built) is LoraConfig and built.r == 3
    with pytest.raises(ArgumentError, match="does not correspond to a subclass of AdapterConfig"):
        parser.parse_args(["--peft", json.dumps({"class_path": "torch.nn.Linear", "init_args": {"in_features": 2}})])


@pytest.mark.slow
def test_dplit_without_model_peft_never_imports_peft() -> None:
    """``dplit fit --print_config`` parses a whole config; with an adapter lookup it imports neither peft nor bitsandbytes."""
    script = (
        "import contextlib, io, sys, torch\n"
        "from dplit.__main__ import main\n"
        "from dplit.backbone.adapters import adapter_parameters\n"
        f"sys.argv = ['dplit', 'fit', '--config', {str(REPOSITORY / 'configs' / 'quickstart.yaml')!r}, '--print_config']\n"
        "printed = io.StringIO()\n"
        "with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):\n"
        "    main()\n"
        "assert 'max_grad_norm' in printed.getvalue() and adapter_parameters(torch.nn.Linear(2, 2)) == []\n"
        "print(sorted(name for name in ('peft', 'bitsandbytes') if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("[]"), done.stdout[-2000:] + done.stderr[-2000:]
