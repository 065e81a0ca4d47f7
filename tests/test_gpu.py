"""CUDA-only checks (``pytest -m gpu``), skipped (saying why) where torch sees no CUDA device.

bf16-mixed ghost clipping against the fp32 reference engine, DPStrategy on one GPU with NCCL, and CUDA peak-memory
logging. ``bash bench/gpu.sh`` runs them on a GPU
machine.

bf16 keeps 8 bits of mantissa (relative spacing 2^-8 ≈ 4e-3), and autocast runs the forward and the output gradients
in it while the engine forms norms and clipped sums in float32: per-example norms and clipped sums are compared with
the float32 reference to 2% (bf16 autocast on a CPU gives 0.1-0.3% on these models), the float32 ghost engine on
CUDA to 1e-4.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.callbacks import ResourceMonitor
from dplit.privacy.clipping import GhostEngine, PerExampleEngine
from dplit.privacy.clipping.engine import Batch, ClippingEngine, ClipStats
from dplit.strategy import DPStrategy
from dplit.tasks.base import CausalLMModule
from dplit.tasks.classifier import CausalLMClassifier, GPT2Classifier
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers import tiny
from tests.helpers.families import FAMILIES, instruction_batch
from tests.helpers.oracles import TINY as TINY_GPT2_64
from tests.helpers.oracles import assert_close, padded_batch

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False on this machine"),
]

VOCAB = 50  # test_ghost's vocabulary: padded_batch's and instruction_batch's token ids are below it
LABEL_WORDS = [3, 7]
BACKBONES: dict[str, dict[str, Any]] = {"gpt2": TINY_GPT2_64, "llama": FAMILIES["llama"]}
TASKS = ("classify", "lm")
NORM_RTOL_BF16 = 2e-2
"""bf16 autocast vs float32: largest relative error of a per-example norm."""
SUM_RTOL_BF16 = 2e-2
"""bf16 autocast vs float32: ‖clipped sum − reference‖ / ‖reference‖ over all parameters together."""
PARAM_RTOL_BF16 = 5e-2
"""bf16 autocast vs float32, per parameter: error relative to the parameter's reference sum (plus 1e-3 of the whole)."""
BOUND_RTOL = 1e-3
"""A clipped example's contribution may exceed C by this share (the engine forms norm and sum from the same factors)."""
FP32_RTOL = 1e-4
"""float32 ghost on CUDA vs the float32 per-example engine (relative to the largest entry)."""
STEPS = 4


def tiny_model(family: str, policy: str, task: str, device: torch.device) -> CausalLMModule:
    """A float32 random ``family`` backbone (2 layers, width 16) as a label-word classifier or a next-token LM."""
    torch.manual_seed(0)
    embeddings = TiedEmbeddings() if policy == "tied" else UntiedEmbeddings()
    config = BACKBONES[family]
    if task == "classify":
        model: CausalLMModule = CausalLMClassifier(
            config=config, vocab_size=VOCAB, embeddings=embeddings, label_word_ids=LABEL_WORDS
        )
    else:
        model = CausalLanguageModel(config=config, vocab_size=VOCAB, embeddings=embeddings, sample_prompts=[])
    return model.float().to(device).train()


def tiny_batch(task: str, device: torch.device) -> dict[str, Tensor]:
    """Padded examples on either side of the Gram-or-materialise break-even (lengths 1 to 26)."""
    if task == "classify":
        batch = padded_batch([5, 12, 26, 3, 9, 1], "left", seed=2)
    else:
        batch = instruction_batch("right")
    return {key: value.to(device) for key, value in batch.items()}


def clipped(
    engine: ClippingEngine, model: CausalLMModule, batch: Batch, *, bf16: bool, scale: float = 1.0
) -> tuple[ClipStats, Tensor]:
    """One accumulate from empty grads (under bf16 autocast when ``bf16``): stats and the flat clipped sum [P]."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = None
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=bf16):
        stats = engine.accumulate(lambda b: scale * model.per_example_loss(b), batch)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten() for p in params])
    return stats, flat


def per_parameter(model: CausalLMModule, flat: Tensor) -> dict[str, Tensor]:
    """A flat vector over the trainable parameters, split back by parameter name."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return dict(zip([n for n, _ in named], flat.split([p.numel() for _, p in named]), strict=True))


