"""DPStrategy: Lightning's DDP strategy with DP-SGD in place of backward and the optimizer step."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from dplit.privacy import GhostEngine, build_engine
from dplit.privacy.accountant import (
    DELTA_MAX,
    Mechanism,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    check_accountable,
    default_delta,
)
from dplit.privacy.engine import Batch, ClippingEngine, trainable_parameters
from dplit.privacy.fingerprint import IndexedRows, rows_fingerprint
from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.integrity import check_digests, record_digest
from dplit.privacy.ledger import CHECKPOINT_KEY, RunLedger, ledger_folders
from dplit.privacy.noise import NoiseSource
from dplit.privacy.sampling import poisson_loader
from dplit.privacy.self_check import check_ghost_norms
from dplit.privacy.training_state import StateWriteGuard, refuse_state_writing_modules
from dplit.privacy.warnings import PrivacyWarning

log = logging.getLogger(__name__)

INTERRUPT_CHECKPOINT = "interrupted.ckpt"
"""Saved in the run's ``checkpoints/`` folder, with the ledger, when training is interrupted or crashes."""
TESTED_PRECISIONS = ("32-true", "64-true", "bf16-mixed")
"""The precisions the DP path is tested with; others (``16-true``: fp16 weights overflow to NaN) are refused."""
NO_NOISE_WARNING = (
    "DPStrategy.noise_multiplier=0: NO NOISE is added, so this run is NOT differentially private (ε = ∞); "
    "clipping alone protects nothing"
)


