"""PrivacyHistory: every step that touched a model's weights, kept with the weights rather than with a run.

A model's released ε must count every DP-SGD step its weights took (every fit, resume and refit, with every
noise source) and must say "not differentially private" once a single step was taken without DP-SGD. The
history is a list of segments, each a plain dict (so it travels in ``state_dict()``, checkpoints, ledgers and
``dp_guarantee.json``):

* ``{"kind": "dp", "run_id", "accountant": [[σ, q, steps], ...], "max_grad_norm", "dataset_size", "delta",
  "mechanism", "noise", "noise_secure", "note"}``: DP-SGD steps of one fit (a resume opens a new segment);
* ``{"kind": "non_private", "steps", "reason"}``: optimizer steps taken without DP-SGD, or weights of unknown
  history; one such segment makes the weights non-private for good.

Nothing here is computed from the training data: σ, q, C, N and step counts are public parameters of the run.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dplit.privacy.accounting import History
from dplit.privacy.ledger import CHECKPOINT_KEY

Segment = dict[str, Any]

NON_PRIVATE_STEP = "optimizer steps taken without dplit.strategy.DPStrategy (no clipping, no noise)"
HISTORY_KEY = "dplit_privacy_history"
"""The checkpoint entry holding the weights' :meth:`PrivacyHistory.state_dict` (written by the module)."""
UNKNOWN_HISTORY = "trained without dplit.strategy.DPStrategy before dplit kept a privacy history with the weights"
GUARANTEE_FILE = "dp_guarantee.json"
"""The machine-readable guarantee of a dplit export (its ``privacy_history`` is inherited by a model built on it)."""


