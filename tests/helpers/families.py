"""The model families dplit supports, as tiny random configs, and how to check one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from peft import LoraConfig
from torch import Tensor, nn

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.data.text import TextCollator, TextExample
from dplit.privacy.clipping.engine import Batch
from dplit.privacy.clipping.ghost import GhostEngine
from dplit.tasks.base import CausalLMModule
from dplit.tasks.classifier import CausalLMClassifier
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers.brute_force import clipped_sum, gradient_norms, per_example_gradients
from tests.helpers.oracles import assert_close, check_against_oracles, run

SMALL = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per key/value head
    "max_position_embeddings": 64,
}


FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **SMALL},
    "qwen2": {"model_type": "qwen2", **SMALL},  # q/k/v projections with biases
    "mistral": {"model_type": "mistral", **SMALL, "sliding_window": None},
}


def attention_for(side: str) -> str:
    """Left padding needs sdpa in float64.

    Eager attention's float32 softmax turns float64's mask minimum into -inf, so a padding query that sees no key gives
    NaN (float32 and bf16 models are fine with eager).
    """
    return "sdpa" if side == "left" else "eager"


def check(module: nn.Module, loss_fn: Callable[[Batch], Tensor], batch: Batch, clip: float, side: str) -> None:
    """Ghost against the brute-force loop and, where vmap can trace the model (eager), the per-example engine."""
    if attention_for(side) == "eager":
        check_against_oracles(module, loss_fn, batch, clip)
        return
    grads = per_example_gradients(module, loss_fn, batch)
    stats, ghost_grads = run(GhostEngine(module, max_grad_norm=clip), module, loss_fn, batch)
    assert_close(stats.norms, gradient_norms(grads))
    expected = clipped_sum(grads, clip)
    for name, grad in ghost_grads.items():
        assert_close(grad, expected[name])


VOCAB = 30


def instruction_batch(side: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Four examples of different lengths; two are prompt + response (loss on the response only)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for length, prompt in [(9, 4), (3, 0), (26, 20), (14, 0)]:  # 26 tokens: past the Gram/materialise break-even
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        examples.append(TextExample(input_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt)))
    examples[3]["input_ids"] = [5] * 14  # one example is a single token repeated (tied: many equal ids)
    return TextCollator(pad_token_id=0, padding_side=side)(examples)  # type: ignore[arg-type]


TASK_CONFIGS = {"gpt2": {"n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 64}, "llama": FAMILIES["llama"]}
"""Tiny GPT-2 and Llama backbones for the task-level checks."""
LORA_TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "down_proj"]}


def tiny_task(kind: str, family: str, policy: str, **settings: Any) -> CausalLMModule:
    """A tiny float64 classifier or language model in training mode, seed 0.

    ``policy``: ``"tied"``, ``"untied"`` or ``"lora"`` (rank-4 LoRA beside the trained tied embedding);
    ``settings``: more task arguments (e.g. ``gradient_checkpointing=True``).
    """
    torch.manual_seed(0)
    adapters = {"peft": LoraConfig(r=4, target_modules=LORA_TARGETS[family]), "train_embeddings": True}
    common = {
        "config": TASK_CONFIGS[family],
        "vocab_size": VOCAB,
        "embeddings": UntiedEmbeddings() if policy == "untied" else TiedEmbeddings(),
        **(adapters if policy == "lora" else {}),
        **settings,
    }
    if kind == "classifier":
        return CausalLMClassifier(label_word_ids=[3, 7], **common).double().train()
    return CausalLanguageModel(**common).double().train()
