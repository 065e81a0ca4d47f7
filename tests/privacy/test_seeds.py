"""Seeds: every bit of a 256-bit seed starts the generator (torch's CPU ``manual_seed`` keeps 32 of them)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from dplit.privacy.noise import NoiseSource
from dplit.privacy.sampling import PoissonBatchSampler
from dplit.privacy.seeds import MT19937_WORDS, SEED_BITS, derive_seed, seeded_generator
from dplit.privacy.user_sampling import UserPoissonBatchSampler

CPU = torch.device("cpu")


def test_torch_keeps_only_32_bits_of_a_cpu_seed() -> None:
    """Why :func:`seeded_generator` exists: with ``manual_seed``, seeds equal in their low 32 bits are one stream."""
    first, second = (torch.Generator().manual_seed(7 + shift) for shift in (0, 1 << 40))
    assert torch.equal(torch.rand(8, generator=first), torch.rand(8, generator=second))


@pytest.mark.parametrize("shift", [32, 64, 128, 255])
def test_seeds_that_differ_in_any_bit_give_different_streams(shift: int) -> None:
    first, second = (seeded_generator(7 + extra, device=CPU) for extra in (0, 1 << shift))
    assert not torch.equal(torch.rand(8, generator=first), torch.rand(8, generator=second))


def test_the_whole_mt19937_state_is_the_seeds_expansion() -> None:
    seed = (1 << 200) + 12345
    state = seeded_generator(seed, device=CPU).get_state().numpy()
    words = state[24 : 24 + 8 * MT19937_WORDS].view("<u8")
    expected = np.frombuffer(hashlib.shake_256(seed.to_bytes(26, "little")).digest(4 * MT19937_WORDS), dtype="<u4")
    assert np.array_equal(words, expected.astype(np.uint64))


def test_the_state_is_a_freshly_seeded_engine_with_no_cached_draw() -> None:
    """As ``manual_seed`` leaves it, and the stream of numpy's MT19937 holding the same words, in order."""
    seed = derive_seed("layout")
    generator = seeded_generator(seed, device=CPU)
    state = bytes(generator.get_state().numpy())
    assert struct.unpack_from("<QiiQ", state, 0) == (0, 1, 1, 0)
    tail = state[24 + 8 * MT19937_WORDS :]
    assert struct.unpack_from("<dddi", tail, 0) == (0.0, 0.0, 0.0, 0) and struct.unpack_from("<f?", tail, 32) == (0, False)
    words = np.frombuffer(hashlib.shake_256(seed.to_bytes(32, "little")).digest(4 * MT19937_WORDS), dtype="<u4")
    reference = np.random.MT19937()
    reference.state = {"bit_generator": "MT19937", "state": {"key": words.copy(), "pos": MT19937_WORDS}}
    ours = torch.empty(16, dtype=torch.int64).random_(0, 2**31, generator=generator)  # a 64-bit draw (two words) each
    raw = reference.random_raw(32).reshape(16, 2)
    assert ours.tolist() == [((high << 32) | low) % 2**31 for high, low in raw.tolist()]


def test_the_noise_and_both_samplers_draw_from_seeded_generators() -> None:
    noise = NoiseSource.__new__(NoiseSource)  # an explicit seed without its warning, for this arithmetic check
    noise._seed = 3
    expected = seeded_generator(derive_seed(3, "noise", 1), device=CPU).get_state()
    assert torch.equal(noise.generator("noise", steps=1, device=CPU).get_state(), expected)
    rows = PoissonBatchSampler(dataset_size=10, sample_rate=0.5, steps=3, num_replicas=2, rank=1, seed=5)
    generator, shard = seeded_generator(derive_seed(5, 1), device=CPU), torch.arange(1, 10, 2)
    assert list(rows) == [shard[torch.rand(5, generator=generator) < 0.5].tolist() for _ in range(3)]
    users = UserPoissonBatchSampler(user_rows=[[0], [1], [2], [3]], sample_rate=0.5, max_rows_per_user=1, steps=3, seed=5)
    generator = seeded_generator(derive_seed(5, "users", 0), device=CPU)
    assert list(users) == [(torch.rand(4, generator=generator) < 0.5).nonzero().flatten().tolist() for _ in range(3)]


def test_a_seeded_generator_is_reproducible_and_draws_from_the_right_distributions() -> None:
    draws = [torch.randn(200_000, generator=seeded_generator(99, device=CPU)) for _ in range(2)]
    assert torch.equal(*draws)
    normal, uniform = draws[0], torch.rand(200_000, generator=seeded_generator(100, device=CPU))
    assert abs(normal.mean().item()) < 0.01 and abs(normal.std().item() - 1) < 0.01  # 4.5 standard errors
    assert abs(uniform.mean().item() - 0.5) < 0.003 and 0 <= uniform.min() and uniform.max() < 1


def test_derived_and_entropy_seeds_have_256_bits() -> None:
    derived = [derive_seed(0, "noise", step) for step in range(64)]
    assert len(set(derived)) == 64 and all(0 <= seed < 2**SEED_BITS for seed in derived)
    assert max(derived).bit_length() > 250  # the whole digest, not a 63-bit slice of it
    entropy = [NoiseSource().seed("noise", steps=0) for _ in range(64)]
    assert max(entropy).bit_length() > 250 and len(set(entropy)) == 64
