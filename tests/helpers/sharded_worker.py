"""One rank of the two-process sharded DP-SGD checks (gloo, CPU): DPSGD on FSDP2-sharded weights, no Lightning.

Each rank saves what it computed to ``<out>/rank<r>.pt``; ``tests/privacy/test_sharded_world.py`` compares the
ranks with the one-process DPSGD on the union of their batches.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.backbone.sharding import shard_task
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.sharded_world import ShardedProcessGroup
from dplit.privacy.weights_content import content_digest
from dplit.tasks.classifier import CausalLMClassifier
from tests.helpers.brute_force import clipped_sum, per_example_gradients
from tests.helpers.families import SMALL
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, PadCollate, RandomTokens

CLIP = 0.05
"""Small enough that most examples' gradients are clipped."""
ROWS = {0: [0, 1, 2], 1: [3, 4]}
"""Which examples of the dataset each rank holds in the compared step (rank 0: two micro-batches, rank 1: one)."""
CASES = [(family, policy) for family in ("gpt2", "llama") for policy in ("tied", "untied", "lora", "checkpointed")]
"""``lora``: rank-4 LoRA on the attention projections beside the trained tied embedding; ``checkpointed``: tied, with
each block's activations recomputed in the backward pass (``model.gradient_checkpointing``)."""
LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
NOISE_STEPS = 40


def make_classifier(family: str, policy: str) -> CausalLMClassifier:
    """A tiny float64 classifier of ``family`` with the ``policy`` embedding (seed 0)."""
    torch.manual_seed(0)
    config = TINY_GPT2 if family == "gpt2" else {"model_type": "llama", **SMALL}
    embeddings = UntiedEmbeddings() if policy == "untied" else TiedEmbeddings()
    adapters = {"peft": LoraConfig(r=4, target_modules=LORA_TARGETS[family]), "train_embeddings": True}
    return CausalLMClassifier(
        config=config,
        vocab_size=VOCAB,
        label_word_ids=LABEL_WORDS,
        embeddings=embeddings,
        gradient_checkpointing=policy == "checkpointed",
        **(adapters if policy == "lora" else {}),
    ).double()


def loader(dataset: RandomTokens) -> DataLoader:
    """The training loader DPSGD samples from: expected batch 4 of N = 8."""
    return DataLoader(dataset, batch_size=4, collate_fn=PadCollate())


def started_dpsgd(module: CausalLMClassifier, world: Any, *, sigma: float, steps: int = 1) -> DPSGD:
    """DPSGD on ``module`` at C = :data:`CLIP`, expected batch 4 of N = 8, two examples per micro-batch."""
    settings = DPSGDSettings(
        max_grad_norm=CLIP, noise_multiplier=sigma, target_delta=1e-3, max_physical_batch_size=2, self_check=False
    )
    dpsgd = DPSGD(module, settings, history=PrivacyHistory(), world=world)
    dpsgd.sample(loader(RandomTokens(8, seed=0)))
    dpsgd.start(planned_steps=steps)
    return dpsgd


def released_gradients(
    module: CausalLMClassifier, batch: dict[str, torch.Tensor], world: Any, *, sigma: float, steps: int = 1
) -> list[dict[str, torch.Tensor]]:
    """Each step's released gradient (whole tensors) after clipping ``batch`` on this rank."""
    dpsgd = started_dpsgd(module, world, sigma=sigma, steps=steps)
    released = []
    for _ in range(steps):
        dpsgd.clip(module.per_example_loss, batch)
        dpsgd.release()
        released.append({name: _whole(p.grad) for name, p in module.named_parameters() if p.grad is not None})
        module.zero_grad(set_to_none=True)
    return released


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.detach().clone()


def collate(rows: list[int]) -> dict[str, torch.Tensor]:
    """The examples ``rows`` of the dataset as one right-padded batch (an empty batch for no rows)."""
    dataset = RandomTokens(8, seed=0)
    if not rows:
        return {"input_ids": torch.zeros(0, 1, dtype=torch.long), "attention_mask": torch.zeros(0, 1, dtype=torch.long),
                "labels": torch.zeros(0, dtype=torch.long)}  # fmt: skip
    return PadCollate()([dataset[i] for i in rows])