class DPStrategy(DDPStrategy):
    """DP-SGD on one or many devices: per-example clipping, Poisson batches, noise once per logical batch.

    One Lightning optimizer step is one DP step: a Poisson logical batch (expected size = the loader's
    ``batch_size``, over all devices) is clipped in micro-batches of at most ``max_physical_batch_size``, the
    clipped sums are all-reduced once with N(0, σ²C²) noise added once (rank 0, see :mod:`dplit.privacy.noise`),
    divided by the expected batch size, and the optimizer steps. Under data parallelism there is no DDP wrapper:
    rank 0's weights are broadcast at setup and each rank samples its own shard at the global rate q, so ε does
    not depend on the number of devices. The ledger (:class:`~dplit.privacy.ledger.RunLedger`) is saved in every
    checkpoint and in ``privacy_ledger.json``.

    Args:
        max_grad_norm: the per-example clipping bound C.
        noise_multiplier: σ; give this or ``target_epsilon``, not both.
        target_epsilon: calibrate σ so the planned steps spend exactly this ε (and never spend more).
        target_delta: δ; default N^-1.1 for N training examples.
        accountant: ``"prv"`` (default) or ``"rdp"``.
        clipping: ``"ghost"`` (norms without per-example gradients, one backward) or ``"per_example"``
            (materialised per-example gradients, the exact reference).
        tied_norm: ``"exact"`` (cross term) or ``"bound"`` (‖G_1‖ + ‖G_2‖) for shared parameters (ghost only).
        max_physical_batch_size: largest micro-batch run through the model at once (per device).
        self_check: before the first DP step, compare the ghost engine's per-parameter norms of a few real
            examples with autograd's (one backward per example) and refuse, naming the parameter, on any
            disagreement (catches architectures whose layers break the norm rules' assumptions).
        seed: leave unset (default) for sampling and noise seeded from the operating system's entropy,
            independent of ``seed_everything``, never stored, and fresh after a resume. An explicit seed makes
            both streams reproducible and PREDICTABLE from the config (warns; the ledger records it): only for
            tests and debugging, never for a run that is released. Only rank 0 draws noise.
        allow_large_delta: accept δ ≥ 1/N (refused by default: a δ that large permits releasing whole
            examples); warns when used.
        private_diagnostics: log the diagnostics computed from the private batches without noise (default
            ``True``): ``train/loss``, ``dp/grad_norm``, ``dp/clip_fraction``, ``dp/dropped_examples``, and, through
            :class:`~dplit.callbacks.ResourceMonitor` and the GLUE datamodule, ``perf/samples_per_sec`` (the realised
            batch size), ``memory/peak_mb`` and the training split's longest prompt. None is covered by ε; set
            ``False`` when logs leave the trust boundary, and only ``privacy/*`` (public) is logged in training.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``process_group_backend``, ``start_method``, ...).
    """

    strategy_name = "dp"

    def __init__(
        self,
        *,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        accountant: Mechanism = "prv",
        clipping: Literal["ghost", "per_example"] = "ghost",
        tied_norm: Literal["exact", "bound"] = "exact",
        max_physical_batch_size: int = 32,
        self_check: bool = True,
        seed: int | None = None,
        allow_large_delta: bool = False,
        private_diagnostics: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_privacy_arguments(max_grad_norm, noise_multiplier, target_epsilon, target_delta)
        if max_physical_batch_size < 1:
            raise ValueError(f"DPStrategy.max_physical_batch_size must be ≥ 1, got {max_physical_batch_size}")
        if clipping not in ("ghost", "per_example"):
            raise ValueError(f"DPStrategy.clipping must be 'ghost' or 'per_example', got {clipping!r}")
        self._max_grad_norm = float(max_grad_norm)
        self._noise_multiplier = noise_multiplier
        self._target_epsilon = target_epsilon
        self._target_delta = target_delta
        self._mechanism: Mechanism = accountant
        self._clipping = clipping
        self._tied_norm = tied_norm
        self._max_physical_batch_size = max_physical_batch_size
        self._self_check_pending = self_check
        self._noise_source = NoiseSource(seed=seed)
        self._allow_large_delta = allow_large_delta
        self._private_diagnostics = bool(private_diagnostics)
        self._next_epsilon: float | None = None
        self._steps_at_start = 0
        self._interrupt_path: Path | None = None
        self._resumed_from: Path | None = None
        self._engine: ClippingEngine | None = None
        self._ledger = RunLedger()
        self._sample_rate: float | None = None
        self._dataset_size: int | None = None
        self._train_rows: IndexedRows | None = None
        self._buffer: GradientBuffer | None = None
        self._state_guard: StateWriteGuard | None = None

    @property
    def max_grad_norm(self) -> float:
        """The per-example clipping bound C."""
        return self._max_grad_norm

    @property
    def noise_multiplier(self) -> float | None:
        """σ in use (calibrated from ``target_epsilon`` once training starts)."""
        return self._noise_multiplier

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The run's privacy ledger (``None`` before training starts)."""
        return self._ledger.accountant

    @property
    def sample_rate(self) -> float | None:
        """The Poisson rate q = expected logical batch size / N."""
        return self._sample_rate

    @property
    def dataset_size(self) -> int | None:
        """N, the training examples Poisson sampling draws from (``None`` before training starts)."""
        return self._dataset_size

    @property
    def private_diagnostics(self) -> bool:
        """Whether diagnostics computed from the private batches without noise are logged (see the class doc)."""
        return self._private_diagnostics

    @property
    def privacy_history(self) -> PrivacyHistory:
        """The trained weights' privacy history (the module's: this run continues it)."""
        return self.lightning_module.privacy_history

    @property
    def expected_batch_size(self) -> float:
        """q·N: the global logical batch size the noisy sum is divided by."""
        assert self._sample_rate is not None and self._dataset_size is not None
        return self._sample_rate * self._dataset_size

    @override
    def setup(self, trainer: Trainer) -> None:
        _check_trainer(trainer, self.precision_plugin, planned=self._target_epsilon is not None)
        module = self.lightning_module
        if not callable(getattr(module, "per_example_loss", None)):
            raise TypeError(f"DPStrategy needs {type(module).__name__}.per_example_loss(batch) -> Tensor[B]")
        if not isinstance(getattr(module, "privacy_history", None), PrivacyHistory):
            raise TypeError(
                f"DPStrategy needs {type(module).__name__}.privacy_history, the weights' "
                "dplit.privacy.history.PrivacyHistory (subclass dplit.module.CausalLMModule, which keeps one)"
            )
        if not module.automatic_optimization:
            raise ValueError("DPStrategy replaces the optimizer step: use automatic optimization")
        super().setup(trainer)
        options = {"tied_norm": self._tied_norm} if self._clipping == "ghost" else {}
        self._engine = build_engine(self._clipping, module, max_grad_norm=self._max_grad_norm, **options)
        self._engine.check_parameters()
        refuse_state_writing_modules(module)
        self._state_guard = StateWriteGuard(module)

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper (its hooks would all-reduce unclipped gradients): only broadcast rank 0's weights.

        Lightning calls this before the optimizers are created, so they see the broadcast weights.
        """
        if self.world_size > 1:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=0)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Replace the training loader's sampler by Poisson sampling at rate q = batch_size / N."""
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        self._dataset_size, self._sample_rate = _size_and_rate(dataloader)
        self._train_rows = dataloader.dataset  # type: ignore[assignment]
        seed = self._noise_source.seed("sampling", steps=self._ledger.steps)  # the sampler mixes in the rank
        return poisson_loader(
            dataloader, sample_rate=self._sample_rate, num_replicas=self.world_size, rank=self.global_rank, seed=seed
        )

    @override
    def on_train_start(self) -> None:
        """Check δ and σ, calibrate σ for the planned steps, open (or continue) the ledger, stop if it is spent."""
        super().on_train_start()
        if self._sample_rate is None or self._dataset_size is None:
            raise RuntimeError("DPStrategy did not see the training dataloader")
        trainer = self.lightning_module.trainer
        _check_same_dataset_size(self._ledger.restored_dataset_size, self._dataset_size)
        delta = self._target_delta or default_delta(self._dataset_size)
        _check_delta(delta, self._dataset_size, allowed=self._allow_large_delta)
        planned = trainer.estimated_stepping_batches
        log_dir = trainer.log_dir  # a collective: every rank asks, rank 0 writes
        self._check_ranks_hold_the_same_rows()
        self._open_ledger(delta, planned, log_dir)
        self._buffer = GradientBuffer(list(trainable_parameters(self.lightning_module).values()), extra=1)
        rank_zero_info(
            f"DP-SGD: σ={self._noise_multiplier:.4f}, C={self._max_grad_norm}, q={self._sample_rate:.3g}, "
            f"expected batch {self.expected_batch_size:.1f}, δ={delta:.3g}, clipping={self._clipping}, "
            f"steps so far {self._ledger.steps}, noise {self._noise_source.describe()}"
        )
        if self._noise_multiplier == 0:
            rank_zero_warn(NO_NOISE_WARNING, category=PrivacyWarning)
        self._steps_at_start = self._ledger.steps
        self._interrupt_path = _checkpoint_folder(trainer, log_dir) / INTERRUPT_CHECKPOINT
        spent = self._ledger.accountant.epsilon() if self._steps_at_start else 0.0
        if self._steps_at_start:  # a resumed run always has a ledger file, even if it takes no step
            self._ledger.write(self._privacy_facts(), epsilon=spent)
        self._next_epsilon = self._epsilon_after(1)
        if self.broadcast(self._exceeds(self._next_epsilon)):  # rank 0's decision
            self._stop(spent, self._next_epsilon, steps_done=trainer.global_step)

    def _check_ranks_hold_the_same_rows(self) -> None:
        """Refuse, on every rank, data-parallel ranks whose training datasets differ (in N or in any row).

        Each rank samples its own shard of the indices, which is one Poisson sample only if the datasets agree.
        """
        if self.world_size == 1 or self._train_rows is None:
            return
        local = rows_fingerprint(self._train_rows)
        same = self.reduce_boolean_decision(local == self.broadcast(local), all=True)
        if not same:
            raise ValueError(
                "the training rows differ between data-parallel ranks (in number or content): each rank Poisson-samples "
                "its own shard of ONE dataset, so every rank must build the same rows in the same order; a random "
                "split, shuffle or subsample that is not seeded (or depends on the rank) is the likely cause: seed it"
            )

    def _open_ledger(self, delta: float, planned: float, log_dir: str | None) -> None:
        """Open the ledger on the weights' privacy history (rank 0's), calibrate σ, and open this run's segment.

        A resumed run also counts the steps this run's newest ledger file took after the checkpoint.
        """
        directory = log_dir if self.is_global_zero else None
        self._ledger.open(delta=delta, mechanism=self._mechanism, directory=directory)
        history = self.privacy_history
        if self._resumed_from is not None and self.is_global_zero:
            self._count_steps_after_checkpoint(log_dir)
        history.load_state_dict(self.broadcast(history.state_dict()))  # rank 0's weights were broadcast: its history
        accountant = self._ledger.accountant
        accountant.load_state_dict({**accountant.state_dict(), "history": history.accountant_history()})
        steps = int(planned) if math.isfinite(planned) else None
        check_accountable(
            mechanism=self._mechanism, sample_rate=self._sample_rate, steps=steps, delta=delta,
            noise_multiplier=self._noise_multiplier, target_epsilon=self._target_epsilon,
        )  # fmt: skip
        if self._target_epsilon is not None:  # a resumed run keeps the σ its whole plan was calibrated for
            restored = self._ledger.restored_noise_multiplier
            self._noise_multiplier = restored if restored is not None else self._calibrate(delta, planned)
        self._announce_history(resumed=self._resumed_from is not None)
        history.open_dp_segment(run_id=self._ledger.run_id, facts=self._segment_facts())

    def _count_steps_after_checkpoint(self, log_dir: str | None) -> None:
        """Add to the history the DP steps this run's ledger file took after the resumed checkpoint (rank 0)."""
        assert self._resumed_from is not None
        folders = ledger_folders(self._resumed_from, log_dir)
        if not self._ledger.has_record(folders):
            rank_zero_warn(
                f"DP-SGD: {self._resumed_from} belongs to run {self._ledger.run_id}, whose privacy_ledger.json is not "
                "beside it (was the checkpoint copied or moved?): steps that run took after this checkpoint, if any, "
                "cannot be counted, so ε covers only the history the checkpoint carries; resume it in its run folder",
                category=PrivacyWarning,
            )
            return
        found = self._ledger.steps_after_checkpoint(folders)
        if found is None:
            return
        extra, message = found
        note = "steps taken after the resumed checkpoint: their model was discarded, but they touched the data"
        facts = {**self._segment_facts(), "noise": "unknown", "noise_secure": True}
        self.privacy_history.record_dp_steps(extra, run_id=self._ledger.run_id, facts=facts, note=note)
        rank_zero_warn(message, category=PrivacyWarning)

    def _announce_history(self, *, resumed: bool) -> None:
        """Say in one line that this run continues the weights' privacy history, and warn if they are not DP."""
        history, accountant = self.privacy_history, self._ledger.accountant
        assert accountant is not None
        if history.dp_steps:
            bound = ", and DPStrategy.target_epsilon bounds the total" if self._target_epsilon is not None else ""
            origin = "a resumed checkpoint" if resumed else "earlier training"
            rank_zero_info(
                f"DP-SGD: these weights already took {history.dp_steps} DP steps ({origin}; ε={accountant.epsilon():.4g} "
                f"at δ={accountant.delta:.3g}): this run continues their privacy history{bound}"
            )
        reason = history.reason_not_private()
        if reason is not None:
            rank_zero_warn(
                f"DP-SGD: these weights are NOT differentially private, whatever this run does: {reason} (this run's "
                "steps are still accounted)",
                category=PrivacyWarning,
            )

    def _calibrate(self, delta: float, planned: float) -> float:
        if not math.isfinite(planned):
            raise ValueError("DPStrategy.target_epsilon needs a finite trainer.max_epochs or trainer.max_steps")
        assert self._target_epsilon is not None and self._sample_rate is not None and self._ledger.accountant
        target, rate, prior = self._target_epsilon, self._sample_rate, self.privacy_history.accountant_history()
        spent = self._ledger.accountant.epsilon()
        if prior and spent >= target:
            raise ValueError(
                f"DPStrategy.target_epsilon={target:g} is already spent: these weights' privacy history counts "
                f"{self.privacy_history.dp_steps} DP steps at ε={spent:.4g}; raise target_epsilon (it bounds the "
                "weights' total) or start from weights that never saw the data"
            )
        planned_here = int(planned) - self.lightning_module.trainer.global_step
        return calibrate_noise_multiplier(
            target_epsilon=target, delta=delta, sample_rate=rate, steps=max(1, planned_here),
            mechanism=self._mechanism, prior=prior,
        )  # fmt: skip

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Clip every example of the logical batch, micro-batch by micro-batch, into the gradient buffer."""
        batch: Batch = args[0]
        module = self.lightning_module
        assert self._engine is not None and self._buffer is not None and self._state_guard is not None
        self._buffer.attach()
        losses, norms = [], []
        self._state_guard.arm()
        with self.precision_plugin.train_step_context():
            self._check_engine(module, batch)
            for micro_batch in _split(batch, self._max_physical_batch_size):
                stats = self._engine.accumulate(module.per_example_loss, micro_batch)
                losses.append(stats.losses)
                norms.append(stats.norms)
        self._buffer.detach()
        self._state_guard.check()  # before any noise or step: nothing written from private data is released
        if not losses:
            return torch.zeros((), device=self.root_device)
        if not self._private_diagnostics:
            return torch.cat(losses).float().mean()
        return _log_clipping(module, torch.cat(losses), torch.cat(norms), self._max_grad_norm)

    def _check_engine(self, module: LightningModule, batch: Batch) -> None:
        """Once, on the first non-empty logical batch: the ghost engine's norms against autograd's (see ``self_check``)."""
        if not self._self_check_pending or not isinstance(self._engine, GhostEngine) or _size(batch) == 0:
            return
        examples = min(4, self._max_physical_batch_size)
        check_ghost_norms(self._engine, module, module.per_example_loss, batch, examples=examples)
        self._self_check_pending = False
        rank_zero_info("DP-SGD: ghost clipping self-check passed (per-parameter norms agree with autograd)")

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """No-op: the clipping engine already ran the backward pass inside ``training_step``."""
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the clipping closure, privatise the summed gradient, then let the optimizer step."""

        def private_closure() -> Any:
            result = closure()
            self._privatize()
            return result

        return super().optimizer_step(optimizer, private_closure, model, **kwargs)

    def _privatize(self) -> None:
        """All-reduce the clipped sums once, with N(0, σ²C²) added once (rank 0), and divide by q·N."""
        accountant = self._ledger.accountant
        assert accountant is not None and self._noise_multiplier is not None and self._buffer is not None
        epsilon = self._next_epsilon if self._next_epsilon is not None else self._epsilon_after(1)
        if self._exceeds(epsilon):  # only reachable when trainer.min_steps / min_epochs overrule the stop
            raise ValueError(
                f"trainer.min_steps / trainer.min_epochs forced DP step {accountant.steps + 1}, which would spend "
                f"ε={epsilon:.4f} > DPStrategy.target_epsilon={self._target_epsilon}: stopped before it"
            )
        following = self._epsilon_after(2) if self._target_epsilon is not None else None  # ε after the next step
        self._global_noisy_sum(stop=self.is_global_zero and self._exceeds(following))
        stop = bool(self._buffer.extra[0] > 0)  # rank 0's decision, so every rank stops after the same step
        self._buffer.publish(self.expected_batch_size)
        accountant.step(noise_multiplier=self._noise_multiplier, sample_rate=self._sample_rate)
        self.privacy_history.record_dp_step(noise_multiplier=self._noise_multiplier, sample_rate=self._sample_rate)
        self._log_privacy(epsilon)
        self._next_epsilon = following
        if stop:
            self._stop(epsilon, following, steps_done=self.lightning_module.trainer.global_step + 1)

    def _epsilon_after(self, steps: int) -> float:
        """ε after ``steps`` more steps at this run's (σ, q)."""
        assert self._ledger.accountant is not None and self._noise_multiplier is not None
        rate = self._sample_rate or 0.0
        return self._ledger.accountant.epsilon(extra_steps=steps, noise_multiplier=self._noise_multiplier, sample_rate=rate)

    def _exceeds(self, epsilon: float | None) -> bool:
        return self._target_epsilon is not None and epsilon is not None and epsilon > self._target_epsilon * (1 + 1e-9)

    def _stop(self, spent: float, next_epsilon: float | None, *, steps_done: int) -> None:
        """Stop before a step that would spend more than ``target_epsilon``: a refused step is never taken.

        Says so unless the plan ends here anyway (``steps_done``: the trainer's steps once this one is counted).
        """
        trainer = self.lightning_module.trainer
        trainer.should_stop = True
        if steps_done >= trainer.estimated_stepping_batches:
            return
        rank_zero_warn(
            f"DP-SGD: privacy budget spent: ε={spent:.4f} of "
            f"target_epsilon={self._target_epsilon} after {self._ledger.steps} DP steps; the next step would "
            f"spend ε={next_epsilon:.4f}, so training stops here",
            category=PrivacyWarning,
        )

    def _global_noisy_sum(self, stop: bool) -> None:
        """Buffer ← Σ over ranks of the clipped sums plus rank 0's noise, and rank 0's stop flag; one all-reduce."""
        assert self._buffer is not None and self._noise_multiplier is not None
        self._buffer.extra.fill_(float(stop))
        if self.is_global_zero and self._noise_multiplier > 0:  # a fresh generator every step
            generator = self._noise_source.generator("noise", steps=self._ledger.steps, device=self.root_device)
            self._buffer.add_noise(self._noise_multiplier * self._max_grad_norm, generator)
        if self.world_size > 1:
            dist.all_reduce(self._buffer.flat, op=dist.ReduceOp.SUM)  # same bits on every rank, as DDP's
        self._buffer.refuse_non_finite(step=self._ledger.steps + 1)

    def _log_privacy(self, epsilon: float) -> None:
        _log_spend(self.lightning_module, epsilon, float(self._noise_multiplier or 0.0), self._ledger.steps)
        self._ledger.write(self._privacy_facts(), epsilon=epsilon)

    def _privacy_facts(self) -> dict[str, Any]:
        """What the ledger records beside the accountant's history (never a seed)."""
        reason = self.privacy_history.reason_not_private()
        return {
            "noise_multiplier": self._noise_multiplier,
            "max_grad_norm": self._max_grad_norm,
            "sample_rate": self._sample_rate,
            "dataset_size": self._dataset_size,
            "target_epsilon": self._target_epsilon,
            "expected_batch_size": self.expected_batch_size if self._sample_rate is not None else None,
            "sampling": "poisson",
            "clipping": self._clipping,
            "tied_norm": self._tied_norm,
            "noise": self._noise_source.describe(),
            "noise_secure": self._noise_source.secure and self.privacy_history.noise_secure,
            "differentially_private": reason is None and bool(self._noise_multiplier),
            "reason_not_private": reason,
            "privacy_history": self.privacy_history.state_dict(),
        }

    def _segment_facts(self) -> dict[str, Any]:
        """This run's public parameters, as its segment of the weights' privacy history records them."""
        accountant = self._ledger.accountant
        assert accountant is not None
        return {
            "max_grad_norm": self._max_grad_norm,
            "dataset_size": self._dataset_size,
            "delta": accountant.delta,
            "mechanism": self._mechanism,
            "noise": self._noise_source.describe(),
            "noise_secure": self._noise_source.secure,
        }

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Save ``checkpoints/interrupted.ckpt`` with the ledger when steps taken since the start would be lost."""
        super().on_exception(exception)
        accountant, path = self._ledger.accountant, self._interrupt_path
        if accountant is None or path is None or accountant.steps == self._steps_at_start:
            return
        if self.world_size > 1 and not isinstance(exception, KeyboardInterrupt):
            return  # the other ranks may be inside a collective: privacy_ledger.json is current, no checkpoint
        self.lightning_module.trainer.save_checkpoint(path)
        rank_zero_warn(
            f"DP-SGD: training stopped by {type(exception).__name__} after {accountant.steps} DP steps; saved "
            f"{path} with the privacy ledger (resume with --ckpt_path {path})",
            category=PrivacyWarning,
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save the checkpoint with the privacy ledger inside."""
        if self._ledger.accountant is not None:
            checkpoint[CHECKPOINT_KEY] = self._ledger.state(self._privacy_facts())
            record_digest(checkpoint, CHECKPOINT_KEY)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load a checkpoint (refusing one whose weights, history or ledger changed since dplit wrote it) and keep its
        privacy ledger, so a resumed run continues its ε."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        check_digests(checkpoint, source=f"--ckpt_path {checkpoint_path}")
        if CHECKPOINT_KEY in checkpoint:
            self._ledger.restore(checkpoint[CHECKPOINT_KEY])
            self._resumed_from = Path(checkpoint_path)
        elif self.lightning_module is not None and self.lightning_module.trainer.state.fn == "fit":
            raise ValueError(f"{checkpoint_path} has no privacy ledger: it was not saved by DPStrategy")
        return checkpoint


def _check_privacy_arguments(
    max_grad_norm: float, noise_multiplier: float | None, target_epsilon: float | None, target_delta: float | None
) -> None:
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(
            "set exactly one of DPStrategy.noise_multiplier and DPStrategy.target_epsilon "
            f"(got noise_multiplier={noise_multiplier}, target_epsilon={target_epsilon})"
        )
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"DPStrategy.max_grad_norm must be a finite number > 0, got {max_grad_norm}")
    if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"DPStrategy.noise_multiplier must be a finite number ≥ 0, got {noise_multiplier}")
    if target_epsilon is not None and not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"DPStrategy.target_epsilon must be a finite number > 0, got {target_epsilon}")
    if target_delta is not None and not 0 < target_delta <= DELTA_MAX:
        raise ValueError(f"DPStrategy.target_delta must be in (0, {DELTA_MAX}], got {target_delta}")


