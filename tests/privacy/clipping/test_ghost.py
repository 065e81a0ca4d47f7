"""GhostEngine against the brute-force oracle and PerExampleEngine: norms and clipped sums, in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

import dplit.privacy.clipping.ghost as ghost_module
from dplit.backbone.embeddings import EmbeddingPolicy, TiedEmbeddings, UntiedEmbeddings
from dplit.privacy.clipping import build_engine
from dplit.privacy.clipping.engine import Batch
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.privacy.clipping.norms import squared_norm
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients
from tests.helpers.oracles import (
    TINY,
    VOCAB,
    assert_close,
    check_against_oracles,
    padded_batch,
    record_materialise_choices,
    run,
)

LABEL_WORDS = [3, 7]


def classifier(policy: EmbeddingPolicy, head: str = "label_words", freeze: list[str] | None = None) -> GPT2Classifier:
    """A tiny float64 GPT2Classifier (eager attention, no dropout)."""
    torch.manual_seed(0)
    model = GPT2Classifier(
        config=TINY,
        vocab_size=VOCAB,
        embeddings=policy,
        head=head,
        label_word_ids=LABEL_WORDS,
        num_classes=2,
        attn_implementation="eager",
        freeze=freeze,
    )
    return model.double()


class NextTokenLM(nn.Module):
    """A GPT-2 LM with a per-example next-token loss over the whole vocabulary (padding masked)."""

    def __init__(self, policy: EmbeddingPolicy, vocab: int = VOCAB) -> None:
        super().__init__()
        torch.manual_seed(1)
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        config = GPT2Config(
            **TINY, **no_dropout, vocab_size=vocab, bos_token_id=0, eos_token_id=0, attn_implementation="eager"
        )
        self.model = GPT2LMHeadModel(config)
        policy.apply(self.model)

    def per_example_loss(self, batch: Batch) -> Tensor:
        """Mean next-token cross-entropy over each example's real tokens [B]."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        extra = {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **extra).logits[:, :-1]
        pairs = (mask[:, 1:] * mask[:, :-1]).to(logits.dtype)  # [B, T-1]: both tokens real
        losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        return (losses * pairs).sum(1) / pairs.sum(1).clamp(min=1)


def lm(policy: EmbeddingPolicy, vocab: int = VOCAB) -> NextTokenLM:
    """A tiny float64 next-token LM."""
    return NextTokenLM(policy, vocab).double()


