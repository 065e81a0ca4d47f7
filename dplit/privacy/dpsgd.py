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
    dpsgd.finish()                                 # ε, the ledger, and the weights' digest sealed in their history

The object holds its parts, each with one job: the clipping engine (per-unit norms and clipped sums), the clip
bound (:mod:`dplit.privacy.clip_bound`: fixed, quantile or automatic), the budget (:mod:`dplit.privacy.budget`:
ledger, history, σ, ε and the stop decision), the world (the ranks and their collectives) and the gradient buffer.
Two public hooks let audits and benchmarks attach without subclassing: :meth:`DPSGD.register_before_noise_hook`
(sees the clipped sum, before the noise) and :meth:`DPSGD.register_after_noise_hook` (sees the noisy sum that is
released, before the division by qN). Under data parallelism each rank clips its own Poisson shard, rank 0 draws the
noise and writes the ledger, and one all-reduce carries the sums, the noise, rank 0's stop flag and the noisy count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from dplit.privacy.accounting import PrivacyAccountant, default_delta
from dplit.privacy.budget import PrivacyBudget
from dplit.privacy.clip_bound import FixedBound, clip_bound_for, clipping_engine
from dplit.privacy.clipping.engine import Batch, ClippingEngine, ClipStats, PerExampleLoss, trainable_parameters
from dplit.privacy.clipping.self_check import FirstBatchCheck
from dplit.privacy.clipping.units import placeholder_example, require_units, split_batch
from dplit.privacy.fingerprint import IndexedRows
from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.noise import NoiseSource
from dplit.privacy.refusal import SettingError
from dplit.privacy.run_facts import (
    ledger_facts,
    mechanism_changes,
    packing_facts,
    row_unit_of,
    segment_facts,
    start_line,
    unit_facts,
)
from dplit.privacy.sampling import poisson_loader, size_and_rate
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings
from dplit.privacy.start_checks import check_start
from dplit.privacy.sum_hooks import SumHook, SumHooks
from dplit.privacy.training_state import StateWriteGuard, refuse_state_writing_modules
from dplit.privacy.user_sampling import UserLevel, user_level_of, user_poisson_loader
from dplit.privacy.warnings import say, warn
from dplit.privacy.world import SingleProcess, World

__all__ = ["DPSGD", "NO_NOISE_WARNING", "SumHook", "clipping_engine", "split_batch"]