def _check_same_dataset_size(restored: int | None, dataset_size: int) -> None:
    """Refuse resuming a run on a training set of another size: q = B/N, δ = N^-1.1 and ε all depend on N."""
    if restored is not None and restored != dataset_size:
        raise ValueError(
            f"the training set has {dataset_size} rows, but the checkpoint's run trained on {restored}: a resumed run "
            "must train on the same rows (its sampling rate q = data.batch_size / N, its default δ = N^-1.1 and its ε "
            "depend on N); resume with the same data, or start a new run from the exported model"
        )


def _check_delta(delta: float, dataset_size: int, *, allowed: bool) -> None:
    """Refuse δ ≥ 1/N (it permits releasing whole examples) unless ``allowed``, and then warn."""
    if delta < 1 / dataset_size:
        return
    message = (
        f"DPStrategy.target_delta={delta:.3g} is ≥ 1/N = {1 / dataset_size:.3g} for N={dataset_size} training "
        "examples: a δ that large permits releasing whole examples"
    )
    if not allowed:
        raise ValueError(f"{message}; use δ ≤ N^-1.1 (the default) or set DPStrategy.allow_large_delta=true")
    rank_zero_warn(f"{message} (allowed by DPStrategy.allow_large_delta)", category=PrivacyWarning)