class PrivacyHistory:
    """The privacy history of one set of weights: DP segments and non-private steps, oldest first.

    The strategy calls :meth:`open_dp_segment` at the start of a fit and :meth:`record_dp_step` at every DP step;
    the module's optimizers call :meth:`optimizer_stepped` after every step, which counts a step that no DP step
    announced as non-private.
    """

    def __init__(self, segments: Iterable[Segment] = ()) -> None:
        self._segments: list[Segment] = [copy.deepcopy(dict(segment)) for segment in segments]
        self._open: Segment | None = None
        self._dp_step_pending = False

    # --- what the history says ----------------------------------------------------------------------------------

    @property
    def segments(self) -> list[Segment]:
        """A copy of every segment with at least one step, oldest first."""
        return copy.deepcopy(self._segments)

    @property
    def dp_steps(self) -> int:
        """DP-SGD steps over every DP segment."""
        return sum(segment_steps(segment) for segment in self._segments if segment["kind"] == "dp")

    @property
    def non_private_steps(self) -> int:
        """Steps taken without DP-SGD (or of unknown history)."""
        return sum(segment_steps(segment) for segment in self._segments if segment["kind"] != "dp")

    @property
    def noise_secure(self) -> bool:
        """Whether every DP segment drew its noise from an unpredictable source."""
        return all(segment["noise_secure"] for segment in self._segments if segment["kind"] == "dp")

    def accountant_history(self) -> History:
        """Every DP segment's (σ, q, steps), in order, equal neighbours merged: what an accountant composes."""
        merged: History = []
        for segment in self._segments:
            for sigma, rate, count in segment["accountant"] if segment["kind"] == "dp" else []:
                if merged and merged[-1][:2] == (sigma, rate):
                    merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + int(count))
                else:
                    merged.append((float(sigma), float(rate), int(count)))
        return merged

    def reason_not_private(self) -> str | None:
        """Why these weights are not differentially private whatever ε says (``None``: nothing found)."""
        non_private = [segment for segment in self._segments if segment["kind"] != "dp"]
        if non_private:
            reasons = "; ".join(sorted({segment["reason"] for segment in non_private}))
            return f"{self.non_private_steps} of the weights' steps were not private: {reasons}"
        predictable = [seg for seg in self._segments if seg["kind"] == "dp" and not seg["noise_secure"]]
        if predictable:
            steps = sum(segment_steps(segment) for segment in predictable)
            return (
                f"{steps} of the weights' DP steps drew predictable noise (DPStrategy.seed set in "
                f"{len(predictable)} segment(s)): their noise is known to anyone with the config"
            )
        return None

    # --- what training adds ---------------------------------------------------------------------------------------

    def open_dp_segment(self, *, run_id: str, facts: dict[str, Any], note: str | None = None) -> None:
        """Start a DP segment (one fit or one resume); it enters the history with its first step.

        Args:
            run_id: the training run's id (kept across its resumes).
            facts: the segment's public parameters: ``max_grad_norm``, ``dataset_size``, ``delta``, ``mechanism``,
                ``noise`` (how it was seeded) and ``noise_secure``.
            note: why the segment exists, when it is not a plain fit (e.g. steps adopted from a ledger).
        """
        self._open = {"kind": "dp", "run_id": run_id, "accountant": [], **facts, **({"note": note} if note else {})}
        self._dp_step_pending = False

    def record_dp_step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Count one DP step of the open segment; the optimizer step that follows is that step."""
        if self._open is None:
            raise RuntimeError("PrivacyHistory.record_dp_step before open_dp_segment")
        if not any(segment is self._open for segment in self._segments):
            self._segments.append(self._open)
        entries = self._open["accountant"]
        if entries and entries[-1][0] == noise_multiplier and entries[-1][1] == sample_rate:
            entries[-1][2] += 1
        else:
            entries.append([float(noise_multiplier), float(sample_rate), 1])
        self._dp_step_pending = True

    def record_dp_steps(self, history: History, *, run_id: str, facts: dict[str, Any], note: str) -> None:
        """Add a closed DP segment of ``history``'s steps (steps known from a ledger, e.g. after an interrupt)."""
        if history:
            accountant = [[float(sigma), float(rate), int(count)] for sigma, rate, count in history]
            self._segments.append({"kind": "dp", "run_id": run_id, "accountant": accountant, **facts, "note": note})

    def optimizer_stepped(self) -> None:
        """Called after every optimizer step on the weights: one that no DP step announced is non-private."""
        if self._dp_step_pending:
            self._dp_step_pending = False
            return
        self.record_non_private_steps(1, reason=NON_PRIVATE_STEP)

    def record_non_private_steps(self, steps: int, *, reason: str) -> None:
        """Count ``steps`` steps taken without DP-SGD (for good: the weights are no longer DP)."""
        last = self._segments[-1] if self._segments else None
        if last is not None and last["kind"] == "non_private" and last["reason"] == reason:
            last["steps"] += steps
        else:
            self._segments.append({"kind": "non_private", "steps": int(steps), "reason": reason})

    # --- persistence ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The history as plain lists and dicts (``torch.load(weights_only=True)`` and JSON both read it)."""
        return {"version": 1, "segments": self.segments}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the history by a saved one (the open segment, if any, starts afresh)."""
        self._segments = [copy.deepcopy(dict(segment)) for segment in state.get("segments", [])]
        self._open = None
        self._dp_step_pending = False

    def extend(self, segments: Iterable[Segment]) -> None:
        """Append segments (e.g. steps an earlier model took before these weights were built from it)."""
        self._segments.extend(copy.deepcopy(dict(segment)) for segment in segments)


def segment_steps(segment: Segment) -> int:
    """The number of steps in one segment."""
    if segment["kind"] == "dp":
        return sum(int(count) for _, _, count in segment["accountant"])
    return int(segment["steps"])


def history_in_checkpoint(checkpoint: dict[str, Any]) -> PrivacyHistory:
    """The privacy history of a Lightning checkpoint's weights.

    A checkpoint from before weights kept their history gets the one its run ledger implies (one DP segment), or,
    without a ledger, one non-private segment of its ``global_step`` steps.
    """
    history = PrivacyHistory()
    if HISTORY_KEY in checkpoint:
        history.load_state_dict(checkpoint[HISTORY_KEY])
    elif CHECKPOINT_KEY in checkpoint:
        history.extend(history_of_ledger(checkpoint[CHECKPOINT_KEY]))
    elif checkpoint.get("global_step"):
        history.record_non_private_steps(int(checkpoint["global_step"]), reason=UNKNOWN_HISTORY)
    return history


def history_of_ledger(ledger: dict[str, Any]) -> list[Segment]:
    """The DP segment of a run ledger written before weights kept their history (one segment, its facts)."""
    state = ledger["accountant"]
    return [
        {
            "kind": "dp",
            "run_id": ledger.get("run_id"),
            "accountant": [[float(s), float(q), int(n)] for s, q, n in state["history"]],
            "max_grad_norm": ledger.get("max_grad_norm"),
            "dataset_size": ledger.get("dataset_size"),
            "delta": state["delta"],
            "mechanism": state["mechanism"],
            "noise": ledger.get("noise"),
            "noise_secure": bool(ledger.get("noise_secure", False)),
        }
    ]


def inherited_segments(pretrained: str | None) -> list[Segment]:
    """The history a model built from ``pretrained`` starts with: a dplit export's own, else nothing.

    A local folder with ``dp_guarantee.json`` was written by ``dplit export``: its weights took the steps its
    guarantee lists (an export from before histories were kept contributes its accountant history, or one
    non-private segment when it was not DP). Hub names and other folders bring no history dplit knows of.
    """
    if pretrained is None:
        return []
    path = Path(pretrained).expanduser() / GUARANTEE_FILE
    if not path.is_file():
        return []
    try:
        guarantee = json.loads(path.read_text())
    except (OSError, ValueError):
        reason = f"built from a dplit export whose {GUARANTEE_FILE} cannot be read"
        return [{"kind": "non_private", "steps": 0, "reason": reason}]
    if "privacy_history" in guarantee:
        return list(guarantee["privacy_history"]["segments"])
    return _segments_of_old_guarantee(guarantee)


def _segments_of_old_guarantee(guarantee: dict[str, Any]) -> list[Segment]:
    if not guarantee.get("differentially_private") or not guarantee.get("accountant_history"):
        reason = f"built from a dplit export that is not differentially private ({guarantee.get('reason')})"
        return [{"kind": "non_private", "steps": int(guarantee.get("steps") or 0), "reason": reason}]
    ledger = {
        "accountant": {
            "history": guarantee["accountant_history"],
            "delta": guarantee["delta"],
            "mechanism": guarantee["accountant"],
        },
        **{key: guarantee.get(key) for key in ("run_id", "max_grad_norm", "dataset_size", "noise")},
        "noise_secure": True,
    }
    return history_of_ledger(ledger)
