"""DPSGD: DP-SGD (Abadi et al. 2016, Algorithm 1) as a few named calls on one plain object, without Lightning.

One logical batch is one DP step::

    dpsgd = DPSGD(model, DPSGDSettings(max_grad_norm=1.0, noise_multiplier=1.0), history=PrivacyHistory())
    loader = dpsgd.sample(loader)                  # Poisson batches: each example joins with rate q = B / N
    dpsgd.start(planned_steps=len(loader))         # δ, σ (calibrated for a target ε), the ledger, the budget
    for batch in loader:
        dpsgd.clip(model.per_example_loss, batch)  # Σ_i min(1, C/‖g_i‖)·g_i into the gradient buffer
        stop = dpsgd.release()                     # + N(0, σ²C²) once, ÷ qN, account: every param.grad is set
        optimizer.step()
        if stop:                                   # the next step would spend more than the target ε
            break

Two public hooks let audits and benchmarks attach without subclassing: :meth:`DPSGD.register_before_noise_hook`
(sees the clipped sum, before the noise) and :meth:`DPSGD.register_after_noise_hook` (sees the noisy sum that is
released, before the division by qN). Under data parallelism (a :class:`~dplit.privacy.world.World` of several
ranks) each rank clips its own Poisson shard, rank 0 draws the noise and writes the ledger, and one all-reduce
carries the sums, the noise and rank 0's stop decision.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from dplit.privacy.accounting import PrivacyAccountant, calibrate_noise_multiplier, check_accountable, default_delta
from dplit.privacy.clip_bound import QuantileClipBound
from dplit.privacy.clipping import GhostEngine, build_engine
from dplit.privacy.clipping.engine import Batch, ClippingEngine, ClipStats, PerExampleLoss, trainable_parameters
from dplit.privacy.clipping.self_check import check_ghost_norms
from dplit.privacy.clipping.units import UNIT_KEY, units_of
from dplit.privacy.fingerprint import IndexedRows, rows_fingerprint
from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.ledger import RunLedger, ledger_folders
from dplit.privacy.noise import NoiseSource
from dplit.privacy.sampling import poisson_loader
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings
from dplit.privacy.training_state import StateWriteGuard, refuse_state_writing_modules
from dplit.privacy.user_sampling import UserLevel, user_level_of, user_poisson_loader
from dplit.privacy.warnings import PrivacyWarning
from dplit.privacy.world import SingleProcess, World

log = logging.getLogger(__name__)

AUTOMATIC_STABILITY = 0.01
"""Automatic clipping's default γ (Bu et al. 2023)."""
TARGET_QUANTILE, CLIP_LEARNING_RATE, COUNT_NOISE_SHARE = 0.5, 0.2, 1 / 20
"""Quantile clipping's defaults (Andrew et al. 2021): γ, η, and σ_b as a share of the expected batch."""

SumHook = Callable[["DPSGD", Tensor], None]
"""``hook(dpsgd, flat_sum)``: may read ``flat_sum`` (every trainable parameter's entries, flat, in order); a hook
that writes to it changes what is released (only an audit's canaries, or its deliberately broken mechanisms, do)."""
EPSILON_OVERHEAD = 0.02
"""The largest share of a run's time spent computing ε for the logs and the ledger file between its first and last
steps (one PRV ε costs 0.1-1.5 s on a CPU core, a step on a GPU far less). The budget never waits on this: it is
decided from the steps verified to fit, and the card's ε is always computed from the whole history."""
NO_NOISE_WARNING = (
    f"{FLAG_OWNER}.noise_multiplier=0: NO NOISE is added, so this run is NOT differentially private (ε = ∞); "
    "clipping alone protects nothing"
)