@pytest.mark.parametrize("policy", [TiedEmbeddings(), UntiedEmbeddings()], ids=["tied", "untied"])
@pytest.mark.parametrize("head", ["label_words", "linear"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_classifier_matches_oracles(policy: EmbeddingPolicy, head: str, side: str) -> None:
    model = classifier(policy, head)
    batch = padded_batch([5, 1, 9, 3], side)
    check_against_oracles(model, model.per_example_loss, batch, clip=0.5)


@pytest.mark.parametrize("policy", [TiedEmbeddings(), UntiedEmbeddings()], ids=["tied", "untied"])
@pytest.mark.parametrize("lengths", [[6], [2, 1], [30, 24, 7]], ids=["batch-of-one", "short", "past-break-even"])
def test_next_token_lm_matches_oracles(
    policy: EmbeddingPolicy, lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    choices = record_materialise_choices(monkeypatch)
    model = lm(policy)  # n_embd 16: Conv1D/lm_head materialise from T ≈ 8-13 on, Grams below
    for side in ("right", "left"):
        check_against_oracles(model, model.per_example_loss, padded_batch(lengths, side, seed=len(lengths)), clip=1.0)
    assert choices == ({False, True} if max(lengths) > 23 else {False})  # both routes ran past the break-even


def test_duplicate_tokens_and_token_type_reuse_of_wte() -> None:
    model = lm(TiedEmbeddings(), vocab=6)  # few tokens: many repeats; wte used 3 times (ids, token types, head)
    batch = padded_batch([12, 9, 12], "right", vocab=6)
    batch["input_ids"][0] = 4  # one example is a single token repeated
    batch["token_type_ids"] = torch.randint(0, 6, batch["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    check_against_oracles(model, model.per_example_loss, batch, clip=1.0)


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 26), min_size=1, max_size=3),
    side=st.sampled_from(["right", "left"]),
    tied=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_shapes_match_brute_force(lengths: list[int], side: str, tied: bool, seed: int) -> None:
    model = lm(TiedEmbeddings() if tied else UntiedEmbeddings())
    batch = padded_batch(lengths, side, seed)
    grads = per_example_gradients(model, model.per_example_loss, batch)
    stats, ghost_grads = run(GhostEngine(model, max_grad_norm=0.3), model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(grads))
    expected = clipped_sum(grads, 0.3)
    for name, grad in ghost_grads.items():
        assert_close(grad, expected[name])


@pytest.mark.parametrize(
    "freeze",
    [
        ["backbone.transformer.wpe"],
        ["backbone.transformer.wte"],
        ["backbone.transformer.w", "backbone.transformer.h.0"],
    ],
    ids=["frozen-wpe", "frozen-wte", "frozen-embeddings-and-block0"],
)
def test_frozen_parameters(freeze: list[str]) -> None:
    model = classifier(TiedEmbeddings(), freeze=freeze)
    batch = padded_batch([4, 7], "left")
    check_against_oracles(model, model.per_example_loss, batch, clip=0.5)
    frozen = [p for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)


def test_micro_batches_accumulate_into_grad() -> None:
    model = classifier(TiedEmbeddings())
    batch = padded_batch([3, 6, 2, 5], "right")
    engine = GhostEngine(model, max_grad_norm=0.2)
    _, whole = run(engine, model, model.per_example_loss, batch)
    for param in model.parameters():
        param.grad = None
    for start in range(4):
        engine.accumulate(model.per_example_loss, {k: v[start : start + 1] for k, v in batch.items()})
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, whole[name])


@pytest.mark.parametrize("clipping", ["ghost", "per_example"])
@pytest.mark.parametrize("policy", [TiedEmbeddings(), UntiedEmbeddings()], ids=["tied", "untied"])
def test_the_summed_hook_takes_each_parameters_whole_sum_once(clipping: str, policy: EmbeddingPolicy) -> None:
    """A hook that moves each sum away (as a shard's reduce-scatter does) gets every parameter once, complete."""
    model = classifier(policy)
    batch = padded_batch([3, 6, 2, 5], "left")
    engine = build_engine(clipping, model, max_grad_norm=0.2)
    taken: dict[int, list[Tensor]] = {}

    def take(param: nn.Parameter) -> None:
        taken.setdefault(id(param), []).append(param.grad.clone())
        param.grad = None

    handle = engine.register_summed_hook(take)
    engine.accumulate(model.per_example_loss, batch)
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    expected = clipped_sum(per_example_gradients(model, model.per_example_loss, batch), 0.2)
    assert taken.keys() == names.keys() and all(len(sums) == 1 for sums in taken.values())
    for key, (grad,) in taken.items():
        assert_close(grad, expected[names[key]])
    assert all(p.grad is None for p in model.parameters())
    handle.remove()
    engine.accumulate(model.per_example_loss, batch)
    assert all(len(sums) == 1 for sums in taken.values()) and all(p.grad is not None for p in trainable(model))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``model``."""
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("scale", [1e3, 1.0])
def test_each_example_contributes_at_most_clip(scale: float) -> None:
    model = lm(TiedEmbeddings())
    with torch.no_grad():
        model.model.transformer.h[0].mlp.c_fc.weight.mul_(scale)  # adversarially huge gradients
    clip = 1e-3
    batch = padded_batch([7, 3, 11], "right")
    engine = GhostEngine(model, max_grad_norm=clip)
    _, total = run(engine, model, model.per_example_loss, batch)
    summed = {name: torch.zeros_like(grad) for name, grad in total.items()}
    for i in range(3):
        _, single = run(engine, model, model.per_example_loss, {k: v[i : i + 1] for k, v in batch.items()})
        contribution = math.sqrt(sum(g.pow(2).sum().item() for g in single.values()))
        assert contribution <= clip * (1 + 1e-9)
        assert contribution == pytest.approx(clip, rel=1e-3)  # every example was clipped
        summed = {name: summed[name] + single[name] for name in summed}
    for name, grad in total.items():
        assert_close(grad, summed[name])


def test_huge_clip_gives_the_plain_gradient_sum() -> None:
    model = lm(TiedEmbeddings())
    batch = padded_batch([6, 9], "left")
    grads = per_example_gradients(model, model.per_example_loss, batch)
    _, ghost_grads = run(GhostEngine(model, max_grad_norm=1e9), model, model.per_example_loss, batch)
    for name, grad in ghost_grads.items():
        assert_close(grad, grads[0][name] + grads[1][name])


def _untied_copy(model: NextTokenLM) -> NextTokenLM:
    """The same network with lm_head an independent clone of wte: per-use gradients become separate."""
    copy = lm(UntiedEmbeddings())
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        copy.model.lm_head.weight.copy_(model.model.transformer.wte.weight)
    return copy


def test_cross_term_matters_and_bound_is_sound() -> None:
    model = lm(TiedEmbeddings())
    batch = padded_batch([10, 14, 6], "right")
    exact = gradient_norms(per_example_gradients(model, model.per_example_loss, batch))
    untied = per_example_gradients(copy := _untied_copy(model), copy.per_example_loss, batch)
    naive = gradient_norms(untied)  # Σ_k ‖G_k‖² per example: the tied weight's cross term dropped
    assert ((naive - exact).abs() / exact).max() > 1e-3
    tied = ("model.transformer.wte.weight", "model.lm_head.weight")
    per_use = [  # (‖G_in‖ + ‖G_out‖)² for the tied weight, ‖G‖² for the rest
        (eg[tied[0]].norm() + eg[tied[1]].norm()) ** 2 + sum(g.pow(2).sum() for n, g in eg.items() if n not in tied)
        for eg in untied
    ]
    stats, _ = run(GhostEngine(model, max_grad_norm=1.0), model, model.per_example_loss, batch)
    bound, _ = run(GhostEngine(model, max_grad_norm=1.0, tied_norm="bound"), model, model.per_example_loss, batch)
    assert_close(stats.norms, exact)
    assert_close(bound.norms, torch.stack(per_use).sqrt())
    assert (bound.norms >= exact * (1 - 1e-12)).all()


def test_suite_catches_a_dropped_cross_term(monkeypatch: pytest.MonkeyPatch) -> None:
    def naive(uses: list, *, tied_norm: str = "exact") -> Tensor:
        return sum(squared_norm(use) for use in uses)

    model = lm(TiedEmbeddings())
    batch = padded_batch([10, 14, 6], "right")
    exact = gradient_norms(per_example_gradients(model, model.per_example_loss, batch))
    monkeypatch.setattr(ghost_module, "parameter_squared_norm", naive)
    stats, _ = run(GhostEngine(model, max_grad_norm=1.0), model, model.per_example_loss, batch)
    with pytest.raises(AssertionError):
        assert_close(stats.norms, exact)


class ToyReuse(nn.Module):
    """Embedding (padding_idx 0) → Linear twice → LayerNorm → head tied to the embedding; plus an unused Linear."""

    def __init__(self, functional_head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.mix = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(6, 6)
        self.functional_head = functional_head

    def per_example_loss(self, batch: Batch) -> Tensor:
        """Cross-entropy of the last position's logits against ``labels`` [B]."""
        h = self.norm(self.mix(torch.tanh(self.mix(self.emb(batch["input_ids"])))))  # [B, T, 6]
        logits = F.linear(h, self.emb.weight) if self.functional_head else self.head(h)  # [B, T, 11]
        return F.cross_entropy(logits[:, -1], batch["labels"], reduction="none")


def test_reused_module_tied_head_padding_idx_and_unused_parameter() -> None:
    model = ToyReuse().double()
    ids = torch.tensor([[0, 3, 3, 5], [2, 0, 0, 2], [7, 7, 7, 7]])
    batch = {"input_ids": ids, "labels": torch.tensor([1, 0, 7])}
    check_against_oracles(model, model.per_example_loss, batch, clip=0.4)
    assert model.unused.weight.grad is not None and not model.unused.weight.grad.any()


def test_functional_reuse_is_refused_by_name() -> None:
    model = ToyReuse(functional_head=True).double()
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([4])}
    engine = GhostEngine(model, max_grad_norm=1.0)
    for check in (engine.accumulate,):
        with pytest.raises(ValueError, match=r"'emb\.weight'.*linear"):
            check(model.per_example_loss, batch)
    assert_clean(model)
    assert all(p.grad is None for p in model.parameters())


class BareScale(nn.Module):
    """A Linear followed by a bare trainable nn.Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x) * self.scale


class WithConv(nn.Module):
    """A Conv2d (no rule) before a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.proj = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.conv(x.view(-1, 1, 2, 2)).flatten(1))


