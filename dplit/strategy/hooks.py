"""DPSGDHooks: the Lightning strategy hooks through which :class:`~dplit.privacy.dpsgd.DPSGD` replaces backward.

Every DP strategy (data parallel or sharded) inherits them before its Lightning base, e.g.
``class DPStrategy(DPSGDHooks, DDPStrategy)``: the hooks' ``__init__`` takes the DP arguments and passes the rest to
the Lightning strategy, and the strategy calls :meth:`DPSGDHooks.build_dpsgd` once its model is on its device. The mechanism itself stays in the Lightning-free
DPSGD object; these hooks only say when Lightning calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from dplit.flag_types import Number
from dplit.privacy.accounting import Mechanism, PrivacyAccountant
from dplit.privacy.clip_bound import clipping_engine
from dplit.privacy.clipping.engine import Batch, ClippingEngine
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.integrity import check_digests, record_digest
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.privacy.noise import NoiseSource
from dplit.privacy.refusal import SettingError
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings
from dplit.privacy.world import World
from dplit.strategy.checks import check_module, check_same_privacy_unit, check_trainer
from dplit.strategy.interrupted_run import interrupt_checkpoint_path, save_interrupted_run
from dplit.strategy.step_logging import log_clipping, log_spend

UNIT_FACTS = ("privacy_unit", "dataset_size", "users", "max_rows_per_user", "largest_user_rows", "clip_mode")
"""What TensorBoard's hyperparameters show as ``privacy/*``: the privacy unit's public counts and the clipping mode's
name, and the largest user's row count while it is a private diagnostic this run states."""