STOP_SLOT, COUNT_SLOT = 0, 1
"""The all-reduce's two extra slots: rank 0's stop flag, and the quantile bound's centred count (noised once)."""
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
        weights_state: what the history's digest of the weights covers (default: ``module.state_dict``; a dplit
            task leaves out a quantised base, which checkpoints do not hold).
    """

    def __init__(
        self, module: nn.Module, settings: DPSGDSettings, *, history: PrivacyHistory,
        noise_source: NoiseSource | None = None, world: World | None = None, engine: ClippingEngine | None = None,
        weights_state: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        self.settings, self.history = settings, history
        self.noise_source = noise_source if noise_source is not None else NoiseSource(seed=settings.seed)
        self.world: World = world if world is not None else SingleProcess()
        self.world.check_settings(settings)
        self.engine = engine if engine is not None else clipping_engine(module, settings)
        self.engine.check_parameters()
        refuse_state_writing_modules(module)
        weights = weights_state if weights_state is not None else module.state_dict
        self.budget = PrivacyBudget(settings, history, self.world, self.facts, weights=weights)
        self.bound: FixedBound = FixedBound(settings.max_grad_norm)
        """The clip bound of ``settings.clip_mode`` (:func:`~dplit.privacy.clip_bound.clip_bound_for`, made by
        :meth:`sample`, which knows the expected batch; a resumed quantile run's C_t restored by :meth:`start`)."""
        self._module, self._state_guard = module, StateWriteGuard(module)
        self._started = False
        self.sample_rate: float | None = None
        """The Poisson rate q = expected logical batch size / N (set by :meth:`sample`)."""
        self.dataset_size: int | None = None
        """N, the training units Poisson sampling draws from (set by :meth:`sample`)."""
        self._rows: IndexedRows | None = None
        self._users: UserLevel | None = None
        self._unit = "example"  # without users: "example" or "pair" (each item of the dataset one unit)
        self._packing: dict[str, Any] = {}  # the packing collate function's facts (data.packing=true)
        self._restored: dict[str, Any] = {}  # the resumed checkpoint's ledger facts
        self._counting_open = False  # True while the before-noise hooks run: count_units may add to the count
        self._buffer: GradientBuffer | None = None
        self._buffer_handle: RemovableHandle | None = None
        examples = min(4, settings.max_physical_batch_size)
        self._self_check = FirstBatchCheck(self.engine, module, enabled=settings.self_check, examples=examples)
        self._before_noise, self._after_noise = SumHooks(), SumHooks()

    # --- Algorithm 1 -----------------------------------------------------------------------------------------------

    def sample(self, loader: DataLoader) -> DataLoader:
        """``loader`` with Poisson sampling at q = ``loader.batch_size`` / N (each rank draws its shard at rate q).

        A dataset that declares users (:func:`~dplit.privacy.user_sampling.user_level_of`) is sampled by user: N
        is the number of users, ``batch_size`` the expected users per batch, and each user is clipped as one unit.
        """
        self._users = user_level_of(loader.dataset)
        self._unit = row_unit_of(loader.dataset)
        self._packing = packing_facts(loader)
        if self._packing and self.settings.clipping != "ghost":
            raise SettingError(
                f"data.packing=true needs {self.settings.flag_owner}.clipping=ghost: the {self.settings.clipping} "
                "engine clips whole rows, and a packed row holds several documents"
            )
        units = self._users.users if self._users is not None else len(loader.dataset)  # type: ignore[arg-type]
        self.dataset_size, self.sample_rate = size_and_rate(loader, units, users=self._users is not None)
        self._rows = loader.dataset  # type: ignore[assignment]
        self.bound = clip_bound_for(self.settings, expected_batch=self.expected_batch_size)
        seed = self.noise_source.seed("sampling", steps=self.budget.steps)  # the sampler mixes in the rank
        where = {"num_replicas": self.world.size, "rank": self.world.rank, "seed": seed}
        if self._users is not None:  # q over users; a sampled user brings ≤ k rows
            return user_poisson_loader(loader, level=self._users, sample_rate=self.sample_rate, **where)
        return poisson_loader(loader, sample_rate=self.sample_rate, **where)

    def start(
        self, *, planned_steps: float, steps_done: int = 0, log_dir: str | None = None, resumed_from: Path | None = None
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
        if self.sample_rate is None or self.dataset_size is None:
            raise RuntimeError("DPSGD.start needs the training loader: call DPSGD.sample first")
        delta = self.settings.target_delta or default_delta(self.dataset_size)
        check_start(
            self.settings, self.world, delta=delta, dataset_size=self.dataset_size, rows=self._rows, users=self._users,
            restored_size=self.budget.ledger.restored_dataset_size,
        )  # fmt: skip
        self.budget.open(
            delta=delta, sample_rate=self.sample_rate, planned_steps=planned_steps, steps_done=steps_done,
            log_dir=log_dir, resumed_from=resumed_from, segment_facts=self._segment_facts,
        )  # fmt: skip
        self._started = True
        self._start_bound()
        self._buffer = self.world.gradient_buffer(list(trainable_parameters(self._module).values()), extra=2)
        if self._buffer_handle is not None:
            self._buffer_handle.remove()
        self._buffer_handle = self.engine.register_summed_hook(self._buffer.receive)
        self._say_mechanism_changes()
        self.history.open_dp_segment(run_id=self.budget.ledger.run_id, facts=self._segment_facts())
        self._announce(delta)
        return self.budget.begin()

    def clip(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Sum every unit's clipped gradient into the buffer, ``max_physical_batch_size`` rows at a time.

        Returns:
            The logical batch's per-unit losses and gradient norms (before clipping): private, unnoised.
        """
        buffer = self._started_buffer()
        require_units(batch, by_user=self._users is not None)
        losses, norms = [], []
        self._state_guard.arm()
        micro_batches = list(split_batch(batch, self.settings.max_physical_batch_size))  # a unit's rows stay together
        placeholders = self.world.micro_batch_count(len(micro_batches)) - len(micro_batches)
        with buffer.receiving():  # every param.grad is a view into the buffer: the engine's sums land in it
            if self._self_check(loss_fn, batch):
                say(self.world, "DP-SGD: ghost clipping self-check passed (per-parameter norms agree with autograd)")
            for micro_batch in micro_batches:
                stats = self.engine.accumulate(loss_fn, micro_batch)
                losses.append(stats.losses)
                norms.append(stats.norms)
                self.bound.count(stats.norms)
            for _ in range(placeholders):  # sharded weights: every rank runs every forward pass, these add zero
                self.engine.accumulate(lambda rows: loss_fn(rows) * 0.0, placeholder_example(batch))
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
        buffer = self._started_buffer()
        stop_after = not self.budget.next_step_fits()
        self._counting_open = True
        try:
            self._before_noise(self, buffer.gradients)
        finally:
            self._counting_open = False
        buffer.extra[STOP_SLOT] = float(stop_after)
        buffer.extra[COUNT_SLOT] = self.bound.local_count(self._count_noise)
        std = self.gradient_noise_multiplier * self.bound.bound  # the claimed C_t, whatever the engine clipped to
        steps, device = self.budget.steps, buffer.flat.device
        generator = lambda rank: self.noise_source.step_generator(rank, steps=steps, device=device)  # noqa: E731
        self.world.noisy_sum(buffer, std=std, generator=generator)
        buffer.refuse_non_finite(step=self.budget.steps + 1)
        self._after_noise(self, buffer.gradients)
        stop = bool(buffer.extra[STOP_SLOT] > 0)  # rank 0's decision, so every rank stops after the same step
        self.bound.update(float(buffer.extra[COUNT_SLOT]), self.expected_batch_size)  # C_{t+1}, the same everywhere
        self.engine.set_max_grad_norm(self.bound.bound)
        self.history.note_open_segment(**self.bound.facts())
        buffer.publish(self.expected_batch_size)
        self.budget.account(stop=stop)
        return stop

    def finish(self) -> None:
        """Bring ε up to date, write the ledger file and close this run's segment (at the end of training)."""
        self.budget.finish()
        self.close_segment()

    def close_segment(self, *, interrupted: bool = False) -> None:
        """End this run's segment of the weights' history, sealing the weights' digest (see :class:`PrivacyBudget`)."""
        if self._started:
            self.budget.close_segment(interrupted=interrupted)

    # --- hooks -----------------------------------------------------------------------------------------------------

    def register_before_noise_hook(self, hook: SumHook, *, prepend: bool = False) -> RemovableHandle:
        """Call ``hook(self, clipped_sum)`` on every rank after clipping, before the noise is added."""
        return self._before_noise.register(hook, prepend=prepend)

    def register_after_noise_hook(self, hook: SumHook, *, prepend: bool = False) -> RemovableHandle:
        """Call ``hook(self, noisy_sum)`` on every rank once the noisy sum is summed over ranks, before ÷ qN."""
        return self._after_noise.register(hook, prepend=prepend)

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
        self.bound.count(norms)

    # --- what a run is ---------------------------------------------------------------------------------------------

    @property
    def noise_multiplier(self) -> float | None:
        """σ in use (calibrated from ``target_epsilon`` by :meth:`start`; before it, the setting)."""
        return self.budget.noise_multiplier if self._started else self.settings.noise_multiplier

    @property
    def gradient_noise_multiplier(self) -> float:
        """The gradient's noise std in units of C: σ, or σ_eff ≥ σ under quantile clipping (the count takes a share)."""
        return self.bound.gradient_noise_multiplier(self.budget.noise_multiplier)

    @property
    def clip_bound(self) -> float:
        """The clipping bound C the mechanism claims for the next step: ``max_grad_norm``, or C_t under quantile."""
        return self.bound.bound

    @property
    def expected_batch_size(self) -> float:
        """q·N: the global logical batch size the noisy sum is divided by."""
        assert self.sample_rate is not None and self.dataset_size is not None, "DPSGD.sample first"
        return self.sample_rate * self.dataset_size

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The run's accountant: the weights' whole history plus this run's steps (``None`` before :meth:`start`)."""
        return self.budget.ledger.accountant

    @property
    def gradient_buffer(self) -> GradientBuffer:
        """The buffer this rank's clipped sums are summed into (made by :meth:`start`, one per trainable set)."""
        return self._started_buffer()

    # --- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The ledger as checkpoints keep it: the accountant's history and the run's public facts (never a seed)."""
        return self.budget.ledger.state(self.facts())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's ledger (its run id, steps, σ and N, C_t): :meth:`start` picks it up."""
        self.budget.ledger.restore(state)
        self._restored = dict(state)

    def facts(self) -> dict[str, Any]:
        """What the ledger records beside the accountant's history (never a seed)."""
        return {**ledger_facts(
            self.settings, history=self.history, noise=self.noise_source, bound=self.bound, users=self._users,
            sigma=self.noise_multiplier, sample_rate=self.sample_rate, dataset_size=self.dataset_size,
            epsilon_steps=self.budget.epsilon_steps, unit=self._unit,
        ), **self._packing}  # fmt: skip

    # --- inside ----------------------------------------------------------------------------------------------------

    def _start_bound(self) -> None:
        """A resumed run's C_t (quantile mode: continued, not reset), and σ_eff checked before any step."""
        if self._restored.get("clip_mode") == self.bound.mode:
            self.bound.load_state_dict(self._restored)
        self.engine.set_max_grad_norm(self.bound.bound)
        self.bound.gradient_noise_multiplier(self.budget.noise_multiplier)  # refuses σ_b too small, now

    def _count_noise(self, std: float) -> float:
        """N(0, σ_b²) for the quantile count, drawn on rank 0 only (summed over ranks: noised once); 0 without σ."""
        drawn = self.world.rank == 0 and self.budget.noise_multiplier
        return self.noise_source.count_noise(std, steps=self.budget.steps) if drawn else 0.0

    def _announce(self, delta: float) -> None:
        say(self.world, start_line(self.settings, sigma=self.budget.noise_multiplier, sample_rate=self.sample_rate or 0.0,
                                   expected=self.expected_batch_size, delta=delta, steps=self.budget.steps,
                                   noise=self.noise_source, unit="user" if self._users is not None else self._unit))  # fmt: skip
        if self.budget.noise_multiplier == 0:
            warn(self.world, NO_NOISE_WARNING.replace(FLAG_OWNER, self.settings.flag_owner, 1))

    def _segment_facts(self) -> dict[str, Any]:
        return segment_facts(
            self.settings, dataset_size=self.dataset_size, delta=self.budget.accountant.delta, noise=self.noise_source,
            users=self._users, bound=self.bound, unit=self._unit,
        )  # fmt: skip

    def _say_mechanism_changes(self) -> None:
        """Say in one line what a resume changes of the resumed run's mechanism (clipping mode, C, k)."""
        now = {
            **unit_facts(self._users, diagnostics=False, unit=self._unit),
            **self.bound.facts(),
            "max_grad_norm": self.settings.max_grad_norm,
        }
        changes = mechanism_changes(self._restored, now, mode=self.bound.mode)
        if changes is not None:
            run = self.budget.ledger.run_id
            warn(self.world, f"DP-SGD: this resume changes the mechanism of run {run}: {changes} (the weights' "
                 "privacy history records each segment's own)")  # fmt: skip

    def _started_buffer(self) -> GradientBuffer:
        if self._buffer is None:
            raise RuntimeError("DPSGD.start must run before clipping or releasing a step")
        return self._buffer