@pytest.mark.parametrize(
    ("model", "width", "message"),
    [(BareScale(), 3, r"'scale'.*BareScale"), (WithConv(), 4, r"'conv\.weight'.*Conv2d")],
    ids=["bare-parameter", "conv2d"],
)
def test_uncovered_parameters_are_refused_by_name(model: nn.Module, width: int, message: str) -> None:
    def loss_fn(batch: Batch) -> Tensor:
        return model(batch["x"]).pow(2).sum(1)

    batch = {"x": torch.randn(2, width)}
    engine = GhostEngine(model, max_grad_norm=1.0)
    for check in (engine.accumulate,):
        with pytest.raises(ValueError, match=message):
            check(loss_fn, batch)
    assert_clean(model)


def test_frozen_uncovered_module_is_fine() -> None:
    model = WithConv().double()
    model.conv.requires_grad_(False)
    batch = {"x": torch.randn(3, 4, dtype=torch.float64)}
    check_against_oracles(model, lambda b: model(b["x"]).pow(2).sum(1), batch, clip=0.1)


def test_scale_grad_by_freq_and_shared_position_ids_are_refused() -> None:
    embedding = nn.Embedding(5, 3, scale_grad_by_freq=True)
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        GhostEngine(embedding, max_grad_norm=1.0).accumulate(
            lambda b: embedding(b["x"]).sum((1, 2)), {"x": torch.ones(2, 3, dtype=torch.long)}
        )
    model = lm(UntiedEmbeddings())
    batch = padded_batch([3, 3], "right")

    def no_positions(batch: Batch) -> Tensor:  # GPT-2 then builds position_ids [1, T]: not per example
        return model.model(input_ids=batch["input_ids"]).logits.sum((1, 2))

    with pytest.raises(ValueError, match=r"wpe.*\[B, T\]"):
        GhostEngine(model, max_grad_norm=1.0).accumulate(no_positions, batch)
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        GhostEngine(model, max_grad_norm=1.0).accumulate(lambda b: model.per_example_loss(b).sum(), batch)
    assert_clean(model)