def _check_trainer(trainer: Trainer, precision: Precision, *, planned: bool) -> None:
    if planned and trainer.max_steps == -1 and trainer.max_epochs == -1:
        raise ValueError(
            "DPStrategy.target_epsilon spreads ε over the planned steps: set a finite trainer.max_epochs or "
            "trainer.max_steps (both are -1), or give DPStrategy.noise_multiplier instead"
        )
    if trainer.gradient_clip_val:
        raise ValueError(
            "trainer.gradient_clip_val must be unset with DPStrategy: it clips per example "
            "(DPStrategy.max_grad_norm); clipping the noisy batch gradient again is not DP-SGD"
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "trainer.accumulate_grad_batches must be 1 with DPStrategy: raise data.batch_size for larger "
            "logical batches and DPStrategy.max_physical_batch_size bounds memory"
        )
    if trainer.fast_dev_run:
        raise ValueError(
            "trainer.fast_dev_run is refused with DPStrategy: it spends real privacy on the private data and writes "
            "no ledger or checkpoint; for a short run set trainer.max_steps (σ is then calibrated for those steps)"
        )
    _check_precision(precision)


def _check_precision(precision: Precision) -> None:
    name = str(precision.precision)
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            "trainer.precision '16-mixed' (loss scaling) is not supported with DPStrategy: use 'bf16-mixed'"
        )
    if name not in TESTED_PRECISIONS:
        raise ValueError(
            f"trainer.precision={name!r} is not supported with DPStrategy (the DP path is tested with "
            f"{', '.join(TESTED_PRECISIONS)}; '16-true' weights overflow to NaN): use 'bf16-mixed' or '32-true'"
        )