def run(rank: int, size: int, out: str, port: int) -> None:
    """Everything one rank computes, saved to ``out/rank<rank>.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    results: dict[str, Any] = {}
    for family, policy in CASES:
        module = make_classifier(family, policy)
        reference = copy.deepcopy(module)
        shard_task(module, mesh)
        world = ShardedProcessGroup(device=torch.device("cpu"))
        results[f"{family}-{policy}"] = released_gradients(module, collate(ROWS[rank]), world, sigma=0.0)[0]
        only_rank_0 = collate(ROWS[0] if rank == 0 else [])  # rank 1 runs placeholder passes only
        results[f"{family}-{policy}-empty-rank"] = released_gradients(
            _sharded_copy(reference, mesh), only_rank_0, world, sigma=0.0
        )[0]
        if rank == 0:
            union = collate(ROWS[0] + ROWS[1])
            results[f"{family}-{policy}-brute-force"] = brute_force_update(copy.deepcopy(reference), union)
            results[f"{family}-{policy}-reference"] = released_gradients(
                copy.deepcopy(reference), union, None, sigma=0.0
            )[0]
            results[f"{family}-{policy}-reference-rank0-only"] = released_gradients(
                reference, collate(ROWS[0]), None, sigma=0.0
            )[0]
    noise_module = make_classifier("gpt2", "tied")
    shard_task(noise_module, mesh)
    results["noise"] = released_gradients(
        noise_module, collate([]), ShardedProcessGroup(device=torch.device("cpu")), sigma=1.0, steps=NOISE_STEPS
    )
    again = make_classifier("gpt2", "tied")
    shard_task(again, mesh)  # a second run of the same setup, no seed: OS entropy again
    results["noise-again"] = released_gradients(
        again, collate([]), ShardedProcessGroup(device=torch.device("cpu")), sigma=1.0
    )[0]
    results["state-bytes"] = state_bytes_after_a_step(_sharded_copy(make_classifier("gpt2", "untied"), mesh), mesh)
    if rank == 0:
        results["state-bytes-whole"] = state_bytes_after_a_step(make_classifier("gpt2", "untied"), None)
    results["digests"] = sharded_and_whole_digests(mesh)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def sharded_and_whole_digests(mesh: Any) -> tuple[str, str]:
    """The content digest of a tiny Llama's weights sharded by FSDP2 over the ranks, and of the same weights whole."""
    module = make_classifier("llama", "untied")
    with torch.no_grad():  # rows of mixed canonical dtypes: most bfloat16-exact, one row per tensor not
        for param in module.parameters():
            param.copy_(param.bfloat16().double())
            param.view(param.shape[0] if param.dim() else 1, -1)[-1] += 1e-9
    whole = content_digest(module.state_dict())
    shard_task(module, mesh)
    assert any(isinstance(value, DTensor) for value in module.state_dict().values())
    return content_digest(module.state_dict(), gather=ShardedProcessGroup(device=torch.device("cpu")).gather), whole


def _sharded_copy(module: CausalLMClassifier, mesh: Any) -> CausalLMClassifier:
    copied = copy.deepcopy(module)
    shard_task(copied, mesh)
    return copied


def brute_force_update(module: CausalLMClassifier, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Σ_i min(1, C/‖g_i‖) g_i / B from one backward pass per example (B = qN = 4), σ = 0."""
    summed = clipped_sum(per_example_gradients(module, module.per_example_loss, batch), CLIP)
    return {name: grad / 4 for name, grad in summed.items()}


def state_bytes_after_a_step(module: CausalLMClassifier, mesh: Any) -> int:
    """This rank's bytes of parameters, gradients and AdamW state after one DP step (local shards when sharded)."""
    world = ShardedProcessGroup(device=torch.device("cpu")) if mesh is not None else None
    dpsgd = started_dpsgd(module, world, sigma=0.0)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    dpsgd.clip(module.per_example_loss, collate(ROWS[dist.get_rank()] if mesh is not None else ROWS[0] + ROWS[1]))
    dpsgd.release()
    optimizer.step()
    buffer = dpsgd.gradient_buffer.flat
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    outside = [g for g in grads if _local(g).untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()]
    optimizer_state = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
    return _bytes([*module.parameters(), buffer, *outside, *optimizer_state])


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