def assert_clean(model: nn.Module, *, all_trainable: bool = True) -> None:
    """No hooks left on any module and (``all_trainable``) every parameter trainable again."""
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
    assert not all_trainable or all(p.requires_grad for p in model.parameters())


def test_hooks_removed_requires_grad_restored_and_eval_unaffected() -> None:
    model = classifier(UntiedEmbeddings(), freeze=["backbone.transformer.wpe"])
    states = {name: p.requires_grad for name, p in model.named_parameters()}
    batch = padded_batch([4, 6], "right")
    with torch.no_grad():
        before = model(batch["input_ids"], batch["attention_mask"])
    GhostEngine(model, max_grad_norm=1.0).accumulate(model.per_example_loss, batch)
    assert_clean(model, all_trainable=False)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == states
    with torch.no_grad():
        after = model(batch["input_ids"], batch["attention_mask"])
    assert not after.requires_grad
    assert torch.equal(before, after)


def test_bf16_autocast_gives_float64_norms_close_to_float32() -> None:
    model = classifier(TiedEmbeddings()).float()
    batch = padded_batch([6, 9, 2], "left")
    engine = GhostEngine(model, max_grad_norm=1.0)
    reference, reference_grads = run(engine, model, model.per_example_loss, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stats, grads = run(engine, model, model.per_example_loss, batch)
    assert stats.norms.dtype == torch.float64  # norms are always float64 (rigorous rounding slack)
    assert torch.allclose(stats.norms, reference.norms, rtol=5e-2)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert (grad - reference_grads[name]).norm() <= 0.1 * reference_grads[name].norm() + 1e-6


def test_build_engine_and_options() -> None:
    model = ToyReuse()
    assert isinstance(build_engine("ghost", model, max_grad_norm=1.0, tied_norm="bound"), GhostEngine)
    with pytest.raises(ValueError, match="tied_norm"):
        GhostEngine(model, max_grad_norm=1.0, tied_norm="approximate")  # type: ignore[arg-type]


def test_empty_micro_batch() -> None:
    model = classifier(UntiedEmbeddings())
    batch = {key: value[:0] for key, value in padded_batch([3], "right").items()}
    stats, grads = run(GhostEngine(model, max_grad_norm=1.0), model, model.per_example_loss, batch)
    assert stats.norms.shape == (0,)
    assert all(not grad.any() for grad in grads.values())


def test_cached_view_of_a_parameter_is_refused() -> None:
    model = ToyReuse().double()
    transposed = model.emb.weight.T  # a view made before the forward: no op on the Parameter inside it

    def loss_fn(batch: Batch) -> Tensor:
        h = model.norm(model.mix(model.emb(batch["input_ids"])))  # [B, T, 6]
        return (h[:, -1] @ transposed).logsumexp(-1)  # [B]

    with pytest.raises(ValueError, match=r"'emb\.weight'"):
        GhostEngine(model, max_grad_norm=1.0).accumulate(loss_fn, {"input_ids": torch.tensor([[1, 2, 3]])})
    assert_clean(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant: bool) -> None:
    model = lm(TiedEmbeddings()).train()
    model.model.activation_checkpointing_enable({"use_reentrant": reentrant})
    batch = padded_batch([5, 7], "right")
    engine = GhostEngine(model, max_grad_norm=1.0)
    if reentrant:  # layers run under no_grad and are recomputed in backward: refused, never silently zero
        with pytest.raises(ValueError, match="no_grad"):
            engine.accumulate(model.per_example_loss, batch)
        assert all(p.requires_grad for p in model.parameters())
        return
    grads = per_example_gradients(model, model.per_example_loss, batch)  # (vmap cannot trace checkpointing)
    stats, ghost_grads = run(engine, model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(grads))
    expected = clipped_sum(grads, 1.0)
    for name, grad in ghost_grads.items():
        assert_close(grad, expected[name])


def test_user_forward_hook_changing_an_output_stays_exact() -> None:
    model = ToyReuse().double()
    handle = model.mix.register_forward_hook(lambda module, args, output: 2.0 * output)
    batch = {"input_ids": torch.tensor([[1, 3, 3, 5], [2, 4, 0, 2]]), "labels": torch.tensor([1, 0])}
    check_against_oracles(model, model.per_example_loss, batch, clip=0.4)
    handle.remove()


def test_in_place_op_on_an_embedding_output() -> None:
    model = ToyReuse().double()

    def loss_fn(batch: Batch) -> Tensor:
        h = model.emb(batch["input_ids"])  # [B, T, 6]
        h *= 3.0  # in place on the output the engine made require grad
        logits = model.head(model.norm(model.mix(h)))  # [B, T, 11]
        return F.cross_entropy(logits[:, -1], batch["labels"], reduction="none")

    batch = {"input_ids": torch.tensor([[1, 3, 3, 5], [2, 4, 0, 2]]), "labels": torch.tensor([1, 0])}
    check_against_oracles(model, loss_fn, batch, clip=0.4)


def test_sdpa_attention_matches_brute_force() -> None:
    torch.manual_seed(0)
    model = GPT2Classifier(
        config=TINY,
        vocab_size=VOCAB,
        embeddings=TiedEmbeddings(),
        label_word_ids=LABEL_WORDS,
        attn_implementation="sdpa",
    ).double()  # vmap (PerExampleEngine) cannot trace sdpa's mask; the ghost engine has no such limit
    batch = padded_batch([5, 1, 9, 3], "left")
    grads = per_example_gradients(model, model.per_example_loss, batch)
    stats, ghost_grads = run(GhostEngine(model, max_grad_norm=0.5), model, model.per_example_loss, batch)
    assert_close(stats.norms, gradient_norms(grads))
    expected = clipped_sum(grads, 0.5)
    for name, grad in ghost_grads.items():
        assert_close(grad, expected[name])


def test_coverage_is_computed_once_and_redone_when_trainable_parameters_change() -> None:
    model = classifier(TiedEmbeddings())
    engine = GhostEngine(model, max_grad_norm=1.0)
    engine.check_parameters()
    first = engine.coverage()
    assert engine.coverage() is first  # reused: no walk of every module's parameters per micro-batch
    engine.accumulate(model.per_example_loss, padded_batch([3, 2], "right"))
    assert engine.coverage() is first  # the pass's own requires_grad switching leaves it valid
    wpe = model.backbone.transformer.wpe.weight
    wpe.requires_grad_(False)
    frozen = engine.coverage()
    assert frozen is not first and id(wpe) not in frozen.parameters
    wpe.requires_grad_(True)
    assert id(wpe) in engine.coverage().parameters


def test_a_parameter_unfrozen_or_added_after_setup_without_a_rule_is_still_refused_by_name() -> None:
    model = WithConv().double()
    model.conv.requires_grad_(False)
    engine = GhostEngine(model, max_grad_norm=1.0)
    engine.check_parameters()
    batch = {"x": torch.randn(3, 4, dtype=torch.float64)}

    def loss_fn(b: Batch) -> Tensor:
        return model(b["x"]).pow(2).sum(1)

    engine.accumulate(loss_fn, batch)  # coverage computed and cached with the Conv2d frozen
    model.conv.weight.requires_grad_(True)  # unfrozen after setup: the Conv2d has no rule
    for check in (engine.check_parameters, lambda: engine.accumulate(loss_fn, batch)):
        with pytest.raises(ValueError, match=r"'conv\.weight'.*Conv2d"):
            check()
    assert_clean(model, all_trainable=False)
    model.conv.weight.requires_grad_(False)
    engine.accumulate(loss_fn, batch)
    model.proj.scale = nn.Parameter(torch.ones(2, dtype=torch.float64))  # added to a covered Linear after setup
    with pytest.raises(ValueError, match=r"'proj\.scale'.*Linear"):
        engine.accumulate(loss_fn, batch)
    assert model.proj.scale.grad is None  # refused before any gradient reached it


def test_module_state_is_checked_on_every_call_with_a_cached_coverage() -> None:
    model = ToyReuse().double()
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([4])}
    engine = GhostEngine(model, max_grad_norm=1.0)
    engine.accumulate(model.per_example_loss, batch)
    model.emb.scale_grad_by_freq = True
    with pytest.raises(ValueError, match=r"'emb\.weight'.*scale_grad_by_freq"):
        engine.accumulate(model.per_example_loss, batch)
    model.emb.scale_grad_by_freq = False
    model.mix.forward = lambda x: F.linear(x * x, model.mix.weight, model.mix.bias)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"'mix\.weight' belongs to 'mix' \(Linear\), whose forward was replaced"):
        engine.accumulate(model.per_example_loss, batch)
    assert_clean(model)


