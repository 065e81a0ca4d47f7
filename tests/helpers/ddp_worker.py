"""One rank of a two-process DPStrategy run on CPU (gloo), launched by tests/test_ddp.py through torchrun.

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/helpers/ddp_worker.py SPEC OUT`` runs every
scenario of the JSON list SPEC in order, in the same two processes, and saves what each rank saw to
``OUT/<name>.rank<r>.pt``: parameters before the fit, at train start, before every step and after the fit;
the gradient every step applied; the dataset indices of every logical batch; the final optimizer state;
the privacy ledger; the collectives issued inside every training step; the logged metrics.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

import dplit.privacy.ledger as ledger_module
from dplit.audit.strategy import CanaryDPStrategy
from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.strategy import DPStrategy
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, PadCollate, RandomTokens

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "barrier")
TRAIN_SIZE, BATCH_SIZE = 64, 16


def build_model(policy: str, seed: int, *, checkpointing: bool = False) -> GPT2Classifier:
    """The tiny float64 classifier, initialised from ``seed`` (``checkpointing``: blocks recomputed in backward)."""
    torch.manual_seed(seed)
    embeddings = TiedEmbeddings() if policy == "tied" else UntiedEmbeddings()
    model = GPT2Classifier(
        config=TINY_GPT2,
        vocab_size=VOCAB,
        label_word_ids=LABEL_WORDS,
        embeddings=embeddings,
        gradient_checkpointing=checkpointing,
    )
    return model.double()


class IndexedTokens(Dataset):
    """``RandomTokens`` whose examples also carry their dataset index."""

    def __init__(self, size: int, seed: int) -> None:
        self._tokens = RandomTokens(size, seed=seed)

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: int) -> tuple[Tensor, int, int]:
        return (*self._tokens[index], index)


def collate(items: list[tuple[Tensor, int, int]]) -> dict[str, Tensor]:
    """Right-padded batch with an ``index`` field (the dataset index of every row)."""
    batch = PadCollate()([(ids, label) for ids, label, _ in items])
    batch["index"] = torch.tensor([index for _, _, index in items], dtype=torch.long)
    return batch


class IndexedTokenData(L.LightningDataModule):
    """64 training and 32 validation random-token examples; ``batch_size`` 16 (the global logical batch).

    ``train_seed`` draws the training rows (a rank-dependent seed stands for an unseeded random split).
    """

    def __init__(self, train_seed: int = 0) -> None:
        super().__init__()
        self.train_set, self.val_set = IndexedTokens(TRAIN_SIZE, seed=train_seed), IndexedTokens(32, seed=1)

    def train_dataloader(self) -> DataLoader:
        """The training rows, shuffled, in batches of ``BATCH_SIZE`` (the strategy swaps in Poisson sampling)."""
        return DataLoader(self.train_set, batch_size=BATCH_SIZE, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader:
        """The validation rows in batches of 8."""
        return DataLoader(self.val_set, batch_size=8, collate_fn=collate)


class CollectiveCounter:
    """Counts the torch.distributed collectives called while ``open`` (patched into the module once)."""

    def __init__(self) -> None:
        self.open = False
        self.counts: Counter[str] = Counter()
        for name in COLLECTIVES:
            setattr(dist, name, self._counting(name, getattr(dist, name)))

    def _counting(self, name: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.open:
                self.counts[name] += 1
            return function(*args, **kwargs)

        return counted


class Recorder(Callback):
    """Keeps parameters at train start and before every step, gradients of every step, batch indices, collectives."""

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter = counter
        self.at_train_start: dict[str, Tensor] = {}
        self.before_step: list[dict[str, Tensor]] = []
        self.grads: list[dict[str, Tensor]] = []
        self.batches: list[list[int]] = []
        self.collectives: list[dict[str, int]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Keep the parameters as training starts."""
        self.at_train_start = _state(pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        """Keep the parameters before the step and the batch's dataset indices; start counting collectives."""
        self.before_step.append(_state(pl_module))
        self.batches.append(batch["index"].tolist())
        self.counter.counts.clear()
        self.counter.open = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """Stop counting collectives; keep the step's counts and gradients."""
        self.counter.open = False
        self.collectives.append(dict(self.counter.counts))
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def run(scenario: dict[str, Any], out: Path, counter: CollectiveCounter) -> None:
    """Fit one scenario on this rank and save what it saw."""
    rank, name = int(os.environ["RANK"]), scenario["name"]
    policy, checkpointing = scenario.get("policy", "untied"), scenario.get("checkpointing", False)
    model = build_model(policy, seed=100 + rank, checkpointing=checkpointing)  # ranks start from different weights
    initial = _state(model)
    audit = {"canaries": scenario["canaries"], "canary_seed": 0} if scenario.get("canaries") else {}
    strategy = (CanaryDPStrategy if audit else DPStrategy)(
        **audit,
        accelerator="cpu",
        process_group_backend="gloo",
        timeout=timedelta(seconds=120),  # a rank left waiting on a collective fails instead of hanging
        max_grad_norm=scenario.get("max_grad_norm", 0.1),
        noise_multiplier=scenario.get("noise_multiplier"),
        target_epsilon=scenario.get("target_epsilon"),
        clipping=scenario.get("clipping", "per_example"),
        max_physical_batch_size=scenario.get("max_physical_batch_size", 3),
        seed=0,
    )
    ledger_writes = _count_calls(ledger_module, "write_ledger")  # the file, not the no-op call on other ranks
    recorder = Recorder(counter)
    callbacks: list[Callback] = [recorder]
    if scenario.get("checkpoints"):
        callbacks.append(ModelCheckpoint(dirpath=out / name / "ckpt", save_last=True, every_n_train_steps=1))
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        precision="64-true",
        max_steps=scenario["max_steps"],
        default_root_dir=out / name,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=scenario.get("val_batches", 0),
        val_check_interval=scenario.get("val_check_interval"),
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    resume = scenario.get("resume")
    data = IndexedTokenData(train_seed=rank if scenario.get("rows_differ_by_rank") else 0)
    try:
        trainer.fit(model, data, ckpt_path=str(out / resume / "ckpt" / "last.ckpt") if resume else None)
    except ValueError as error:
        if not scenario.get("expect_error"):
            raise
        torch.save({"error": str(error), "steps": trainer.global_step}, out / f"{name}.rank{rank}.pt")
        return
    metrics = {key: value.item() for key, value in trainer.callback_metrics.items()}
    torch.save(
        {
            "initial": initial,
            "at_train_start": recorder.at_train_start,
            "before_step": recorder.before_step,
            "final": _state(model),
            "grads": recorder.grads,
            "optimizer": trainer.optimizers[0].state_dict(),
            "batches": recorder.batches,
            "collectives": recorder.collectives,
            "metrics": metrics,
            "epsilon": strategy.accountant.epsilon(),
            "ledger": strategy.accountant.state_dict(),
            "noise_multiplier": strategy.noise_multiplier,
            "sample_rate": strategy.dpsgd.sample_rate,
            "expected_batch_size": strategy.dpsgd.expected_batch_size,
            "global_step": trainer.global_step,
            "ledger_writes": ledger_writes["calls"],
            "log_dir": trainer.log_dir,
            "wrapped": type(strategy.model).__name__,
            "world_size": trainer.world_size,
            "canaries": _canaries(strategy) if audit else None,
        },
        out / f"{name}.rank{rank}.pt",
    )


def _canaries(strategy: CanaryDPStrategy) -> dict[str, Tensor]:
    canaries = strategy.canaries
    return {"coordinates": canaries.coordinates, "included": canaries.included, "scores": canaries.scores,
            "reading_sums": canaries.reading_sums}  # fmt: skip


def _state(module: torch.nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _count_calls(obj: object, method: str) -> dict[str, int]:
    calls = {"calls": 0}
    original = getattr(obj, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["calls"] += 1
        return original(*args, **kwargs)

    setattr(obj, method, counted)
    return calls


def main() -> None:
    """Run every scenario of the spec file (argv[1]) and save the results under argv[2]."""
    scenarios, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    counter = CollectiveCounter()
    for scenario in scenarios:
        run(scenario, out, counter)
    if dist.is_initialized():  # release gloo before interpreter exit, as torch asks, not in its destructors
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
