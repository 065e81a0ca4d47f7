"""``dplit dpo`` under ShardedDPStrategy: two gloo processes on FSDP2, the reference sharded with the policy (issue 53).

The frozen reference copy is sharded as the task is; with LoRA the reference is the sharded backbone with its adapters
off. A rank with fewer micro-batches runs its placeholder row through both passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dplit.cli.lightning_cli import run_dpo_cli
from dplit.privacy.ledger import LEDGER_FILE, history_steps
from dplit.release.guarantee import GUARANTEE_FILE
from dplit.tasks.preference import REFERENCE_KEY
from tests.helpers.commands import checkpoint_of, dpo_args, lora_on
from tests.helpers.executable import run_dplit, run_dplit_in_process

pytestmark = pytest.mark.slow

TWO_PROCESSES = [
    "--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.strategy.init_args.process_group_backend",
    "gloo", "--trainer.strategy.init_args.target_epsilon", "null", "--trainer.limit_train_batches", "2",
    "--trainer.limit_val_batches", "1", "--trainer.max_epochs", "1",
]  # fmt: skip
SHARDED = ["--trainer.strategy.class_path", "dplit.strategy.ShardedDPStrategy"]


def ledger_of(run: Path) -> dict:
    return json.loads(max(run.rglob(LEDGER_FILE), key=lambda path: path.stat().st_mtime).read_text())


def test_with_one_seed_and_no_noise_sharded_and_data_parallel_dpo_reach_the_same_weights(tmp_path: Path) -> None:
    """The same Poisson pairs on two ranks, the same clipped sums.

    Sharding the policy and its frozen reference copy changes nothing but float32 rounding. With one expected pair
    a step and seed 0, the first step gives one rank a pair and the other none: that rank runs a placeholder through
    both passes (seen with a print in ``DPSGD.clip`` on 2026-12-07; a placeholder laid out as two rows failed there).
    """
    exact = ["--trainer.strategy.init_args.seed", "0", "--trainer.strategy.init_args.noise_multiplier", "0",
             "--data.batch_size", "1"]  # fmt: skip
    weights, digests = {}, {}
    for strategy in ("DPStrategy", "ShardedDPStrategy"):
        run = tmp_path / strategy
        strategy_args = ["--trainer.strategy.class_path", f"dplit.strategy.{strategy}"]
        done = run_dplit("dpo", "fit", *dpo_args(run, *TWO_PROCESSES, *exact, *strategy_args))
        assert done.returncode == 0, done.stderr[-3000:]
        assert history_steps(ledger_of(run)["accountant"]["history"]) == 2
        checkpoint = torch.load(checkpoint_of(run), weights_only=True)
        weights[strategy], digests[strategy] = checkpoint["state_dict"], checkpoint[REFERENCE_KEY]
    assert digests["ShardedDPStrategy"] == digests["DPStrategy"]  # the same reference, hashed whole or in shards
    sharded, replicated = weights["ShardedDPStrategy"], weights["DPStrategy"]
    assert sharded.keys() == replicated.keys()
    for name, value in replicated.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_sharded_lora_dpo_fit_validates_and_exports_on_one_process(tmp_path: Path) -> None:
    lora = ["--model.peft", lora_on("c_attn")]
    sigma = ["--trainer.strategy.init_args.noise_multiplier", "1"]
    done = run_dplit("dpo", "fit", *dpo_args(tmp_path, *TWO_PROCESSES, *SHARDED, *sigma, *lora))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "per preference pair after 2 DP steps" in done.stdout
    ledger = ledger_of(tmp_path)
    assert ledger["privacy_unit"] == "pair" and history_steps(ledger["accountant"]["history"]) == 2
    checkpoint = checkpoint_of(tmp_path)
    assert REFERENCE_KEY in torch.load(checkpoint, weights_only=True)
    alone = run_dpo_cli(["validate", *dpo_args(tmp_path / "again", *lora), "--ckpt_path", str(checkpoint)])
    assert "val/reward_accuracy" in alone.trainer.callback_metrics  # the reference digest matched, unsharded
    out = run_dplit_in_process("export", "--ckpt_path", str(checkpoint), "--output_dir", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "out" / GUARANTEE_FILE).read_text())["protected_unit"] == "pair"