def test_retying_after_setup_recomputes_the_owners() -> None:
    model = ToyReuse().double()
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())  # untied
    batch = {"input_ids": torch.tensor([[0, 3, 3, 5], [2, 0, 0, 2], [7, 7, 7, 7]]), "labels": torch.tensor([1, 0, 7])}
    engine = GhostEngine(model, max_grad_norm=0.4)
    engine.accumulate(model.per_example_loss, batch)
    model.head.weight = model.emb.weight  # tied after the coverage was cached: head must now own emb.weight too
    assert engine.coverage().owners[id(model.emb.weight)].modules == {id(model.emb), id(model.head)}
    check_against_oracles(model, model.per_example_loss, batch, clip=0.4)


def test_small_chunks_stack_and_split_the_norms_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    import dplit.privacy.clipping.parameter_norms as tied_module

    monkeypatch.setattr(ghost_module, "CHUNK_ELEMENTS", 200)  # biases and norm scales stacked a few at a time
    monkeypatch.setattr(tied_module, "CHUNK_ELEMENTS", 200)  # and large uses normed a few examples at a time
    model = lm(TiedEmbeddings())
    batch = padded_batch([5, 9, 3, 7], "left")
    check_against_oracles(model, model.per_example_loss, batch, clip=0.5)


@pytest.mark.parametrize("budget", [0, 3000, 2**25], ids=["none-kept", "some-kept", "all-kept"])
def test_clipped_sums_from_kept_materialised_gradients_are_exact(budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ghost_module, "KEPT_ELEMENTS", budget)  # how many per-example gradients the norms leave
    kept_sizes: list[int] = []
    keep = ghost_module._add_kept_clipped_sum

    def spy(param: nn.Parameter, gradients: Tensor, factors: Tensor, keep_mask: Tensor | None) -> None:
        kept_sizes.append(gradients.numel())
        keep(param, gradients, factors, keep_mask)

    monkeypatch.setattr(ghost_module, "_add_kept_clipped_sum", spy)
    model = lm(UntiedEmbeddings())  # T = 30: Conv1D and lm_head materialise (T·r·c ≤ T²·(r + c))
    check_against_oracles(model, model.per_example_loss, padded_batch([30, 24, 7], "right", seed=3), clip=1.0)
    assert sum(kept_sizes) <= budget and (bool(kept_sizes) == (budget > 0))
