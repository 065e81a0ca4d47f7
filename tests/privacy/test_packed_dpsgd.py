"""DP-SGD on packed rows against the padded run: same seed, same documents, the same first release at σ = 0."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from dplit.data.packing import PackingCollator
from dplit.data.text import TextCollator, TextDataset, TextExample
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.settings import DPSGDSettings
from tests.helpers.families import VOCAB, tiny_task

ROW = 16
CLIP = 0.05


def corpus() -> TextDataset:
    """24 documents of 1 to 16 tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, ROW + 1, (24,), generator=generator).tolist()
    return TextDataset(
        [
            TextExample(input_ids=torch.randint(1, VOCAB, (n,), generator=generator).tolist(), loss_mask=[1] * n)
            for n in lengths
        ]
    )


def first_release(collate: object) -> tuple[list[list[int]], DPSGD, dict[str, torch.Tensor]]:
    """One σ = 0 step of a float64 GPT-2 on :func:`corpus` with a fixed sampling seed: indices, mechanism, gradients."""
    model = tiny_task("language_model", "gpt2", "tied")
    settings = DPSGDSettings(
        max_grad_norm=CLIP, noise_multiplier=0.0, target_delta=1e-3, max_physical_batch_size=4, seed=7
    )
    dpsgd = DPSGD(model, settings, history=PrivacyHistory())
    loader = dpsgd.sample(DataLoader(corpus(), batch_size=8, collate_fn=collate))  # type: ignore[arg-type]
    dpsgd.start(planned_steps=1)
    indices = list(loader.batch_sampler)  # type: ignore[arg-type]
    batch = loader.collate_fn([loader.dataset[i] for i in indices[0]])  # the first Poisson batch
    stats = dpsgd.clip(model.per_example_loss, batch)
    dpsgd.release()
    dpsgd.stats = stats  # type: ignore[attr-defined]
    return indices, dpsgd, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_packed_run_samples_the_padded_runs_documents_and_makes_its_first_update() -> None:
    """The sampler does not see the collate function; at σ = 0 the released gradient and the per-document norms agree."""
    padded_indices, padded, padded_grads = first_release(TextCollator(pad_token_id=0))
    packed_indices, packed, packed_grads = first_release(PackingCollator(max_length=ROW, pad_token_id=0))
    assert padded_indices == packed_indices
    norms = (padded.stats.norms.sort().values, packed.stats.norms.sort().values)  # type: ignore[attr-defined]
    assert norms[0].numel() == len(padded_indices[0]) > 1 and bool((norms[0] > CLIP).any())
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-9, atol=1e-12)
    losses = (padded.stats.losses.sort().values, packed.stats.losses.sort().values)  # type: ignore[attr-defined]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-9, atol=1e-12)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
    assert "isolated" in packed.facts()["packing"] and "packing" not in padded.facts()
