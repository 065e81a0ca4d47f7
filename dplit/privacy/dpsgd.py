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

The object holds its parts, one job each: the units, the clipping engine, the clip bound, the budget (ledger, history,
σ, ε, the stop), the world (the ranks, rank 0 draws the noise) and the gradient buffer. Audits attach through two
public hooks (the clipped sum before the noise, the noisy sum after it), never by subclassing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
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
from dplit.privacy.gradient_buffer import GradientBuffer
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.noise import NoiseSource
from dplit.privacy.run_facts import NO_NOISE_WARNING, ledger_facts, mechanism_changes, segment_facts, start_line
from dplit.privacy.settings import FLAG_OWNER, DPSGDSettings
from dplit.privacy.start_checks import check_start
from dplit.privacy.sum_hooks import SumHook, SumHooks
from dplit.privacy.training_state import StateWriteGuard, refuse_state_writing_modules
from dplit.privacy.training_units import TrainingUnits
from dplit.privacy.warnings import say, warn
from dplit.privacy.world import SingleProcess, World

__all__ = ["DPSGD", "NO_NOISE_WARNING", "SumHook"]

STOP_SLOT, COUNT_SLOT = 0, 1
"""The all-reduce's two extra slots: rank 0's stop flag, and the quantile bound's centred count (noised once)."""
EXTRA_SLOTS = 2


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
        """The clip bound of ``settings.clip_mode`` (made by :meth:`sample`; a resumed C_t restored by :meth:`start`)."""
        self._module, self._state_guard = module, StateWriteGuard(module)
        self._started = False
        self.units: TrainingUnits | None = None
        """What is sampled, clipped and counted, N of them at rate q (set by :meth:`sample`)."""
        self._restored: dict[str, Any] = {}  # the resumed checkpoint's ledger facts
        self._buffer: GradientBuffer | None = None  # made by start(): the engine's sums land in it
        self.engine.register_summed_hook(lambda param: self._buffer.receive(param) if self._buffer else None)
        examples = min(4, settings.max_physical_batch_size)
        self._self_check = FirstBatchCheck(self.engine, module, enabled=settings.self_check, examples=examples)
        self._before_noise, self._after_noise = SumHooks(), SumHooks()

    # --- Algorithm 1 -----------------------------------------------------------------------------------------------

    def sample(self, loader: DataLoader) -> DataLoader:
        """``loader`` drawing Poisson batches of its units (examples, pairs or users) at q = ``batch_size`` / N."""
        self.units = TrainingUnits.of(loader)
        self.bound = clip_bound_for(self.settings, expected_batch=self.expected_batch_size)
        seed = self.noise_source.seed("sampling", steps=self.budget.steps)  # the sampler mixes in the rank
        return self.units.poisson_loader(loader, num_replicas=self.world.size, rank=self.world.rank, seed=seed)

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
        units = self._sampled_units()
        delta = self.settings.target_delta or default_delta(units.size)
        check_start(self.settings, self.world, delta=delta, units=units, ledger=self.budget.ledger)
        self.budget.open(
            delta=delta, sample_rate=units.sample_rate, planned_steps=planned_steps, steps_done=steps_done,
            log_dir=log_dir, resumed_from=resumed_from, segment_facts=self._segment_facts,
        )  # fmt: skip
        self._started, sigma = True, self.budget.noise_multiplier
        self.bound.resume(self._restored, noise_multiplier=sigma)
        self.engine.set_max_grad_norm(self.bound.bound)
        self._buffer = self.world.gradient_buffer(list(trainable_parameters(self._module).values()), extra=EXTRA_SLOTS)
        run_id = self.budget.ledger.run_id
        change = mechanism_changes(self._restored, run_id=run_id, settings=self.settings, units=units, bound=self.bound)
        if change is not None:
            warn(self.world, change)
        self.history.open_dp_segment(run_id=self.budget.ledger.run_id, facts=self._segment_facts())
        steps, noise = self.budget.steps, self.noise_source
        say(self.world, start_line(self.settings, sigma=sigma, units=units, delta=delta, steps=steps, noise=noise))
        if sigma == 0:
            warn(self.world, NO_NOISE_WARNING.replace(FLAG_OWNER, self.settings.flag_owner, 1))
        return self.budget.begin()

    def clip(self, loss_fn: PerExampleLoss, batch: Batch) -> ClipStats:
        """Sum every unit's clipped gradient into the buffer, ``max_physical_batch_size`` rows at a time.

        Returns:
            The logical batch's per-unit losses and gradient norms (before clipping): private, unnoised.
        """
        buffer = self._started_buffer()
        require_units(batch, by_user=self._sampled_units().users is not None)
        micro_batches = list(split_batch(batch, self.settings.max_physical_batch_size))  # a unit's rows stay together
        placeholders = self.world.micro_batch_count(len(micro_batches)) - len(micro_batches)
        self._state_guard.arm()
        with buffer.receiving():  # every param.grad is a view into the buffer: the engine's sums land in it
            if self._self_check(loss_fn, batch):
                say(self.world, "DP-SGD: ghost clipping self-check passed (per-parameter norms agree with autograd)")
            stats = [self.engine.accumulate(loss_fn, micro_batch) for micro_batch in micro_batches]
            for _ in range(placeholders):  # sharded weights: every rank runs every forward pass, these add zero
                self.engine.accumulate(lambda rows: loss_fn(rows) * 0.0, placeholder_example(batch))
        self._state_guard.check()  # before any noise or step: nothing written from private data is released
        if not stats:  # no micro-batch on this rank (an empty Poisson sample)
            return ClipStats(losses=buffer.flat.new_zeros(0), norms=buffer.flat.new_zeros(0))
        norms = torch.cat([part.norms for part in stats])
        self.bound.count(norms)
        return ClipStats(losses=torch.cat([part.losses for part in stats]), norms=norms)

    def release(self) -> bool:
        """Add N(0, σ²C²) once (rank 0), sum over ranks, divide by qN, set every ``param.grad``, and account the step.

        Returns:
            Whether training must stop after this step (the next one would spend more than ``target_epsilon``).
        """
        buffer = self._started_buffer()
        self._before_noise(self, buffer.gradients)
        buffer.extra[STOP_SLOT] = float(not self.budget.next_step_fits())
        drawn = self.world.rank == 0 and bool(self.budget.noise_multiplier)  # the count is noised once, on rank 0
        count_noise = partial(self.noise_source.count_noise, steps=self.budget.steps) if drawn else lambda _: 0.0
        buffer.extra[COUNT_SLOT] = self.bound.local_count(count_noise)
        std = self.gradient_noise_multiplier * self.bound.bound  # the claimed C_t, whatever the engine clipped to
        generator = partial(self.noise_source.step_generator, steps=self.budget.steps, device=buffer.flat.device)
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
        """Count units joining this step outside the engine (an audit's canaries) in quantile mode's noisy count.

        Call it once, from a before-noise hook, on the one rank that adds those units, with each unit's gradient norm
        (a unit counted twice would double its sensitivity); a no-op in the other modes.

        Raises:
            RuntimeError: called outside a before-noise hook.
        """
        if not self._before_noise.running:
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
        return self._sampled_units().expected_batch_size

    @property
    def sample_rate(self) -> float | None:
        """The Poisson rate q (``None`` before :meth:`sample`)."""
        return self.units.sample_rate if self.units is not None else None

    @property
    def dataset_size(self) -> int | None:
        """N, the units Poisson sampling draws from (``None`` before :meth:`sample`)."""
        return self.units.size if self.units is not None else None

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
        return ledger_facts(
            self.settings, history=self.history, noise=self.noise_source, bound=self.bound, units=self.units,
            sigma=self.noise_multiplier, epsilon_steps=self.budget.epsilon_steps,
        )  # fmt: skip

    # --- inside ----------------------------------------------------------------------------------------------------

    def _segment_facts(self) -> dict[str, Any]:
        delta = self.budget.accountant.delta
        return segment_facts(self.settings, units=self.units, delta=delta, noise=self.noise_source, bound=self.bound)

    def _sampled_units(self) -> TrainingUnits:
        if self.units is None:
            raise RuntimeError("DPSGD needs the training units: call DPSGD.sample first")
        return self.units

    def _started_buffer(self) -> GradientBuffer:
        if self._buffer is None:
            raise RuntimeError("DPSGD.start must run before clipping or releasing a step")
        return self._buffer
