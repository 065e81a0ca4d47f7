"""Seeds and the generators they start: a seed's bits all count, up to what the device's generator can hold.

``torch.Generator().manual_seed(s)`` keeps only the low 32 bits of ``s`` on a CPU (torch's mt19937 is initialised
from a 32-bit integer): a 63-bit seed from the OS gives only 2³² noise streams, few enough for an attacker to
search one step's noise against its released update. :func:`seeded_generator` therefore fills the CPU generator's
whole mt19937 state (624 words of 32 bits) from a SHAKE-256 expansion of the seed, so a seed of
:data:`SEED_BITS` random bits is a stream among 2²⁵⁶. CUDA's Philox takes a 64-bit key and a 64-bit counter
offset: the seed is hashed into both (the offset a multiple of 4, as torch requires), about 2¹²⁴ streams.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

SEED_BITS = 256
"""Bits of a seed: what :func:`derive_seed` returns and what OS-entropy seeds draw."""

MT19937_WORDS = 624
"""32-bit words of the mt19937 state behind torch's CPU generator."""

_LEGACY_STATE_HEADER = struct.Struct("<QiiQ")
"""The head of the CPU generator's ``get_state()`` bytes: initial seed, ``left``, ``seeded``, ``next``; then the 624
state words, one per 64-bit slot (torch's legacy ``THGeneratorState`` layout, kept for checkpoints)."""


def derive_seed(*parts: int | str) -> int:
    """A seed of :data:`SEED_BITS` bits determined by ``parts``: distinct parts give unrelated generator streams."""
    digest = hashlib.sha256(repr(parts).encode()).digest()  # 256 bits
    return int.from_bytes(digest, "little")


def seeded_generator(seed: int, *, device: torch.device) -> torch.Generator:
    """A generator on ``device`` whose stream is determined by all of ``seed`` (any non-negative integer).

    On a CPU, the whole mt19937 state is the SHAKE-256 expansion of ``seed``; elsewhere the seed is hashed into the
    device generator's 64-bit key and its counter offset.

    Raises:
        RuntimeError: torch did not load the state as written (a torch whose generator state has another layout).
    """
    seed_bytes = seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    if device.type != "cpu":
        key, offset = struct.unpack("<QQ", hashlib.sha256(seed_bytes).digest()[:16])
        generator = torch.Generator(device=device).manual_seed(key)
        generator.set_offset(4 * (offset >> 4))  # < 2⁶², a multiple of 4: room left for the draws' own advance
        return generator
    words = np.frombuffer(hashlib.shake_256(seed_bytes).digest(4 * MT19937_WORDS), dtype="<u4")
    generator = torch.Generator()
    state = generator.get_state().numpy().copy()  # uint8 bytes of the legacy layout
    _LEGACY_STATE_HEADER.pack_into(state, 0, 0, 1, 1, 0)  # no initial seed recorded; twist before the first output
    _state_words(state)[:] = words
    generator.set_state(torch.from_numpy(state))
    if not np.array_equal(_state_words(generator.get_state().numpy()), words):
        raise RuntimeError("torch's CPU generator did not take the mt19937 state dplit wrote: unknown state layout")
    return generator


def _state_words(state: np.ndarray) -> np.ndarray:
    """The 624 mt19937 words of a CPU generator's state bytes, one per 64-bit slot (a view)."""
    return state[_LEGACY_STATE_HEADER.size : _LEGACY_STATE_HEADER.size + 8 * MT19937_WORDS].view("<u8")