def reference(model: CausalLMModule, batch: Batch) -> tuple[Tensor, float, Tensor]:
    """float32 per-example engine: every example's norm, a C that clips about half of them, the clipped sum."""
    norms = clipped(PerExampleEngine(model, max_grad_norm=1e9), model, batch, bf16=False)[0].norms
    clip = float(norms.median())
    _, expected = clipped(PerExampleEngine(model, max_grad_norm=clip), model, batch, bf16=False)
    return norms.float(), clip, expected


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖."""
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_bf16_ghost_on_cuda_matches_float32_reference(family: str, policy: str, task: str) -> None:
    device = torch.device("cuda")
    model, batch = tiny_model(family, policy, task, device), tiny_batch(task, device)
    norms, clip, expected = reference(model, batch)
    assert bool(torch.isfinite(norms).all()) and bool((norms > 0).all())

    stats, fp32 = clipped(GhostEngine(model, max_grad_norm=clip), model, batch, bf16=False)
    assert_close(stats.norms.float(), norms, rtol=FP32_RTOL)
    assert_close(fp32, expected, rtol=FP32_RTOL)

    stats, bf16 = clipped(GhostEngine(model, max_grad_norm=clip), model, batch, bf16=True)
    assert torch.finfo(stats.norms.dtype).bits >= 32  # norms and sums are formed in float32 or wider, not in bf16
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    worst = float(((stats.norms - norms).abs() / norms).max())
    assert worst <= NORM_RTOL_BF16, f"per-example norms off by up to {worst:.3g} of the fp32 reference"
    assert relative_error(bf16, expected) <= SUM_RTOL_BF16
    whole = expected.norm()
    for name, ref in per_parameter(model, expected).items():
        error = (per_parameter(model, bf16)[name] - ref).norm()
        assert error <= PARAM_RTOL_BF16 * ref.norm() + 1e-3 * whole, name


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_bf16_ghost_on_cuda_bounds_every_example_by_c(family: str, policy: str) -> None:
    device = torch.device("cuda")
    model, batch = tiny_model(family, policy, "lm", device), tiny_batch("lm", device)
    clip = 1e-2
    engine = GhostEngine(model, max_grad_norm=clip)
    for i in range(batch["input_ids"].shape[0]):
        example = {key: value[i : i + 1] for key, value in batch.items()}
        stats, contribution = clipped(engine, model, example, bf16=True, scale=1e3)  # every example clipped
        assert float(stats.norms[0]) > 10 * clip
        assert float(contribution.norm()) <= clip * (1 + BOUND_RTOL)
        assert float(contribution.norm()) >= clip * (1 - NORM_RTOL_BF16)  # clipped to C, not far below it


class CudaProbe(Callback):
    """Records, after every training batch, the device, the process group's backend and CUDA max allocated (MiB)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()
        self.backends: set[str] = set()
        self.max_allocated_mb: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.devices.add(pl_module.device.type)
        self.backends.add(str(dist.get_backend()) if dist.is_initialized() else "none")
        self.max_allocated_mb.append(torch.cuda.max_memory_allocated(pl_module.device) / 2**20)


@dataclass
class GpuRun:
    """What a DPStrategy fit on one GPU left behind."""

    trainer: L.Trainer
    strategy: DPStrategy
    model: GPT2Classifier
    initial: dict[str, Tensor]
    probe: CudaProbe
    metrics: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> GpuRun:
    """A few bf16-mixed DP-SGD steps (ghost clipping, ε = 8, tied) of the tiny GPT-2 on one GPU, NCCL process group."""
    torch.manual_seed(0)
    model = GPT2Classifier(
        config=tiny.TINY_GPT2, vocab_size=tiny.VOCAB, label_word_ids=tiny.LABEL_WORDS, embeddings=TiedEmbeddings()
    )
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    strategy = DPStrategy(
        max_grad_norm=1.0, target_epsilon=8.0, max_physical_batch_size=8, process_group_backend="nccl"
    )
    probe = CudaProbe()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=STEPS,
        default_root_dir=tmp_path_factory.mktemp("gpu-fit"),
        callbacks=[ResourceMonitor(), probe],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(model, tiny.RandomTokenData(size=64, batch_size=16))
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    yield GpuRun(trainer, strategy, model, initial, probe, metrics)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_dp_strategy_trains_on_one_gpu_with_nccl(gpu_run: GpuRun) -> None:
    trainer, strategy = gpu_run.trainer, gpu_run.strategy
    assert gpu_run.probe.devices == {"cuda"} and gpu_run.probe.backends == {"nccl"}
    assert strategy.root_device.type == "cuda"
    assert trainer.global_step == STEPS and strategy.accountant.steps == STEPS
    epsilon = gpu_run.metrics["privacy/epsilon"]
    assert 7.0 < epsilon <= 8.0 and epsilon == pytest.approx(strategy.accountant.epsilon(), rel=1e-6)
    assert math.isfinite(gpu_run.metrics["train/loss"]) and 0.0 <= gpu_run.metrics["dp/clip_fraction"] <= 1.0
    ledger = json.loads((Path(trainer.log_dir) / "privacy_ledger.json").read_text())
    assert sum(int(count) for _, _, count in ledger["accountant"]["history"]) == STEPS
    assert ledger["epsilon"] == pytest.approx(epsilon, rel=1e-6)
    state = gpu_run.model.state_dict()
    assert all(bool(torch.isfinite(value).all()) for value in state.values() if value.is_floating_point())
    assert any(not torch.equal(state[name].cpu(), before) for name, before in gpu_run.initial.items())


def test_memory_monitor_logs_cuda_peak_memory(gpu_run: GpuRun) -> None:
    logged = gpu_run.metrics["memory/peak_mb"]
    parameters_mb = sum(p.numel() * p.element_size() for p in gpu_run.model.parameters()) / 2**20
    assert logged > parameters_mb > 0  # CUDA memory holds at least the weights
    # the monitor's value is CUDA max allocated at the last step's end (the probe reads it right after), not RSS
    assert logged == pytest.approx(gpu_run.probe.max_allocated_mb[-1], rel=1e-2)


def test_a_cuda_generator_takes_the_seeds_high_bits_too() -> None:
    """Philox: the seed hashed into its 64-bit key and its counter offset, so a difference in any bit shows."""
    from dplit.privacy.seeds import seeded_generator

    device = torch.device("cuda")
    draws = [torch.rand(8, device=device, generator=seeded_generator(7 + extra, device=device)) for extra in (0, 1 << 200)]
    again = torch.rand(8, device=device, generator=seeded_generator(7, device=device))
    assert not torch.equal(draws[0], draws[1]) and torch.equal(draws[0], again)
