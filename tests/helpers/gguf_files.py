"""A tiny GGUF file, written here: a random float32 Llama with the tests' tiny byte-level BPE tokenizer inside.

It takes the same path through dplit as a real GGUF checkpoint (transformers' GGUF reader, the model and the
tokenizer both read from the one file) in about a second, where the real SmolLM2-135M file takes ~20 s to read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_GGUF = "tiny-llama.F32.gguf"
"""The file name :func:`write_tiny_llama_gguf` writes."""

_WIDTH, _FEED_FORWARD, _HEADS, _KV_HEADS, _BLOCKS = 16, 24, 4, 2, 2
"""Hidden size, MLP size, attention and key/value heads, blocks: the shape of ``TINY_LLAMA`` with two blocks."""


def write_tiny_llama_gguf(folder: Path, tokenizer_dir: Path) -> Path:
    """Write ``folder/TINY_GGUF``: a tied Llama of random weights (seed 0) and ``tokenizer_dir``'s BPE vocabulary.

    Args:
        folder: where the file goes (created).
        tokenizer_dir: a GPT-2 style tokenizer folder (``vocab.json`` + ``merges.txt``), e.g. the ``tiny_bpe_dir``
            fixture's; its first token is used as BOS and EOS.

    Returns:
        The GGUF file's path.
    """
    import gguf

    vocab = json.loads((tokenizer_dir / "vocab.json").read_text())
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [line for line in (tokenizer_dir / "merges.txt").read_text().splitlines() if line and not line.startswith("#")]
    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(folder / TINY_GGUF), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(_WIDTH)
    writer.add_block_count(_BLOCKS)
    writer.add_feed_forward_length(_FEED_FORWARD)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(_WIDTH // _HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, tensor in _random_llama_tensors(len(tokens)).items():  # no output.weight: the head is tied
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / TINY_GGUF


def _random_llama_tensors(vocab_size: int) -> dict[str, np.ndarray]:
    """llama.cpp's tensor names → float32 weights (N(0, 0.02²), norm scales 1), in GGUF's [out, in] layout."""
    rng = np.random.default_rng(0)
    kv_width = _KV_HEADS * _WIDTH // _HEADS

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"token_embd.weight": weight(vocab_size, _WIDTH), "output_norm.weight": np.ones(_WIDTH, np.float32)}
    for block in range(_BLOCKS):
        tensors |= {
            f"blk.{block}.attn_norm.weight": np.ones(_WIDTH, np.float32),
            f"blk.{block}.attn_q.weight": weight(_WIDTH, _WIDTH),
            f"blk.{block}.attn_k.weight": weight(kv_width, _WIDTH),
            f"blk.{block}.attn_v.weight": weight(kv_width, _WIDTH),
            f"blk.{block}.attn_output.weight": weight(_WIDTH, _WIDTH),
            f"blk.{block}.ffn_norm.weight": np.ones(_WIDTH, np.float32),
            f"blk.{block}.ffn_gate.weight": weight(_FEED_FORWARD, _WIDTH),
            f"blk.{block}.ffn_up.weight": weight(_FEED_FORWARD, _WIDTH),
            f"blk.{block}.ffn_down.weight": weight(_WIDTH, _FEED_FORWARD),
        }
    return tensors
