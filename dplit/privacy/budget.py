"""PrivacyBudget: one run's ledger on the weights' privacy history: σ, ε so far, and when the run must stop.

It opens the run's ledger on the history the weights carry (every earlier fit, resume and refit, and the steps a
resumed run's ledger file took after its checkpoint), verifies the weights against that history, calibrates σ so
that the whole history spends at most ``target_epsilon`` over the plan, accounts each step, refreshes ε for the logs
while that stays cheap, and decides, before each step, whether it still fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dplit.privacy.accounting import PrivacyAccountant, calibrate_noise_multiplier, check_accountable
from dplit.privacy.composition import mixed_epsilon, mixed_units, smallest_delta
from dplit.privacy.history import PrivacyHistory
from dplit.privacy.ledger import RunLedger, ledger_folders
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.warnings import say, warn
from dplit.privacy.weights_content import content_digest
from dplit.privacy.world import World

EPSILON_OVERHEAD = 0.02
"""The largest share of a run's time spent computing ε for the logs and the ledger file between its first and last
steps (one PRV ε costs 0.1-1.5 s on a CPU core, a step on a GPU far less). The budget never waits on this: it is
decided from the steps verified to fit, and the card's ε is always computed from the whole history."""


class PrivacyBudget:
    """The run's ledger, σ, ε and stop decision, continuing the weights' privacy history.

    Args:
        settings: the run's knobs (``noise_multiplier`` or ``target_epsilon``, δ, accountant, ``public_change``).
        history: the weights' privacy history, continued by this run.
        world: the ranks (rank 0 writes the ledger and decides; its history is every rank's).
        facts: what the ledger file records beside the accountant's history (the run's public facts).
        weights: the state dict the history's digest of the weights covers.
    """

    def __init__(
        self, settings: DPSGDSettings, history: PrivacyHistory, world: World, facts: Callable[[], dict[str, Any]],
        *, weights: Callable[[], Mapping[str, Any]],
    ) -> None:  # fmt: skip
        self.settings, self.history, self.world, self._facts, self._weights = settings, history, world, facts, weights
        self.ledger = RunLedger()
        self.noise_multiplier = float(settings.noise_multiplier or 0.0)
        """σ (calibrated from ``target_epsilon`` by :meth:`open`)."""
        self.sample_rate = 0.0
        self.epsilon_spent, self.epsilon_steps = 0.0, 0
        self.should_stop = False
        """Whether the next step would spend more than ``target_epsilon``."""
        self._planned, self._done, self._at_start, self._verified = math.inf, 0, 0, 0
        self._accounting_seconds, self._started_at = 0.0, time.perf_counter()
        self._mixed = False  # the history mixes units: ε composes by relation (dp-accounting), per example

    @property
    def accountant(self) -> PrivacyAccountant:
        """The accountant: the weights' whole history plus this run's steps (after :meth:`open`)."""
        if self.ledger.accountant is None:
            raise RuntimeError("DPSGD.start must run before the accountant is used")
        return self.ledger.accountant

    @property
    def steps(self) -> int:
        """DP steps the accountant counts (a restored checkpoint's included)."""
        return self.ledger.steps

    @property
    def steps_this_run(self) -> int:
        """DP steps taken since :meth:`begin`."""
        return self.ledger.steps - self._at_start

    # --- opening --------------------------------------------------------------------------------------------------

    def open(
        self, *, delta: float, sample_rate: float, planned_steps: float, steps_done: int, log_dir: str | None,
        resumed_from: Path | None, segment_facts: Callable[[], dict[str, Any]],
    ) -> None:  # fmt: skip
        """Open the ledger on rank 0's verified history and set σ (calibrated for the plan, or a resumed run's)."""
        settings, history = self.settings, self.history
        self.sample_rate, self._planned, self._done = sample_rate, planned_steps, steps_done
        directory = log_dir if self.world.rank == 0 else None
        self.ledger.open(delta=delta, mechanism=settings.accountant, directory=directory)
        if resumed_from is not None and self.world.rank == 0:
            self._count_steps_after_checkpoint(resumed_from, log_dir, segment_facts())
        history.abandon_open_segment()  # an earlier run's segment never finished explains nothing now
        change = history.verify(
            self._weights_digest(), where="found before a DP-SGD fit", public_change=settings.public_change
        )
        if change is not None:
            warn(self.world, f"DP-SGD: {change}")
        history.load_state_dict(self.world.broadcast(history.state_dict()))  # rank 0's weights: its history
        self.accountant.load_state_dict({**self.accountant.state_dict(), "history": history.accountant_history()})
        self._mixed = mixed_units([*history.segments, {"kind": "dp", **segment_facts()}])
        if self._mixed and settings.target_epsilon is not None:
            raise ValueError(
                f"{settings.flag_owner}.target_epsilon cannot bound a privacy history that mixes units (these weights "
                "took steps over users and over rows; per example, the user-level steps compose as replace-one): "
                f"give {settings.flag_owner}.noise_multiplier instead, and read ε on the card"
            )
        check_accountable(
            mechanism=settings.accountant, sample_rate=sample_rate, delta=delta, target_epsilon=settings.target_epsilon,
            steps=int(planned_steps) if math.isfinite(planned_steps) else None, noise_multiplier=settings.noise_multiplier,
        )  # fmt: skip
        if settings.target_epsilon is not None:  # a resumed run keeps the σ its whole plan was calibrated for
            restored = self.ledger.restored_noise_multiplier
            self.noise_multiplier = restored if restored is not None else self._calibrate(delta)
        self._announce_history(resumed=resumed_from is not None)

    def begin(self) -> bool:
        """Start counting this run's steps; whether the budget is already spent (no step may be taken)."""
        self._at_start = self._verified = self.ledger.steps
        self._started_at = time.perf_counter()
        self._refresh_epsilon()
        if self._at_start:  # a resumed run always has a ledger file, even if it takes no step
            self.ledger.write(self._facts(), epsilon=self.epsilon_spent)
        if math.isfinite(self._planned):  # σ was calibrated for the plan: verify it once, not at every step
            self.within(self.ledger.steps + max(0, int(self._planned) - self._done))
        if self.world.broadcast(not self.within(self.ledger.steps + 1)):  # rank 0's decision
            self.stop()
        return self.should_stop

    # --- each step ------------------------------------------------------------------------------------------------

    def next_step_fits(self) -> bool:
        """Whether the step after this one still fits (rank 0 decides; the other ranks say yes).

        Raises:
            ValueError: for this step itself over the budget (only a trainer forcing steps past the stop gets here).
        """
        upcoming = self.ledger.steps + 1
        if not self.within(upcoming):
            raise ValueError(
                f"trainer.min_steps / trainer.min_epochs forced DP step {upcoming}, which would spend "
                f"ε={self.epsilon_after(1):.4f} > {self.settings.flag_owner}.target_epsilon="
                f"{self.settings.target_epsilon}: stopped before it"
            )
        return self.world.rank != 0 or self.within(upcoming + 1)

    def account(self, *, stop: bool) -> None:
        """Count the step just released (accountant and history), refresh ε when due, write the ledger file."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.history.record_dp_step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self._done += 1
        if stop or self._epsilon_due():
            self._refresh_epsilon()
        self.ledger.write(self._facts(), epsilon=self.epsilon_spent)
        if stop:
            self.stop()

    def finish(self) -> None:
        """Bring ε up to date and write the ledger file."""
        if self.ledger.accountant is not None and self.epsilon_steps != self.ledger.steps:
            self._refresh_epsilon()
            self.ledger.write(self._facts(), epsilon=self.epsilon_spent)

    def close_segment(self, *, interrupted: bool = False) -> None:
        """End this run's segment of the weights' history and seal the weights' digest.

        Args:
            interrupted: with several processes no collective may run then: weights every rank holds whole are
                hashed locally; sharded ones are not (the next boundary verifies against the last seal).
        """
        if not interrupted or self.world.size == 1:
            self.history.close_dp_segment(self._weights_digest())
            return
        try:
            self.history.close_dp_segment(content_digest(self._weights()))
        except ValueError:  # sharded weights
            self.history.close_dp_segment(None)

    def within(self, steps: int) -> bool:
        """Whether ``steps`` DP steps in all (this run's σ, q from now on) spend at most ``target_epsilon``.

        ε grows with every step, so a count verified once needs no accountant call again: only a step past the most
        verified so far costs one (a plan's whole count is verified by :meth:`begin`).
        """
        target = self.settings.target_epsilon
        if target is None or steps <= self._verified:
            return True
        if self.epsilon_after(steps - self.ledger.steps) > target * (1 + 1e-9):
            return False
        self._verified = steps
        return True

    def epsilon_after(self, steps: int) -> float:
        """ε after ``steps`` more steps at this run's (σ, q)."""
        return self.accountant.epsilon(
            extra_steps=steps, noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate
        )

    def stop(self) -> None:
        """Stop before a step that would spend more than ``target_epsilon``; say so unless the plan ends here."""
        self.should_stop = True
        if self._done >= self._planned:
            return
        warn(
            self.world,
            f"DP-SGD: privacy budget spent: ε={self.epsilon_spent:.4f} of target_epsilon="
            f"{self.settings.target_epsilon} after {self.ledger.steps} DP steps; the next step would spend "
            f"ε={self.epsilon_after(1):.4f}, so training stops here",
        )

    # --- inside ---------------------------------------------------------------------------------------------------

    def _weights_digest(self) -> str:
        """The weights' content digest (every rank takes part when they are sharded)."""
        return content_digest(self._weights(), gather=self.world.gather)

    def _epsilon_due(self) -> bool:
        """Whether ε is refreshed after this step: the run's first and last planned steps, else while it is cheap."""
        if self.steps_this_run == 1 or self._done >= self._planned:
            return True
        return self._accounting_seconds <= EPSILON_OVERHEAD * (time.perf_counter() - self._started_at)

    def history_epsilon(self) -> float:
        """ε of the weights' whole history so far: the accountant's, or, for mixed units, composed by relation."""
        if not self._mixed:
            return self.accountant.epsilon()
        segments = self.history.segments
        return mixed_epsilon(segments, delta=smallest_delta(segments, default=self.accountant.delta) or 0.0)

    def _refresh_epsilon(self) -> None:
        begin = time.perf_counter()
        self.epsilon_spent = self.history_epsilon() if self.ledger.steps else 0.0
        self.epsilon_steps = self.ledger.steps
        self._accounting_seconds += time.perf_counter() - begin

    def _count_steps_after_checkpoint(self, checkpoint: Path, log_dir: str | None, facts: dict[str, Any]) -> None:
        """Add to the history the DP steps this run's ledger file took after the resumed checkpoint (rank 0)."""
        folders = ledger_folders(checkpoint, log_dir)
        if not self.ledger.has_record(folders):
            warn(
                self.world,
                f"DP-SGD: {checkpoint} belongs to run {self.ledger.run_id}, whose privacy_ledger.json is not beside it "
                "(was the checkpoint copied or moved?): steps that run took after this checkpoint, if any, cannot be "
                "counted, so ε covers only the history the checkpoint carries; resume it in its run folder",
            )
            return
        found = self.ledger.steps_after_checkpoint(folders)
        if found is None:
            return
        extra, message = found
        note = "steps taken after the resumed checkpoint: their model was discarded, but they touched the data"
        facts = {**facts, "noise": "unknown", "noise_secure": True}
        self.history.record_dp_steps(extra, run_id=self.ledger.run_id, facts=facts, note=note)
        warn(self.world, message)

    def _announce_history(self, *, resumed: bool) -> None:
        """Say in one line that this run continues the weights' privacy history, and warn if they are not DP."""
        history, accountant, owner = self.history, self.accountant, self.settings.flag_owner
        if history.dp_steps:
            bound = f", and {owner}.target_epsilon bounds the total" if self.settings.target_epsilon else ""
            origin = "a resumed checkpoint" if resumed else "earlier training"
            say(
                self.world,
                f"DP-SGD: these weights already took {history.dp_steps} DP steps ({origin}; ε={self.history_epsilon():.4g} "
                f"at δ={accountant.delta:.3g}): this run continues their privacy history{bound}",
            )
        reason = history.reason_not_private()
        if reason is not None:
            warn(
                self.world,
                f"DP-SGD: these weights are NOT differentially private, whatever this run does: {reason} (this run's "
                "steps are still accounted)",
            )

    def _calibrate(self, delta: float) -> float:
        """σ for which the weights' history plus this run's remaining planned steps spend ``target_epsilon``."""
        owner, target = self.settings.flag_owner, self.settings.target_epsilon
        if not math.isfinite(self._planned):
            raise ValueError(f"{owner}.target_epsilon needs a finite trainer.max_epochs or trainer.max_steps")
        assert target is not None
        prior = self.history.accountant_history()
        spent = self.accountant.epsilon() if prior else 0.0
        if prior and spent >= target:
            raise ValueError(
                f"{owner}.target_epsilon={target:g} is already spent: these weights' privacy history counts "
                f"{self.history.dp_steps} DP steps at ε={spent:.4g}; raise target_epsilon (it bounds the weights' "
                "total) or start from weights that never saw the data"
            )
        return calibrate_noise_multiplier(
            target_epsilon=target, delta=delta, sample_rate=self.sample_rate, steps=max(1, int(self._planned) - self._done),
            mechanism=self.settings.accountant, prior=prior,
        )  # fmt: skip
