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
from tests.helpers.commands import checkpoint_of, lm_args, lora_on
from tests.helpers.executable import run_dplit, run_dplit_in_process

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


def trained_weights(run: Path, *extra: str, in_process: bool = False) -> dict[str, torch.Tensor]:
    """The weights after one σ = 0 step of the LM quickstart with ``extra`` (a run in ``run``)."""
    done = (run_dplit_in_process if in_process else run_dplit)("lm", "fit", *lm_args(run, *EXACT, *extra))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ledger = json.loads(next(run.rglob(LEDGER_FILE)).read_text())
    assert history_steps(ledger["accountant"]["history"]) == 1
    assert ("packing" in ledger) == ("true" in extra)
    return torch.load(checkpoint_of(run), weights_only=True)["state_dict"]


def assert_same_weights(packed: dict[str, torch.Tensor], padded: dict[str, torch.Tensor]) -> None:
    """Equal weights to float32 tolerance (one AdamW step of lr 0.01 from the same initial weights)."""
    assert packed.keys() == padded.keys()
    for name, value in padded.items():
        torch.testing.assert_close(packed[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["DPStrategy", "ShardedDPStrategy"])
def test_a_two_process_packed_run_makes_the_padded_runs_first_update(tmp_path: Path, strategy: str) -> None:
    """Two gloo processes, each packing its own sampled documents: the padded DPStrategy run's first update."""
    chosen = ["--trainer.strategy.class_path", f"dplit.strategy.{strategy}"]
    padded = trained_weights(tmp_path / "padded", *TWO_PROCESSES)
    packed = trained_weights(tmp_path / "packed", *TWO_PROCESSES, *chosen, *PACKED)
    assert_same_weights(packed, padded)


def test_a_packed_lora_run_makes_the_padded_runs_first_update(tmp_path: Path) -> None:
    """LoRA on the attention projections (base frozen): packed and padded reach the same adapter weights."""
    lora = ["--model.peft", lora_on("c_attn")]
    padded = trained_weights(tmp_path / "padded", *lora, in_process=True)
    packed = trained_weights(tmp_path / "packed", *lora, *PACKED, in_process=True)
    assert_same_weights(packed, padded)
    other = trained_weights(tmp_path / "other", *lora, *PACKED, "--trainer.strategy.init_args.seed", "1", in_process=True)
    with pytest.raises(AssertionError):  # other documents sampled: the comparison tells a different update apart
        assert_same_weights(other, padded)