class DPSGD:
    """Per-example clipping, Poisson sampling, noise once per logical batch, and the privacy ledger of one run.

    Args:
        module: the model; its trainable parameters are privatised (one no rule covers is refused by name).
        settings: the run's knobs, validated.
        history: the weights' privacy history, continued by this run (kept by the model, saved with its weights).
        noise_source: seeds the sampling and the noise (default: from ``settings.seed``, OS entropy when unset).
        world: the ranks a logical batch is spread over (default: this process alone).
        engine: the clipping engine (default: ``settings.clipping`` built for ``module``).
    """

    def __init__(
        self,
        module: nn.Module,
        settings: DPSGDSettings,
        *,
        history: PrivacyHistory,
        noise_source: NoiseSource | None = None,
        world: World | None = None,
        engine: ClippingEngine | None = None,
    ) -> None:
        self.settings = settings
        self.history = history
        self.noise_source = noise_source if noise_source is not None else NoiseSource(seed=settings.seed)
        self.world: World = world if world is not None else SingleProcess()
        self.world.check_settings(settings)
        self.engine = engine if engine is not None else clipping_engine(module, settings)
        self.engine.check_parameters()
        refuse_state_writing_modules(module)
        self._module = module
        self._state_guard = StateWriteGuard(module)
        self._ledger = RunLedger()
        self._noise_multiplier = settings.noise_multiplier
        self._sample_rate: float | None = None
        self._dataset_size: int | None = None
        self._rows: IndexedRows | None = None
        self._user_level: UserLevel | None = None
        self._clip_bound: QuantileClipBound | None = None
        self._restored_clip_bound: dict[str, Any] = {}
        self._unclipped = 0.0  # this step's centred count Σ(1[‖g‖ ≤ C_t] − ½) on this rank (private until noised)
        self._counting_open = False  # True while the before-noise hooks run: count_units may add to the count
        self._buffer: GradientBuffer | None = None
        self._buffer_handle: RemovableHandle | None = None
        self._self_check_pending = settings.self_check
        self._budget_steps = 0  # the most total DP steps verified to stay within target_epsilon
        self._epsilon_spent, self._epsilon_steps = 0.0, 0
        self._accounting_seconds, self._started_at = 0.0, time.perf_counter()
        self._steps_at_start = 0
        self._steps_done = 0
        self._planned_steps = math.inf
        self._before_noise: OrderedDict[int, SumHook] = OrderedDict()
        self._after_noise: OrderedDict[int, SumHook] = OrderedDict()
        self.should_stop = False
        """Whether the next step would spend more than ``target_epsilon`` (set by :meth:`start` and :meth:`release`)."""

    # --- what a run is ---------------------------------------------------------------------------------------------

    @property
    def noise_multiplier(self) -> float | None:
        """σ in use (calibrated from ``target_epsilon`` by :meth:`start`)."""
        return self._noise_multiplier

    @property
    def sample_rate(self) -> float | None:
        """The Poisson rate q = expected logical batch size / N (set by :meth:`sample`)."""
        return self._sample_rate

    @property
    def dataset_size(self) -> int | None:
        """N, the training examples Poisson sampling draws from (set by :meth:`sample`)."""
        return self._dataset_size

    @property
    def expected_batch_size(self) -> float:
        """q·N: the global logical batch size the noisy sum is divided by."""
        assert self._sample_rate is not None and self._dataset_size is not None, "DPSGD.sample first"
        return self._sample_rate * self._dataset_size

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The run's accountant: the weights' whole history plus this run's steps (``None`` before :meth:`start`)."""
        return self._ledger.accountant

    @property
    def epsilon_spent(self) -> float:
        """ε spent by the weights' whole history at the run's δ, as of :attr:`epsilon_steps` DP steps."""
        return self._epsilon_spent

    @property
    def epsilon_steps(self) -> int:
        """The DP steps :attr:`epsilon_spent` counts.

        All of them after the first and last planned steps, a stop, and :meth:`finish`; between those, ε is refreshed
        while that costs at most ``EPSILON_OVERHEAD`` of the run's time.
        """
        return self._epsilon_steps

    @property
    def steps(self) -> int:
        """DP steps the accountant counts so far (a restored checkpoint's included)."""
        return self._ledger.steps

    @property
    def steps_this_run(self) -> int:
        """DP steps taken since :meth:`start`."""
        return self._ledger.steps - self._steps_at_start

    # --- hooks -----------------------------------------------------------------------------------------------------

    @property
    def gradient_buffer(self) -> GradientBuffer:
        """The buffer this rank's clipped sums are summed into (made by :meth:`start`, one per trainable set)."""
        return self._started_buffer()

    def register_before_noise_hook(self, hook: SumHook, *, prepend: bool = False) -> RemovableHandle:
        """Call ``hook(self, clipped_sum)`` on every rank after clipping, before the noise is added."""
        return _register(self._before_noise, hook, prepend=prepend)

    def register_after_noise_hook(self, hook: SumHook, *, prepend: bool = False) -> RemovableHandle:
        """Call ``hook(self, noisy_sum)`` on every rank once the noisy sum is summed over ranks, before ÷ qN."""
        return _register(self._after_noise, hook, prepend=prepend)

    def count_units(self, norms: Tensor) -> None:
        """Count units that join this step outside the engine (an audit's canaries) in quantile mode's noisy count.

        Call it from a before-noise hook, on the one rank that adds those units to the clipped sum, with the gradient
        norm of each unit the engine did not see, once: each adds 1[‖g‖ ≤ C_t] − ½ like any clipped example (counting
        a unit twice would double its sensitivity). A no-op in the other modes.

        Raises:
            RuntimeError: called outside a before-noise hook (the count would land in another step or nowhere).
        """
        if not self._counting_open:
            raise RuntimeError("DPSGD.count_units is called from a before-noise hook only")
        if self._clip_bound is not None:
            self._unclipped += self._clip_bound.centred_count(norms)

    # --- Algorithm 1 -----------------------------------------------------------------------------------------------

    def sample(self, loader: DataLoader) -> DataLoader:
        """``loader`` with Poisson sampling at q = ``loader.batch_size`` / N (each rank draws its shard at rate q).

        A dataset that declares users (:func:`~dplit.privacy.user_sampling.user_level_of`) is sampled by user: N
        is the number of users, ``batch_size`` the expected users per batch, and each user is clipped as one unit.
        """
        self._user_level = user_level_of(loader.dataset)
        units = self._user_level.users if self._user_level is not None else len(loader.dataset)  # type: ignore[arg-type]
        self._dataset_size, self._sample_rate = _size_and_rate(loader, units, users=self._user_level is not None)
        self._rows = loader.dataset  # type: ignore[assignment]
        seed = self.noise_source.seed("sampling", steps=self._ledger.steps)  # the sampler mixes in the rank
        where = {"num_replicas": self.world.size, "rank": self.world.rank, "seed": seed}
        if self._user_level is not None:  # q over users; a sampled user brings ≤ k rows
            return user_poisson_loader(loader, level=self._user_level, sample_rate=self._sample_rate, **where)
        return poisson_loader(loader, sample_rate=self._sample_rate, **where)

    def start(
        self,
        *,
        planned_steps: float,
        steps_done: int = 0,
        log_dir: str | None = None,
        resumed_from: Path | None = None,
    ) -> bool:
        """Check δ, N and the ranks' rows; calibrate σ; open the ledger on the weights' history; decide the budget.

        Args:
            planned_steps: the steps the whole plan takes (``steps_done`` included; ``inf`` without a plan).
            steps_done: steps the plan already took (a resumed run).
            log_dir: where rank 0 keeps ``privacy_ledger.json`` (``None``: no file).
            resumed_from: the checkpoint a resumed run restored (see :meth:`load_state_dict`).

        Returns:
            Whether the budget is already spent (no step may be taken).
        """
        if self._sample_rate is None or self._dataset_size is None:
            raise RuntimeError("DPSGD.start needs the training loader: call DPSGD.sample first")
        _check_same_dataset_size(self._ledger.restored_dataset_size, self._dataset_size)
        delta = self.settings.target_delta or default_delta(self._dataset_size)
        self._check_delta(delta)
        self._check_ranks_hold_the_same_rows()
        self._check_users_fit_a_micro_batch()
        self._planned_steps, self._steps_done = planned_steps, steps_done
        self._open_ledger(delta, log_dir, resumed_from)
        self._buffer = self.world.gradient_buffer(list(trainable_parameters(self._module).values()), extra=2)
        self._start_clip_bound()
        if self._buffer_handle is not None:
            self._buffer_handle.remove()
        self._buffer_handle = self.engine.register_summed_hook(self._buffer.receive)
        self._say(
            f"DP-SGD: σ={self._noise_multiplier:.4f}, {_clip_text(self.settings)}, q={self._sample_rate:.3g}, "
            f"expected batch {self.expected_batch_size:.1f} {'users' if self._user_level is not None else 'examples'}, "
            f"δ={delta:.3g}, clipping={self.settings.clipping}, "
            f"steps so far {self._ledger.steps}, noise {self.noise_source.describe()}"
        )
        if self._noise_multiplier == 0:
            self._warn(NO_NOISE_WARNING.replace(FLAG_OWNER, self.settings.flag_owner, 1))
        self._steps_at_start = self._budget_steps = self._ledger.steps
        self._started_at = time.perf_counter()
        self._refresh_epsilon()
        if self._steps_at_start:  # a resumed run always has a ledger file, even if it takes no step
            self._ledger.write(self.facts(), epsilon=self._epsilon_spent)
        if math.isfinite(planned_steps):  # σ was calibrated for the plan: verify it once, not at every step
            self._within_budget(self._ledger.steps + max(0, int(planned_steps) - steps_done))
        if self.world.broadcast(not self._within_budget(self._ledger.steps + 1)):  # rank 0's decision
            self._stop()
        return self.should_stop

    def clip(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Sum every example's clipped gradient into the buffer, ``max_physical_batch_size`` examples at a time.

        Returns:
            The logical batch's per-example losses and gradient norms (before clipping): private, unnoised.
        """
        buffer = self._started_buffer()
        if self._user_level is not None and batch_size(batch) > 0 and units_of(batch) is None:
            raise ValueError(
                f"user-level DP: the training batch has no {UNIT_KEY!r} field, so its rows would be clipped one by "
                "one (up to k·C per user) while ε counts users: the dataset's collate function must keep each row's user"
            )
        losses, norms = [], []
        self._state_guard.arm()
        micro_batches = list(split_batch(batch, self.settings.max_physical_batch_size))  # a user's rows stay together
        placeholders = self.world.micro_batch_count(len(micro_batches)) - len(micro_batches)
        with buffer.receiving():  # every param.grad is a view into the buffer: the engine's sums land in it
            self._self_check(loss_fn, batch)
            for micro_batch in micro_batches:
                stats = self.engine.accumulate(loss_fn, micro_batch)
                losses.append(stats.losses)
                norms.append(stats.norms)
                if self._clip_bound is not None:
                    self._unclipped += self._clip_bound.centred_count(stats.norms)
            for _ in range(placeholders):  # sharded weights: every rank runs every forward pass, these add zero
                self.engine.accumulate(_contributing_nothing(loss_fn), placeholder_example(batch))
        self._state_guard.check()  # before any noise or step: nothing written from private data is released
        if not losses:
            empty = buffer.flat.new_zeros(0)
            return ClipStats(losses=empty, norms=empty)
        return ClipStats(losses=torch.cat(losses), norms=torch.cat(norms))

    def release(self) -> bool:
        """Add N(0, σ²C²) once (rank 0), sum over ranks, divide by qN, set every ``param.grad``, and account the step.

        Returns:
            Whether training must stop after this step (the next one would spend more than ``target_epsilon``).
        """
        buffer, accountant = self._started_buffer(), self._accountant()
        upcoming = accountant.steps + 1
        if not self._within_budget(upcoming):  # only reachable when a trainer forces steps past the stop
            raise ValueError(
                f"trainer.min_steps / trainer.min_epochs forced DP step {upcoming}, which would spend "
                f"ε={self.epsilon_after(1):.4f} > {self.settings.flag_owner}.target_epsilon={self.settings.target_epsilon}: "
                "stopped before it"
            )
        self._noisy_sum(stop=self.world.rank == 0 and not self._within_budget(upcoming + 1))
        stop = bool(buffer.extra[0] > 0)  # rank 0's decision, so every rank stops after the same step
        buffer.publish(self.expected_batch_size)
        noise_multiplier, sample_rate = self._noise_multiplier or 0.0, self._sample_rate or 0.0
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        self.history.record_dp_step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        self._steps_done += 1
        if stop or self._epsilon_due():
            self._refresh_epsilon()
        self._ledger.write(self.facts(), epsilon=self._epsilon_spent)
        if stop:
            self._stop()
        return stop

    def finish(self) -> None:
        """Bring ε up to date and write the ledger file (at the end of training, or when it is interrupted)."""
        if self._ledger.accountant is not None and self._epsilon_steps != self._ledger.steps:
            self._refresh_epsilon()
            self._ledger.write(self.facts(), epsilon=self._epsilon_spent)

    def epsilon_after(self, steps: int) -> float:
        """ε after ``steps`` more steps at this run's (σ, q)."""
        rate, sigma = self._sample_rate or 0.0, self._noise_multiplier or 0.0
        return self._accountant().epsilon(extra_steps=steps, noise_multiplier=sigma, sample_rate=rate)

    # --- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The ledger as checkpoints keep it: the accountant's history and the run's public facts (never a seed)."""
        return self._ledger.state(self.facts())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's ledger (its run id, steps, σ and N, C_t): :meth:`start` picks it up."""
        self._ledger.restore(state)
        if state.get("clip_mode") == "quantile":
            self._restored_clip_bound = {key: state.get(key) for key in ("clip_bound", "clip_quantile_estimate")}

    def facts(self) -> dict[str, Any]:
        """What the ledger records beside the accountant's history (never a seed)."""
        settings, reason = self.settings, self.history.reason_not_private()
        return {
            "noise_multiplier": self._noise_multiplier,
            "max_grad_norm": settings.max_grad_norm,
            "sample_rate": self._sample_rate,
            "dataset_size": self._dataset_size,
            "target_epsilon": settings.target_epsilon,
            "expected_batch_size": self.expected_batch_size if self._sample_rate is not None else None,
            "epsilon_steps": self._epsilon_steps,
            "sampling": "poisson",
            **self._clip_facts(),
            **self._unit_facts(),
            "clipping": settings.clipping,
            "tied_norm": settings.tied_norm,
            "noise": self.noise_source.describe(),
            "noise_secure": self.noise_source.secure and self.history.noise_secure,
            "differentially_private": reason is None and bool(self._noise_multiplier),
            "reason_not_private": reason,
            "privacy_history": self.history.state_dict(),
        }

    def _clip_facts(self) -> dict[str, Any]:
        """The clipping mode and its state: C_t, γ, η, σ_b, σ_eff (public: no value computed without noise)."""
        settings = self.settings
        facts: dict[str, Any] = {"clip_mode": settings.clip_mode}
        if settings.clip_mode == "automatic":
            facts["automatic_stability"] = self.engine.stability
        if self._clip_bound is not None:
            facts.update(
                self._clip_bound.state_dict(),
                target_quantile=self._clip_bound.target_quantile,
                clip_learning_rate=self._clip_bound.learning_rate,
                count_noise_multiplier=self._clip_bound.count_noise_multiplier,
                gradient_noise_multiplier=self.gradient_noise_multiplier,
            )
        return facts

    # --- inside the steps ------------------------------------------------------------------------------------------

    def _noisy_sum(self, *, stop: bool) -> None:
        """Buffer ← Σ over ranks of the clipped sums plus rank 0's noise, and rank 0's stop flag; one all-reduce."""
        buffer = self._started_buffer()
        self._counting_open = True
        try:
            _call(self._before_noise, self, buffer.gradients)
        finally:
            self._counting_open = False
        buffer.extra.copy_(torch.tensor([float(stop), self._noisy_local_count()]))
        std = self.gradient_noise_multiplier * self.clip_bound  # the claimed C_t, whatever the engine clipped to
        self.world.noisy_sum(buffer, std=std, generator=self._noise_generator)
        buffer.refuse_non_finite(step=self._ledger.steps + 1)
        _call(self._after_noise, self, buffer.gradients)
        if self._clip_bound is not None:  # C_{t+1} from the noisy count (the same on every rank)
            self._clip_bound.update(float(buffer.extra[1]), self.expected_batch_size)
            self.engine.set_max_grad_norm(self._clip_bound.bound)
        self._unclipped = 0.0

    def _noisy_local_count(self) -> float:
        """This rank's centred count, plus N(0, σ_b²) on rank 0 only (summed over ranks: noised once)."""
        if self._clip_bound is None:
            return 0.0
        count = self._unclipped
        if self.world.rank == 0 and self._noise_multiplier:
            generator = self.noise_source.generator("count", steps=self._ledger.steps, device=torch.device("cpu"))
            count += (
                float(torch.randn((), generator=generator, dtype=torch.float64))
                * self._clip_bound.count_noise_multiplier
            )
        return count

    @property
    def gradient_noise_multiplier(self) -> float:
        """The gradient's noise std in units of C: σ, or σ_eff ≥ σ under quantile clipping (the count takes a share)."""
        sigma = self._noise_multiplier or 0.0
        return self._clip_bound.gradient_noise_multiplier(sigma) if self._clip_bound is not None else sigma

    @property
    def clip_quantile_estimate(self) -> float | None:
        """Quantile clipping: the last step's noisy share of unclipped units (``None`` in other modes)."""
        return self._clip_bound.last_estimate if self._clip_bound is not None else None

    @property
    def clip_bound(self) -> float:
        """The clipping bound C the mechanism claims for the next step: ``max_grad_norm``, or C_t under quantile."""
        return self._clip_bound.bound if self._clip_bound is not None else self.settings.max_grad_norm

    def _start_clip_bound(self) -> None:
        """Quantile mode: C_0 (or a resumed checkpoint's C_t), and σ_eff checked before any step."""
        settings = self.settings
        if settings.clip_mode != "quantile":
            return
        self._clip_bound = QuantileClipBound(
            initial=settings.max_grad_norm,
            target_quantile=settings.target_quantile or TARGET_QUANTILE,
            learning_rate=settings.clip_learning_rate or CLIP_LEARNING_RATE,
            count_noise_multiplier=settings.count_noise_multiplier or COUNT_NOISE_SHARE * self.expected_batch_size,
            flag_owner=settings.flag_owner,
        )
        self._clip_bound.load_state_dict(self._restored_clip_bound)
        self.engine.set_max_grad_norm(self._clip_bound.bound)
        self._clip_bound.gradient_noise_multiplier(self._noise_multiplier or 0.0)  # refuses σ_b too small, now

    def _noise_generator(self, rank: int) -> torch.Generator:
        """A fresh generator for the noise ``rank`` draws in this step (its own stream: ranks draw independently)."""
        stream = "noise" if rank == 0 else f"noise/rank{rank}"
        return self.noise_source.generator(stream, steps=self._ledger.steps, device=self._started_buffer().flat.device)

    def _self_check(self, loss_fn: PerExampleLoss, batch: Batch) -> None:
        """Once, on the first non-empty batch: the ghost engine's norms against autograd's (``settings.self_check``)."""
        if not self._self_check_pending or not isinstance(self.engine, GhostEngine) or batch_size(batch) == 0:
            return
        examples = min(4, self.settings.max_physical_batch_size)
        check_ghost_norms(self.engine, self._module, loss_fn, batch, examples=examples)
        self._self_check_pending = False
        self._say("DP-SGD: ghost clipping self-check passed (per-parameter norms agree with autograd)")

    def _within_budget(self, steps: int) -> bool:
        """Whether ``steps`` DP steps in all (this run's σ, q from now on) spend at most ``target_epsilon``.

        ε grows with every step, so a count verified once needs no accountant call again: only a step past the most
        verified so far costs one (a plan's whole count is verified by :meth:`start`).
        """
        target = self.settings.target_epsilon
        if target is None or steps <= self._budget_steps:
            return True
        if self.epsilon_after(steps - self._ledger.steps) > target * (1 + 1e-9):
            return False
        self._budget_steps = steps
        return True

    def _epsilon_due(self) -> bool:
        """Whether ε is refreshed after this step: the run's first and last planned steps, else while it is cheap."""
        if self.steps_this_run == 1 or self._steps_done >= self._planned_steps:
            return True
        return self._accounting_seconds <= EPSILON_OVERHEAD * (time.perf_counter() - self._started_at)

    def _refresh_epsilon(self) -> None:
        begin = time.perf_counter()
        self._epsilon_spent = self._accountant().epsilon() if self._ledger.steps else 0.0
        self._epsilon_steps = self._ledger.steps
        self._accounting_seconds += time.perf_counter() - begin

    def _stop(self) -> None:
        """Stop before a step that would spend more than ``target_epsilon``; say so unless the plan ends here."""
        self.should_stop = True
        if self._steps_done >= self._planned_steps:
            return
        self._warn(
            f"DP-SGD: privacy budget spent: ε={self._epsilon_spent:.4f} of "
            f"target_epsilon={self.settings.target_epsilon} after {self._ledger.steps} DP steps; the next step would "
            f"spend ε={self.epsilon_after(1):.4f}, so training stops here"
        )

    # --- opening the ledger ----------------------------------------------------------------------------------------

    def _open_ledger(self, delta: float, log_dir: str | None, resumed_from: Path | None) -> None:
        """Open the ledger on the weights' privacy history (rank 0's), calibrate σ, and open this run's segment.

        A resumed run also counts the steps this run's newest ledger file took after the checkpoint.
        """
        settings, history = self.settings, self.history
        self._ledger.open(
            delta=delta, mechanism=settings.accountant, directory=log_dir if self.world.rank == 0 else None
        )
        if resumed_from is not None and self.world.rank == 0:
            self._count_steps_after_checkpoint(resumed_from, log_dir)
        history.load_state_dict(self.world.broadcast(history.state_dict()))  # rank 0's weights: its history
        accountant = self._accountant()
        accountant.load_state_dict({**accountant.state_dict(), "history": history.accountant_history()})
        planned = int(self._planned_steps) if math.isfinite(self._planned_steps) else None
        check_accountable(
            mechanism=settings.accountant, sample_rate=self._sample_rate, steps=planned, delta=delta,
            noise_multiplier=self._noise_multiplier, target_epsilon=settings.target_epsilon,
        )  # fmt: skip
        if settings.target_epsilon is not None:  # a resumed run keeps the σ its whole plan was calibrated for
            restored = self._ledger.restored_noise_multiplier
            self._noise_multiplier = restored if restored is not None else self._calibrate(delta)
        self._announce_history(resumed=resumed_from is not None)
        history.open_dp_segment(run_id=self._ledger.run_id, facts=self._segment_facts())

    def _count_steps_after_checkpoint(self, checkpoint: Path, log_dir: str | None) -> None:
        """Add to the history the DP steps this run's ledger file took after the resumed checkpoint (rank 0)."""
        folders = ledger_folders(checkpoint, log_dir)
        if not self._ledger.has_record(folders):
            self._warn(
                f"DP-SGD: {checkpoint} belongs to run {self._ledger.run_id}, whose privacy_ledger.json is not "
                "beside it (was the checkpoint copied or moved?): steps that run took after this checkpoint, if any, "
                "cannot be counted, so ε covers only the history the checkpoint carries; resume it in its run folder"
            )
            return
        found = self._ledger.steps_after_checkpoint(folders)
        if found is None:
            return
        extra, message = found
        note = "steps taken after the resumed checkpoint: their model was discarded, but they touched the data"
        facts = {**self._segment_facts(), "noise": "unknown", "noise_secure": True}
        self.history.record_dp_steps(extra, run_id=self._ledger.run_id, facts=facts, note=note)
        self._warn(message)

    def _announce_history(self, *, resumed: bool) -> None:
        """Say in one line that this run continues the weights' privacy history, and warn if they are not DP."""
        history, accountant = self.history, self._accountant()
        if history.dp_steps:
            bound = f", and {self.settings.flag_owner}.target_epsilon bounds the total" if self.settings.target_epsilon else ""
            origin = "a resumed checkpoint" if resumed else "earlier training"
            self._say(
                f"DP-SGD: these weights already took {history.dp_steps} DP steps ({origin}; ε={accountant.epsilon():.4g} "
                f"at δ={accountant.delta:.3g}): this run continues their privacy history{bound}"
            )
        reason = history.reason_not_private()
        if reason is not None:
            self._warn(
                f"DP-SGD: these weights are NOT differentially private, whatever this run does: {reason} (this run's "
                "steps are still accounted)"
            )

    def _calibrate(self, delta: float) -> float:
        """σ for which the weights' history plus this run's remaining planned steps spend ``target_epsilon``."""
        if not math.isfinite(self._planned_steps):
            raise ValueError(f"{self.settings.flag_owner}.target_epsilon needs a finite trainer.max_epochs or trainer.max_steps")
        target, rate = self.settings.target_epsilon, self._sample_rate
        assert target is not None and rate is not None
        prior = self.history.accountant_history()
        spent = self._accountant().epsilon() if prior else 0.0
        if prior and spent >= target:
            raise ValueError(
                f"{self.settings.flag_owner}.target_epsilon={target:g} is already spent: these weights' privacy history counts "
                f"{self.history.dp_steps} DP steps at ε={spent:.4g}; raise target_epsilon (it bounds the "
                "weights' total) or start from weights that never saw the data"
            )
        planned_here = int(self._planned_steps) - self._steps_done
        return calibrate_noise_multiplier(
            target_epsilon=target, delta=delta, sample_rate=rate, steps=max(1, planned_here),
            mechanism=self.settings.accountant, prior=prior,
        )  # fmt: skip

    def _unit_facts(self, *, public_only: bool = False) -> dict[str, Any]:
        """The privacy unit's facts: ``example``, or the user-level counts (the largest user's rows as a diagnostic).

        Args:
            public_only: leave the largest user's row count out even when ``private_diagnostics`` is on.
        """
        if self._user_level is None:
            return {"privacy_unit": "example"}
        return self._user_level.facts(private_diagnostics=self.settings.private_diagnostics and not public_only)

    def _segment_facts(self) -> dict[str, Any]:
        """This run's public parameters, as its segment of the weights' privacy history records them."""
        return {
            "max_grad_norm": self.settings.max_grad_norm,
            "dataset_size": self._dataset_size,
            "delta": self._accountant().delta,
            "mechanism": self.settings.accountant,
            "noise": self.noise_source.describe(),
            "noise_secure": self.noise_source.secure,
            **self._unit_facts(public_only=True),  # the weights' history holds no diagnostic (it outlives the run)
        }

    # --- checks ----------------------------------------------------------------------------------------------------

    def _check_delta(self, delta: float) -> None:
        """Refuse δ ≥ 1/N (it permits releasing whole examples) unless ``allow_large_delta``, and then warn."""
        size = self._dataset_size
        assert size is not None
        if delta < 1 / size:
            return
        message = (
            f"{self.settings.flag_owner}.target_delta={delta:.3g} is ≥ 1/N = {1 / size:.3g} for N={size} training "
            "examples: a δ that large permits releasing whole examples"
        )
        if not self.settings.allow_large_delta:
            raise ValueError(f"{message}; use δ ≤ N^-1.1 (the default) or set {self.settings.flag_owner}.allow_large_delta=true")
        self._warn(f"{message} (allowed by {self.settings.flag_owner}.allow_large_delta)")

    def _check_users_fit_a_micro_batch(self) -> None:
        """Refuse micro-batches smaller than k: a user's rows are clipped together, in one micro-batch."""
        level, size = self._user_level, self.settings.max_physical_batch_size
        if level is not None and size < level.max_rows_per_user:
            raise ValueError(
                f"{self.settings.flag_owner}.max_physical_batch_size={size} is below data.max_rows_per_user="
                f"{level.max_rows_per_user}: a user's rows are clipped together in one micro-batch"
            )

    def _check_ranks_hold_the_same_rows(self) -> None:
        """Refuse, on every rank, data-parallel ranks whose training datasets differ (in N or in any row).

        Each rank samples its own shard of the indices, which is one Poisson sample only if the datasets agree.
        """
        if self.world.size == 1 or self._rows is None:
            return
        local = rows_fingerprint(self._rows)
        if not self.world.all_agree(local == self.world.broadcast(local)):
            raise ValueError(
                "the training rows differ between data-parallel ranks (in number or content): each rank Poisson-samples "
                "its own shard of ONE dataset, so every rank must build the same rows in the same order; a random "
                "split, shuffle or subsample that is not seeded (or depends on the rank) is the likely cause: seed it"
            )

    def _started_buffer(self) -> GradientBuffer:
        if self._buffer is None:
            raise RuntimeError("DPSGD.start must run before clipping or releasing a step")
        return self._buffer

    def _accountant(self) -> PrivacyAccountant:
        if self._ledger.accountant is None:
            raise RuntimeError("DPSGD.start must run before the accountant is used")
        return self._ledger.accountant

    def _say(self, line: str) -> None:
        if self.world.rank == 0:
            log.info(line)

    def _warn(self, line: str) -> None:
        if self.world.rank == 0:
            warnings.warn(line, PrivacyWarning, stacklevel=3)


def clipping_engine(module: nn.Module, settings: DPSGDSettings) -> ClippingEngine:
    """The clipping engine ``settings.clipping`` names, built for ``module``."""
    options = {"tied_norm": settings.tied_norm} if settings.clipping == "ghost" else {}
    stability = (settings.automatic_stability or AUTOMATIC_STABILITY) if settings.clip_mode == "automatic" else None
    return build_engine(settings.clipping, module, max_grad_norm=settings.max_grad_norm, stability=stability, **options)


def batch_size(batch: Batch) -> int:
    """The number of examples in ``batch``."""
    return next(iter(batch.values())).shape[0]


def placeholder_example(batch: Batch) -> Batch:
    """One all-zero example shaped like ``batch``'s (at least one position): a forward pass that clips nothing real."""
    return {key: value.new_zeros((1, *(max(1, size) for size in value.shape[1:]))) for key, value in batch.items()}


def _contributing_nothing(loss_fn: PerExampleLoss) -> PerExampleLoss:
    """``loss_fn`` times zero: its per-example gradients are exactly zero (a non-finite one is dropped by the engine)."""
    return lambda batch: loss_fn(batch) * 0.0


def split_batch(batch: Batch, size: int) -> Iterator[Batch]:
    """Micro-batches of at most ``size`` rows (none for an empty batch); a user's rows are never split.

    With ``batch[UNIT_KEY]`` whole users are packed in order into micro-batches of at most ``size`` rows (a user
    has at most ``size`` rows: checked at start).
    """
    units = units_of(batch)
    if units is None:
        total = batch_size(batch)
        for start in range(0, total, size):
            yield {key: value[start : start + size] for key, value in batch.items()}
        return
    order = torch.argsort(units.unit, stable=True)  # rows grouped by user
    counts = torch.bincount(units.unit, minlength=units.count).tolist()
    chunk: list[Tensor] = []
    taken = 0
    for rows in order.split(counts):
        if taken and taken + len(rows) > size:
            yield {key: value[torch.cat(chunk)] for key, value in batch.items()}
            chunk, taken = [], 0
        chunk.append(rows)
        taken += len(rows)
    if chunk:
        yield {key: value[torch.cat(chunk)] for key, value in batch.items()}


def _size_and_rate(loader: DataLoader, size: int, *, users: bool) -> tuple[int, float]:
    """N and the Poisson rate q = batch_size / N (N rows, or users), refusing an empty set or a bad batch size."""
    batch = loader.batch_size
    if size == 0:
        raise ValueError("the training dataset is empty")
    if batch is None or not 0 < batch <= size:
        what = f"the expected users per batch, at most the {size} users" if users else f"at most the {size} rows"
        raise ValueError(f"data.batch_size must be in [1, {size}] ({what}), got {batch}")
    return size, batch / size


def _clip_text(settings: DPSGDSettings) -> str:
    """The start-up line's clipping: ``C=1.0 (fixed)``, ``C_0=1.0 (quantile: C follows the norms)`` or automatic."""
    bound, mode = settings.max_grad_norm, settings.clip_mode
    if mode == "quantile":
        return f"C_0={bound} (clip_mode quantile: C follows a quantile of the norms)"
    if mode == "automatic":
        return f"C={bound} (clip_mode automatic: a scale, not a bound)"
    return f"C={bound} (clip_mode fixed)"


def _check_same_dataset_size(restored: int | None, dataset_size: int) -> None:
    """Refuse resuming a run on a training set of another size: q = B/N, δ = N^-1.1 and ε all depend on N."""
    if restored is not None and restored != dataset_size:
        raise ValueError(
            f"the training set has {dataset_size} rows, but the checkpoint's run trained on {restored}: a resumed run "
            "must train on the same rows (its sampling rate q = data.batch_size / N, its default δ = N^-1.1 and its ε "
            "depend on N); resume with the same data, or start a new run from the exported model"
        )


def _register(hooks: OrderedDict[int, SumHook], hook: SumHook, *, prepend: bool) -> RemovableHandle:
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    if prepend:
        hooks.move_to_end(handle.id, last=False)
    return handle


def _call(hooks: OrderedDict[int, SumHook], dpsgd: DPSGD, flat_sum: Tensor) -> None:
    for hook in list(hooks.values()):
        hook(dpsgd, flat_sum)