class DPSGDHooks:
    """Poisson loaders, clipping in ``training_step``, no backward, the noisy release in ``optimizer_step``, the ledger.

    Meant to precede a Lightning ``Strategy`` in the bases: every ``super()`` call here reaches that strategy. Every
    argument but ``**kwargs`` is a field of :class:`~dplit.privacy.settings.DPSGDSettings` (documented there),
    validated when the strategy is made, by the settings alone: a number is typed :data:`~dplit.flag_types.Number`
    (any number, ``inf`` and ``nan`` included, read from the command line as from YAML) so that the settings word
    every refusal of its range.

    Args:
        **kwargs: passed to the Lightning strategy (e.g. DDP's ``process_group_backend``, ``start_method``).
    """

    flag_owner = FLAG_OWNER
    """The class name a refusal of this strategy's flags names."""

    def __init__(
        self,
        *,
        max_grad_norm: Number,
        clip_mode: Literal["fixed", "quantile", "automatic"] = "fixed",
        target_quantile: Number | None = None,
        clip_learning_rate: Number | None = None,
        count_noise_multiplier: Number | None = None,
        automatic_stability: Number | None = None,
        noise_multiplier: Number | None = None,
        target_epsilon: Number | None = None,
        target_delta: Number | None = None,
        accountant: Mechanism = "prv",
        clipping: Literal["ghost", "per_example"] = "ghost",
        tied_norm: Literal["exact", "bound"] = "exact",
        max_physical_batch_size: int = 32,
        self_check: bool = True,
        seed: int | None = None,
        allow_large_delta: bool = False,
        private_diagnostics: bool = True,
        public_change: str | None = None,
        people_overlap: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # the Lightning strategy's own arguments
        self.settings = DPSGDSettings(
            max_grad_norm=max_grad_norm, clip_mode=clip_mode, target_quantile=target_quantile,
            clip_learning_rate=clip_learning_rate, count_noise_multiplier=count_noise_multiplier,
            automatic_stability=automatic_stability, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            target_delta=target_delta, accountant=accountant, clipping=clipping, tied_norm=tied_norm,
            max_physical_batch_size=max_physical_batch_size, self_check=self_check, seed=seed,
            allow_large_delta=allow_large_delta, private_diagnostics=private_diagnostics, public_change=public_change,
            people_overlap=people_overlap, flag_owner=self.flag_owner,
        )  # fmt: skip
        self.noise_source = NoiseSource(seed=seed)
        self._dpsgd: DPSGD | None = None
        self._restored: dict[str, Any] | None = None
        self._resumed_from: Path | None = None
        self._interrupt_path: Path | None = None

    def build_dpsgd(self, world: World) -> None:
        """Build DP-SGD for the module being trained (continuing a resumed ledger)."""
        with self.naming_refusals():
            self._build_dpsgd(world)

    @contextmanager
    def naming_refusals(self) -> Iterator[None]:
        """A refused knob raised inside names this strategy's knob (``ShardedDPStrategy.target_delta``, ...)."""
        try:
            yield
        except SettingError as error:
            raise error.named(self.flag_owner) from None

    def _build_dpsgd(self, world: World) -> None:
        module = self.lightning_module
        self._dpsgd = DPSGD(
            module, self.settings, history=module.privacy_history, noise_source=self.noise_source, world=world,
            engine=self.make_clipping_engine(module), weights_state=getattr(module, "weights_state", None),
        )  # fmt: skip
        if self._restored is not None:
            self._dpsgd.load_state_dict(self._restored)

    @property
    def dpsgd(self) -> DPSGD:
        """The DP-SGD mechanism (built at setup, for the module being trained)."""
        if self._dpsgd is None:
            raise RuntimeError(f"{type(self).__name__} builds its DP-SGD mechanism at setup")
        return self._dpsgd

    @property
    def max_grad_norm(self) -> float:
        """The per-example clipping bound C."""
        return self.settings.max_grad_norm

    @property
    def noise_multiplier(self) -> float | None:
        """σ in use (calibrated from ``target_epsilon`` once training starts)."""
        return self._dpsgd.noise_multiplier if self._dpsgd is not None else self.settings.noise_multiplier

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The run's accountant (``None`` before training starts)."""
        return self._dpsgd.accountant if self._dpsgd is not None else None

    @property
    def private_diagnostics(self) -> bool:
        """Whether diagnostics computed from the private batches without noise are logged (callbacks and data read it)."""
        return self.settings.private_diagnostics

    def make_clipping_engine(self, module: nn.Module) -> ClippingEngine:
        """The clipping engine for ``module`` (``settings.clipping``); an audit's broken mechanism may replace it."""
        return clipping_engine(module, self.settings)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Refuse a Trainer or module DP-SGD cannot train (one line), then set up as the strategy does."""
        check_trainer(trainer, self.precision_plugin, planned=self.settings.target_epsilon is not None)
        check_module(self.lightning_module)
        super().setup(trainer)  # type: ignore[misc]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Replace the training loader's sampler by Poisson sampling at rate q = batch_size / N."""
        stage = self.lightning_module.trainer.state.stage
        if stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        return self.dpsgd.sample(dataloader)

    @override
    def on_train_start(self) -> None:
        """Start the DP-SGD run (σ, δ, ledger, budget); stop at once if the budget is already spent."""
        super().on_train_start()  # type: ignore[misc]
        self._start_run()

    def start_without_steps(self) -> bool:
        """Check and record a fit whose loop Lightning skipped (a resume whose plan is done); ``False``: none skipped.

        Lightning calls no ``on_train_start`` when its plan is already done, so without this the resume would check
        nothing (N, δ, the ranks' rows), write no ledger and report no ε. Called by the CLI once ``trainer.fit`` returns.
        """
        if self._dpsgd is None or self._dpsgd.accountant is not None or self._dpsgd.sample_rate is None:
            return False
        self._start_run()
        self._dpsgd.finish()
        return True

    def _start_run(self) -> None:
        """Start DP-SGD for the trainer's plan: the checks, σ, the ledger, the budget (``on_train_start``'s work)."""
        trainer = self.lightning_module.trainer
        if self.dpsgd.sample_rate is None:
            raise RuntimeError(f"{type(self).__name__} did not see the training dataloader")
        log_dir = trainer.log_dir  # a collective: every rank asks, rank 0 writes
        check_same_privacy_unit(self._restored, self.dpsgd.facts())
        with self.naming_refusals():
            spent = self.dpsgd.start(
                planned_steps=trainer.estimated_stepping_batches, steps_done=trainer.global_step, log_dir=log_dir,
                resumed_from=self._resumed_from,
            )  # fmt: skip
        self._interrupt_path = interrupt_checkpoint_path(trainer, log_dir)
        trainer.should_stop = trainer.should_stop or spent
        facts = self.dpsgd.facts()
        unit = {key: facts[key] for key in UNIT_FACTS if key in facts}  # counts only, never a user id
        for logger in trainer.loggers:
            logger.log_hyperparams({f"privacy/{key}": value for key, value in unit.items()})

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Clip every example of the logical batch into the DP-SGD gradient buffer (the backward happens here)."""
        batch: Batch = args[0]
        with self.precision_plugin.train_step_context():
            stats = self.dpsgd.clip(self.lightning_module.per_example_loss, batch)
        if stats.losses.numel() == 0:
            return torch.zeros((), device=self.root_device)
        if not self.settings.private_diagnostics:
            return stats.losses.float().mean()
        return log_clipping(self.lightning_module, stats.losses, stats.norms, self.dpsgd.clip_bound)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """No-op: DP-SGD's clipping already ran the backward pass inside ``training_step``."""
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """Run the clipping closure, release the noisy gradient, then let the optimizer step."""

        def private_closure() -> Any:
            result = closure()
            stop = self.dpsgd.release()
            log_spend(self.lightning_module, self.dpsgd)
            trainer = self.lightning_module.trainer
            trainer.should_stop = trainer.should_stop or stop
            return result

        return super().optimizer_step(optimizer, private_closure, model, **kwargs)  # type: ignore[misc]

    @override
    def on_train_end(self) -> None:
        """Bring the ledger's ε up to date."""
        super().on_train_end()  # type: ignore[misc]
        if self._dpsgd is not None:
            self._dpsgd.finish()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Save ``checkpoints/interrupted.ckpt`` with the ledger when steps taken since the start would be lost."""
        super().on_exception(exception)  # type: ignore[misc]
        if self._dpsgd is not None and self._dpsgd.accountant is not None and self._interrupt_path is not None:
            trainer, multi_process = self.lightning_module.trainer, self.world_size > 1
            save_interrupted_run(trainer, self._dpsgd, self._interrupt_path, exception, multi_process=multi_process)
        if self._dpsgd is not None:
            self._dpsgd.close_segment(interrupted=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save the checkpoint with the privacy ledger inside, sealed with its digest."""
        if self._dpsgd is not None and self._dpsgd.accountant is not None:
            checkpoint[CHECKPOINT_KEY] = self._dpsgd.state_dict()
            record_digest(checkpoint, CHECKPOINT_KEY)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def check_loaded_digests(self, checkpoint: dict[str, Any], *, source: str) -> None:
        """Refuse a checkpoint whose weights, history or ledger changed since dplit sealed it (one line)."""
        check_digests(checkpoint, source=source)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load a checkpoint (refusing one changed since dplit sealed it) and keep its ledger, so ε continues."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        self.check_loaded_digests(checkpoint, source=f"--ckpt_path {checkpoint_path}")
        if CHECKPOINT_KEY in checkpoint:
            self._restored, self._resumed_from = checkpoint[CHECKPOINT_KEY], Path(checkpoint_path)
            if self._dpsgd is not None:
                self._dpsgd.load_state_dict(self._restored)
        elif self.lightning_module is not None and self.lightning_module.trainer.state.fn == "fit":
            raise ValueError(f"{checkpoint_path} has no privacy ledger: it was not saved by {type(self).__name__}")
        return checkpoint
