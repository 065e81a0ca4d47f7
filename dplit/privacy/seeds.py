"""Seeds and the generators they start: every bit of a seed counts.

``torch.Generator().manual_seed(s)`` keeps only the low 32 bits of ``s`` on a CPU (torch's mt19937 is initialised
from a 32-bit integer): a 63-bit seed from the OS gives only 2³² noise streams, few enough for an attacker to
search one step's noise against its released update. :func:`seeded_generator` therefore fills the CPU generator's
whole mt19937 state (624 words of 32 bits) from a SHAKE-256 expansion of the seed, so a seed of
:data:`SEED_BITS` random bits is a stream among 2²⁵⁶. On other devices (CUDA's Philox) torch's seed is 64 bits,
all of which are used.
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

    On a CPU, the whole mt19937 state is the SHAKE-256 expansion of ``seed``; elsewhere the seed is hashed to the 64
    bits the device's generator takes.
    """
    seed_bytes = seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    if device.type != "cpu":
        return torch.Generator(device=device).manual_seed(int.from_bytes(hashlib.sha256(seed_bytes).digest()[:8], "little"))
    words = np.frombuffer(hashlib.shake_256(seed_bytes).digest(4 * MT19937_WORDS), dtype="<u4")
    generator = torch.Generator()
    state = generator.get_state().numpy().copy()  # uint8 bytes of the legacy layout
    _LEGACY_STATE_HEADER.pack_into(state, 0, 0, 1, 1, 0)  # no initial seed recorded; twist before the first output
    slots = state[_LEGACY_STATE_HEADER.size : _LEGACY_STATE_HEADER.size + 8 * MT19937_WORDS].view("<u8")
    slots[:] = words
    generator.set_state(torch.from_numpy(state))
    return generator
