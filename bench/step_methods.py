"""The training step each benchmarked method runs, as a closure over a fixed batch (see :mod:`bench.step`).

``dplit_ghost`` / ``dplit_per_example`` run the shipped :class:`dplit.privacy.dpsgd.DPSGD` (what DPStrategy
runs); ``opacus_*`` run opacus' PrivacyEngine; ``non_private`` a plain AdamW step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from bench.models import adapters


def autocast(args: argparse.Namespace, device: Any) -> Callable[[], Any]:
    """A factory of the forward's precision context: bf16 autocast for ``bf16-mixed``, else a no-op."""
    import torch

    enabled = getattr(args, "precision", "32-true") == "bf16-mixed"
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def shipped_dp_step(
    args: argparse.Namespace, model: Any, batch: dict[str, Any], mixed: Callable[[], Any]
) -> Callable[[], None]:
    """One step of dplit's shipped DP-SGD object (what DPStrategy runs): clip, noise, ÷ B, account; then AdamW.

    Its Poisson loader is built on 100·B placeholder rows (q = 0.01, the accountant's usual regime) only for the
    rate; every step clips the benchmark's fixed batch in one micro-batch. The plan is warm-up + timed steps, so ε is
    refreshed at the first (warm-up) and the last step, as in a real run (see ``dplit.privacy.dpsgd``).
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dplit.privacy.dpsgd import DPSGD
    from dplit.privacy.settings import DPSGDSettings

    clipping = "ghost" if adapters(args.method)[0] == "dplit_ghost" else "per_example"
    settings = DPSGDSettings(
        max_grad_norm=args.max_grad_norm, noise_multiplier=args.sigma, clipping=clipping, tied_norm="exact",
        max_physical_batch_size=batch["input_ids"].shape[0], self_check=False,  # one micro-batch (pairs: 2B rows)
    )  # fmt: skip
    dpsgd = DPSGD(model, settings, history=model.privacy_history)
    dpsgd.sample(DataLoader(TensorDataset(torch.arange(100 * args.batch_size)), batch_size=args.batch_size))
    dpsgd.start(planned_steps=args.warmup + args.steps)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def dp_step() -> None:
        with mixed():  # DPStrategy: the precision plugin's train_step_context around the clipping
            dpsgd.clip(model.per_example_loss, batch)
        dpsgd.release()
        optimizer.step()

    return dp_step


def non_private_step(model: Any, batch: dict[str, Any], optimizer: Any, mixed: Callable[[], Any]) -> Callable[[], None]:
    """A plain AdamW step on the batch's mean loss, the forward under ``mixed()`` (the non-private baseline)."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with mixed():
            loss = model.per_example_loss(batch).mean()
        loss.backward()
        optimizer.step()

    return step


def build_step(args: argparse.Namespace, model: Any, batch: dict[str, Any], device: Any) -> Callable[[], None]:
    """The closure running one full training step of ``args.method``.

    With ``--precision bf16-mixed`` the forward and loss run under bf16 autocast and backward outside it (as
    Lightning's precision plugin does); the dplit engines run their whole pass under it, as DPStrategy does.
    """
    import torch
    import torch.nn.functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    mixed = autocast(args, device)
    method = adapters(args.method)[0]
    if method == "non_private":
        return non_private_step(model, batch, torch.optim.AdamW(params, lr=args.lr), mixed)

    if method in ("dplit_ghost", "dplit_per_example"):
        return shipped_dp_step(args, model, batch, mixed)

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    mode = method.removeprefix("opacus_")
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    dataset = TensorDataset(batch["input_ids"], batch["attention_mask"], batch["labels"])
    loader = DataLoader(dataset, batch_size=args.batch_size)  # only tells opacus the (expected) batch size
    privacy = PrivacyEngine()
    common = dict(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=args.sigma,
        max_grad_norm=args.max_grad_norm,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "hooks":
        dp_model, dp_optimizer, _ = privacy.make_private(**common)

        def step() -> None:
            dp_optimizer.zero_grad(set_to_none=True)
            with mixed():
                logits = dp_model(batch["input_ids"], batch["attention_mask"])
                loss = F.cross_entropy(logits.float(), batch["labels"])
            loss.backward()
            dp_optimizer.step()

        return step

    dp_model, dp_optimizer, criterion, _ = privacy.make_private(**common, criterion=torch.nn.CrossEntropyLoss())

    def ghost_step() -> None:
        dp_optimizer.zero_grad(set_to_none=True)
        with mixed():
            logits = dp_model(batch["input_ids"], batch["attention_mask"])
            loss = criterion(logits.float(), batch["labels"])
        loss.backward()  # opacus' two backward passes
        dp_optimizer.step()

    return ghost_step
