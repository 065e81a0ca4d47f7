"""What binding the privacy history to the weights costs: dplit's content digest of a whole model's weights.

The digest (``dplit.privacy.weights_content.content_digest``, the shipped function) runs at each boundary of the
weights' history: once when a task is built, before and after each DP fit, at each checkpoint, and at export. This
times it on state dicts with the exact tensor shapes of GPT-2 (124M) and Llama 3.2 1B (float32 and bfloat16), and
states what the measured rate means for an 8B model. Not a test.

    python -m bench.content_digest            # ~1-2 minutes on 2 CPU cores; prints a markdown table
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.machine import git_info, machine_description, machine_info
from dplit.privacy.weights_content import content_digest

SHAPES: dict[str, Callable[[], object]] = {
    "GPT-2 (124M)": lambda: AutoConfig.for_model("gpt2"),
    "Llama 3.2 1B": lambda: AutoConfig.for_model(
        "llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),  # fmt: skip
}
LLAMA_8B_PARAMETERS = 8.03e9
"""Llama 3.1 8B's parameter count (embedding and head untied)."""


def random_state(config: object, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A state dict with the model's names and shapes, filled with random values of ``dtype``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(value.shape, generator=generator).to(dtype) for name, value in model.state_dict().items()}


def time_digest(state: dict[str, torch.Tensor], repeats: int) -> float:
    """The fastest of ``repeats`` digests of ``state``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        content_digest(state)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Time the digest of each model shape and dtype, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"{machine_description(machine_info())}; dplit {git_info('dplit')['describe']}\n")
    print("| weights | dtype | entries | GB hashed | seconds | GB/s |\n|---|---|---:|---:|---:|---:|")
    rates: dict[torch.dtype, float] = {}
    for name, make_config in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            state = random_state(make_config(), dtype)
            entries = sum(value.numel() for value in state.values())
            size = sum(value.numel() * value.element_size() for value in state.values()) / 1e9
            seconds = time_digest(state, args.repeats)
            rates[dtype] = size / seconds  # the last (largest) model's rate per dtype
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {entries / 1e6:.0f}M | {size:.2f} | {seconds:.2f} | {size / seconds:.2f} |")
            del state
    for dtype, width in ((torch.bfloat16, 2), (torch.float32, 4)):
        size = LLAMA_8B_PARAMETERS * width / 1e9
        print(
            f"An 8B model in {str(dtype).removeprefix('torch.')} ({size:.1f} GB) at the Llama 3.2 1B rate of that dtype "
            f"({rates[dtype]:.2f} GB/s): {size / rates[dtype]:.0f} s per digest on this machine."
        )


if __name__ == "__main__":
    main()
