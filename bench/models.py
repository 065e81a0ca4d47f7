"""The benchmarks' models and batches: GPT-2 and SmolLM2-shaped sizes, random weights, random tokens, LoRA."""

from __future__ import annotations

import argparse
from typing import Any

LORA_TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # GPT-2's Conv1D layers (fan_in_fan_out)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M's shape: Llama, deep and narrow (30 layers, width 576)
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,  # grouped-query attention
    "intermediate_size": 1536,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12},  # 124M parameters tied (GPT-2 small)
    "distilgpt2": {"model_type": "gpt2", "n_layer": 6, "n_embd": 768, "n_head": 12},  # 82M tied
    "tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4},  # --quick; GPT-2's full vocabulary
    "smollm2": SMOLLM2_135M,  # 135M parameters tied (RMSNorm, SwiGLU MLP, rotary positions, no biases)
    # SmolLM2's depth (30 layers) and 3:1 grouped-query heads at width 96: little compute, every per-layer and
    # per-call cost of an engine exposed (what a GPU shows at full width); full vocabulary
    "smollm2_tiny": {**SMOLLM2_135M, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1,
                     "intermediate_size": 256},
}
VOCAB_SIZES = {"gpt2": 50257, "llama": 49152}
"""Vocabulary by family: GPT-2's BPE, SmolLM2's tokenizer."""
LABEL_WORDS = {"gpt2": [7818, 1049], "llama": [1109, 13321]}
"""SST-2 label words " terrible", " great" in each family's tokenizer."""
VOCAB_SIZE = VOCAB_SIZES["gpt2"]  # the GPT-2 sizes' (kept for callers of the former constants)
LABEL_WORD_IDS = LABEL_WORDS["gpt2"]


def adapters(method: str) -> tuple[str, bool, bool]:
    """(base method, whether the model has LoRA adapters, whether its embedding trains beside them)."""
    if method.endswith("_lora_embedding"):
        return method.removesuffix("_lora_embedding"), True, True
    if method.endswith("_lora"):
        return method.removesuffix("_lora"), True, False
    return method, False, True


def lora_config(model: str) -> Any:
    """Rank-8 LoRA (alpha 16, no dropout) on every attention and MLP projection of the family."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[family(model)],
                      fan_in_fan_out=family(model) == "gpt2")


def family(model: str) -> str:
    """The transformers ``model_type`` of a benchmark model size."""
    return MODELS[model]["model_type"]


def backbone_config(model: str, seq_len: int) -> dict[str, Any]:
    """The random-init backbone's config (``CausalLMClassifier(config=...)``) for a size and sequence length."""
    settings = dict(MODELS[model])
    settings["vocab_size"] = VOCAB_SIZES[family(model)]
    if family(model) == "gpt2":
        settings["n_positions"] = max(1024, seq_len)
    else:
        settings["max_position_embeddings"] = max(8192, seq_len)  # SmolLM2's (rotary: no position table)
    return settings


def build_model(args: argparse.Namespace, device: Any) -> Any:
    """The model every method trains: a random-weight classifier (causal LM with ``--task lm``), in train mode."""
    from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
    from dplit.tasks.classifier import CausalLMClassifier

    embeddings = TiedEmbeddings() if args.policy == "tied" else UntiedEmbeddings(init="copy")
    _, lora, train_embeddings = adapters(args.method)
    peft = {"peft": lora_config(args.model), "train_embeddings": train_embeddings} if lora else {}
    if args.task == "dpo":
        from dplit.tasks.preference import PreferenceModel

        preference_model = PreferenceModel(
            config=backbone_config(args.model, args.seq_len), embeddings=embeddings, dropout=0.0,
            attn_implementation="eager", lr=args.lr, beta=0.1, **peft,
        )  # fmt: skip
        return preference_model.to(device).train()
    if args.task == "lm":
        from dplit.tasks.language_model import CausalLanguageModel

        language_model = CausalLanguageModel(
            config=backbone_config(args.model, args.seq_len), embeddings=embeddings, dropout=0.0,
            attn_implementation="eager", lr=args.lr, sample_prompts=[], **peft,
        )  # fmt: skip
        return language_model.to(device).train()
    model = CausalLMClassifier(
        config=backbone_config(args.model, args.seq_len),
        embeddings=embeddings,
        head="label_words",
        label_word_ids=LABEL_WORDS[family(args.model)],
        dropout=0.0,
        attn_implementation="eager",
        lr=args.lr,
        **peft,
    )
    return model.to(device).train()


def make_batch(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """One batch of B random sequences of T real tokens (no padding), with random labels, seeded by ``--seed``.

    ``--task dpo``: B preference pairs, 2B rows of T tokens (each pair's chosen then rejected row, a shared prompt of
    T/2 tokens, the answers' T/2 tokens in the loss mask), both rows of a pair one privacy unit.
    """
    import torch

    if args.task == "dpo":
        return preference_batch(args, device)

    generator = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch_size, args.seq_len)
    vocab, classes = VOCAB_SIZES[family(args.model)], len(LABEL_WORDS[family(args.model)])
    return {
        "input_ids": torch.randint(0, vocab, shape, generator=generator).to(device),
        "attention_mask": torch.ones(shape, dtype=torch.long).to(device),  # all real tokens, no padding
        "labels": torch.randint(0, classes, (args.batch_size,), generator=generator).to(device),
        "loss_mask": torch.ones(shape, dtype=torch.long).to(device),  # lm: every token is trained
    }


def preference_batch(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """B random preference pairs as ``dplit.data.preference``'s collate lays them out: 2B rows of T real tokens."""
    import torch

    from dplit.privacy.clipping.units import UNIT_KEY
    from dplit.tasks.preference import CHOSEN_KEY

    generator = torch.Generator().manual_seed(args.seed + 1)
    pairs, length, vocab = args.batch_size, args.seq_len, VOCAB_SIZES[family(args.model)]
    prompt = length // 2
    ids = torch.randint(0, vocab, (pairs, 2, length), generator=generator)
    ids[:, 1, :prompt] = ids[:, 0, :prompt]  # one prompt per pair, two answers
    answer = torch.zeros(length, dtype=torch.long)
    answer[prompt:] = 1
    rows = 2 * pairs
    return {
        "input_ids": ids.reshape(rows, length).to(device),
        "attention_mask": torch.ones(rows, length, dtype=torch.long).to(device),
        "loss_mask": answer.expand(rows, length).clone().to(device),
        CHOSEN_KEY: torch.tensor([1, 0] * pairs, dtype=torch.long).to(device),
        UNIT_KEY: torch.arange(pairs).repeat_interleave(2).to(device),
    }
