"""GradientBuffer: gradients as views of one flat tensor, noise in place, publication."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dplit.privacy import gradient_buffer
from dplit.privacy.gradient_buffer import GradientBuffer


def test_accumulation_lands_in_the_flat_buffer_without_copies() -> None:
    params = [nn.Parameter(torch.ones(3, 2)), nn.Parameter(torch.ones(4))]
    buffer = GradientBuffer(params, extra=1)
    buffer.attach()
    params[0].grad.add_(2.0)
    params[1].grad.add_(torch.arange(4.0))
    buffer.detach()
    assert all(p.grad is None for p in params)
    torch.testing.assert_close(buffer.flat, torch.tensor([2.0] * 6 + [0.0, 1.0, 2.0, 3.0] + [0.0]))
    buffer.attach()
    assert buffer.flat.abs().sum() == 0 and params[0].grad.data_ptr() == buffer.flat.data_ptr()


def test_other_dtype_parameters_are_folded_in_at_fp32() -> None:
    params = [nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), nn.Parameter(torch.ones(2))]
    buffer = GradientBuffer(params)
    buffer.attach()
    assert params[0].grad is None
    params[0].grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
    buffer.detach()
    assert buffer.flat.dtype == torch.float32
    torch.testing.assert_close(buffer.flat, torch.tensor([0.5, 0.5, 0.0, 0.0]))
    buffer.publish(2.0)
    assert params[0].grad.dtype == torch.bfloat16 and params[1].grad.dtype == torch.float32
    torch.testing.assert_close(params[0].grad.float(), torch.tensor([0.25, 0.25]))


def test_a_received_other_dtype_sum_is_folded_in_at_once_so_micro_batches_add_in_fp32() -> None:
    params = [nn.Parameter(torch.ones(1, dtype=torch.bfloat16)), nn.Parameter(torch.ones(1))]
    buffer = GradientBuffer(params)
    buffer.attach()
    for value in (1.0, 2.0**-8, 2.0**-8):  # in bf16, 1 + 2⁻⁸ rounds back to 1: a bf16 running sum would stay 1
        params[0].grad = torch.tensor([value], dtype=torch.bfloat16)
        buffer.receive(params[0])
        assert params[0].grad is None
        params[1].grad.add_(1.0)
        buffer.receive(params[1])  # already a view into the buffer: it stays
    torch.testing.assert_close(buffer.flat, torch.tensor([1.0 + 2.0**-7, 3.0]))
    assert params[1].grad is not None


def test_noise_has_the_asked_std_and_spares_the_extra_slots() -> None:
    params = [nn.Parameter(torch.zeros(100, 100)), nn.Parameter(torch.zeros(50_000))]
    buffer = GradientBuffer(params, extra=1)
    buffer.attach()
    buffer.extra.fill_(7.0)
    buffer.add_noise(0.3, torch.Generator().manual_seed(0))
    assert buffer.extra.item() == 7.0
    assert buffer.flat[:-1].std().item() == pytest.approx(0.3, rel=0.02)
    buffer.publish(3.0)
    assert params[1].grad.std().item() == pytest.approx(0.1, rel=0.02)


def test_noise_drawn_chunk_by_chunk_reaches_every_entry_once_with_fresh_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 7 across parameters of 6 and 30 entries: each entry noised, no chunk's draw reused for the next."""
    monkeypatch.setattr(gradient_buffer, "NOISE_CHUNK", 7)
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(30))]
    buffer = GradientBuffer(params, extra=1)
    buffer.attach()
    buffer.add_noise(1.0, torch.Generator().manual_seed(0))
    noise = buffer.gradients
    assert bool((noise != 0).all()) and buffer.extra.item() == 0.0
    assert noise.unique().numel() == noise.numel()  # 36 independent draws: no repeated scratch
    again = GradientBuffer(params, extra=1)
    again.attach()
    again.add_noise(1.0, torch.Generator().manual_seed(0))
    assert torch.equal(again.gradients, noise)  # one stream, in order: a seeded run stays reproducible


def test_float64_parameters_keep_a_float64_buffer() -> None:
    buffer = GradientBuffer([nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    assert buffer.flat.dtype == torch.float64


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 5, 9])  # first, middle and last gradient entry
def test_a_non_finite_entry_anywhere_is_refused_before_release(bad: float, where: int) -> None:
    buffer = GradientBuffer([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 3))], extra=1)
    buffer.refuse_non_finite(step=1)  # all finite: passes
    buffer.gradients[where] = bad
    with pytest.raises(FloatingPointError, match="DP-SGD step 3: the noisy gradient sum is not finite"):
        buffer.refuse_non_finite(step=3)