def _checkpoint_folder(trainer: Trainer, log_dir: str | None) -> Path:
    """Where the run's checkpoints go: its ``ModelCheckpoint``'s folder, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    folder = getattr(callback, "dirpath", None)
    return Path(folder) if folder else Path(log_dir or trainer.default_root_dir) / "checkpoints"


def _size(batch: Batch) -> int:
    """The number of examples in ``batch``."""
    return next(iter(batch.values())).shape[0]


def _split(batch: Batch, size: int) -> Iterator[Batch]:
    """Micro-batches of at most ``size`` examples (none for an empty batch)."""
    total = _size(batch)
    for start in range(0, total, size):
        yield {key: value[start : start + size] for key, value in batch.items()}


def _size_and_rate(dataloader: DataLoader) -> tuple[int, float]:
    """N and the Poisson rate q = batch_size / N of the training loader (refusing an empty set, a bad size)."""
    size = len(dataloader.dataset)  # type: ignore[arg-type]
    batch_size = dataloader.batch_size
    if size == 0:
        raise ValueError("the training dataset is empty")
    if batch_size is None or not 0 < batch_size <= size:
        raise ValueError(f"data batch_size must be in [1, {size}] (the training set size), got {batch_size}")
    return size, batch_size / size


def _log_clipping(module: LightningModule, losses: Tensor, norms: Tensor, max_grad_norm: float) -> Tensor:
    """Log the logical batch's loss, clip fraction, mean norm and dropped (non-finite) examples; return the loss."""
    loss, norm = losses.float(), norms.float()
    size = loss.shape[0]
    finite = torch.isfinite(norm)
    module.log("train/loss", loss.mean(), batch_size=size, prog_bar=True)
    module.log("dp/clip_fraction", (norm > max_grad_norm).float().mean(), batch_size=size)
    mean_norm = norm.where(finite, 0.0).sum() / finite.sum().clamp(min=1)  # no device sync in the training step
    module.log("dp/grad_norm", mean_norm, batch_size=size)
    module.log("dp/dropped_examples", (~finite).sum().float(), batch_size=1, reduce_fx="sum")
    return loss.mean()


def _log_spend(module: LightningModule, epsilon: float, noise_multiplier: float, steps: int) -> None:
    """Log ε so far, σ and the number of DP steps."""
    module.log("privacy/epsilon", epsilon, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)
    module.log("privacy/noise_multiplier", noise_multiplier, on_step=True, batch_size=1)
    module.log("privacy/steps", float(steps), on_step=True, batch_size=1)
