"""Packed rows under the other strategies and adapters: the same first update as the padded run at σ = 0.

Same seed, same documents: Poisson sampling does not see the collate function, so a packed run clips exactly the
documents the padded run clips, each as its own unit; at σ = 0 the released update is the same up to float32
rounding (two gloo processes under DPStrategy and ShardedDPStrategy; LoRA on one process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dplit.privacy.ledger import LEDGER_FILE, history_steps
from tests.helpers.commands import lm_args, lora_on
from tests.helpers.executable import run_dplit, run_dplit_in_process, user_environment
from tests.helpers.paths import REPOSITORY

pytestmark = pytest.mark.slow

EXACT = [
    "--trainer.strategy.init_args.seed", "0", "--trainer.strategy.init_args.noise_multiplier", "0",
    "--trainer.strategy.init_args.target_epsilon", "null", "--trainer.max_steps", "1",
    "--trainer.limit_val_batches", "0", "--model.sample_prompts", "[]", "--model.warmup_steps", "0",
    "--model.lr_schedule", "constant",
]  # fmt: skip
TWO_PROCESSES = [
    "--trainer.devices", "2", "--trainer.accelerator", "cpu",
    "--trainer.strategy.init_args.process_group_backend", "gloo",
]  # fmt: skip
PACKED = ["--data.packing", "true"]


def released_gradient(run: Path, *extra: str, in_process: bool = False) -> dict[str, torch.Tensor]:
    """The first released gradient of a σ = 0 run of the LM quickstart with ``extra`` (one step, in ``run``)."""
    run.mkdir(parents=True)
    saver = json.dumps({"class_path": "tests.helpers.released_gradients.FirstReleasedGradient",
                        "init_args": {"path": str(run / "gradient.pt")}})  # fmt: skip
    args = lm_args(run, *EXACT, *extra, "--trainer.callbacks+", saver)
    environment = {**user_environment(), "PYTHONPATH": str(REPOSITORY)}
    done = (run_dplit_in_process if in_process else run_dplit)("lm", "fit", *args, environment=environment)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ledger = json.loads(next(run.rglob(LEDGER_FILE)).read_text())
    assert history_steps(ledger["accountant"]["history"]) == 1
    assert ("packing" in ledger) == ("true" in extra)
    return torch.load(run / "gradient.pt", weights_only=True)


def assert_same_update(packed: dict[str, torch.Tensor], padded: dict[str, torch.Tensor]) -> None:
    """Equal released gradients to float32 tolerance (each within 1e-5 of the largest gradient entry), not all zero."""
    assert packed.keys() == padded.keys()
    scale = max(float(grad.abs().max()) for grad in padded.values())
    assert scale > 0
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_two_process_packed_runs_make_the_padded_runs_first_update(tmp_path: Path) -> None:
    """Two gloo processes, each packing its own sampled documents: the padded DPStrategy run's first update.

    Under DPStrategy and under ShardedDPStrategy (FSDP2 shards, the packed forward gathering them).
    """
    padded = released_gradient(tmp_path / "padded", *TWO_PROCESSES)
    for strategy in ("DPStrategy", "ShardedDPStrategy"):
        chosen = ["--trainer.strategy.class_path", f"dplit.strategy.{strategy}"]
        packed = released_gradient(tmp_path / strategy, *TWO_PROCESSES, *chosen, *PACKED)
        assert_same_update(packed, padded)


def test_a_packed_lora_run_makes_the_padded_runs_first_update(tmp_path: Path) -> None:
    """LoRA on the attention projections (base frozen): packed and padded release the same adapter gradients."""
    lora = ["--model.peft", lora_on("c_attn")]
    padded = released_gradient(tmp_path / "padded", *lora, in_process=True)
    packed = released_gradient(tmp_path / "packed", *lora, *PACKED, in_process=True)
    assert_same_update(packed, padded)
    other = released_gradient(
        tmp_path / "other", *lora, *PACKED, "--trainer.strategy.init_args.seed", "1", in_process=True
    )
    with pytest.raises(AssertionError):  # other documents sampled: the comparison tells a different update apart
        assert_same_update(other, padded)
