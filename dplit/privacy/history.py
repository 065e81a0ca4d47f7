"""PrivacyHistory: every step that touched a model's weights, kept with the weights rather than with a run.

A model's released ε must count every DP-SGD step its weights took (every fit, resume and refit, with every
noise source) and must say "not differentially private" once a single step was taken without DP-SGD. The
history is a list of segments, each a plain dict (so it travels in ``state_dict()``, checkpoints, ledgers and
``dp_guarantee.json``):

* ``{"kind": "dp", "run_id", "accountant": [[σ, q, steps], ...], "max_grad_norm", "dataset_size", "delta",
  "mechanism", "noise", "noise_secure", "note"}``: DP-SGD steps of one fit (a resume opens a new segment);
* ``{"kind": "non_private", "steps", "reason"}``: optimizer steps taken without DP-SGD, a change of the weights no
  recorded step explains (``steps`` 0), or weights of unknown history; one such segment makes the weights
  non-private for good;
* ``{"kind": "public_change", "statement", "where"}``: a change no recorded step explains, which the person running
  dplit stated used no private data (the strategy's ``public_change``); the card quotes the statement verbatim.

The history is bound to the weights' content: it records where they started (``origin``: a public starting point and
its digest) and the digest of the weights at the last boundary it saw (:meth:`PrivacyHistory.seal`: each DP segment's
end, each checkpoint), and :meth:`PrivacyHistory.verify` turns any difference no recorded step explains into a
segment. Nothing here is computed from the training data: σ, q, C, N, step counts and digests of the weights are
public parameters of the run or functions of the weights that are released anyway.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dplit.privacy.accounting import History
from dplit.privacy.export_seal import GUARANTEE_FILE, check_export
from dplit.privacy.integrity import DIGEST_KEY, check_digests
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.privacy.refusal import DEFAULT_OWNER
from dplit.privacy.weights_content import content_digest

__all__ = ["GUARANTEE_FILE", "HISTORY_KEY", "PrivacyHistory", "history_in_checkpoint", "inherited_history"]

Segment = dict[str, Any]

NON_PRIVATE_STEP = "optimizer steps taken outside dplit's DP-SGD step (no clipping, no noise)"
HISTORY_KEY = "dplit_privacy_history"
"""The checkpoint entry holding the weights' :meth:`PrivacyHistory.state_dict` (written by the module)."""
UNRECORDED_CHANGE = "the weights changed outside any step dplit recorded"
"""Why a change found by :meth:`PrivacyHistory.verify` makes the weights non-private."""
LOADED_DURING_FIT = "weights were loaded into the model (load_state_dict) while a DP-SGD fit was running"
NOT_RECORDED_ORIGIN = "not recorded (the weights as dplit first saw them, before their first DP segment)"
"""The origin of a history that no dplit task started (a module of your own with a fresh PrivacyHistory)."""
UNKNOWN_HISTORY = "trained outside dplit's DP-SGD step before dplit kept a privacy history with the weights"


class PrivacyHistory:
    """The privacy history of one set of weights: DP segments and non-private steps, oldest first.

    The strategy calls :meth:`open_dp_segment` at the start of a fit and :meth:`record_dp_step` at every DP step;
    the module's optimizers call :meth:`optimizer_stepped` after every step, which counts a step that no DP step
    announced as non-private. The module records where its weights started (:meth:`record_origin`), seals their
    digest at each checkpoint and DP segment's end, and has it verified before each DP segment (:meth:`verify`).
    """

    def __init__(self, segments: Iterable[Segment] = ()) -> None:
        self._segments: list[Segment] = [copy.deepcopy(dict(segment)) for segment in segments]
        self._open: Segment | None = None
        self._dp_step_pending = False
        self._origin: dict[str, Any] | None = None
        self._digest: str | None = None
        self._derived: tuple[str, ...] = ()  # digests of weights derived from the sealed ones (an EMA in a checkpoint)
        self._explained = False  # whether recorded steps since the last seal explain a change of the weights
        self._sealed_at = 0  # how many segments the history had at the last seal

    # --- what the history says ----------------------------------------------------------------------------------

    @property
    def segments(self) -> list[Segment]:
        """A copy of every segment with at least one step, oldest first."""
        return copy.deepcopy(self._segments)

    @property
    def origin(self) -> dict[str, Any] | None:
        """The public starting point of the weights: ``{"description", "digest"}`` (``None``: not recorded)."""
        return copy.deepcopy(self._origin)

    @property
    def in_dp_segment(self) -> bool:
        """Whether a DP segment is open (a DP-SGD fit is running on the weights)."""
        return self._open is not None

    @property
    def digest(self) -> str | None:
        """The weights' content digest at the last boundary this history saw (``None``: none recorded)."""
        return self._digest

    @property
    def dp_steps(self) -> int:
        """DP-SGD steps over every DP segment."""
        return sum(segment_steps(segment) for segment in self._segments if segment["kind"] == "dp")

    @property
    def non_private_steps(self) -> int:
        """Steps taken without DP-SGD (or of unknown history)."""
        return sum(segment_steps(segment) for segment in self._segments if segment["kind"] == "non_private")

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
        non_private = [segment for segment in self._segments if segment["kind"] not in ("dp", "public_change")]
        if non_private:
            reasons = "; ".join(sorted({_reason(segment) for segment in non_private}))
            steps = self.non_private_steps
            return f"{steps} of the weights' steps were not private: {reasons}" if steps else reasons
        predictable = [seg for seg in self._segments if seg["kind"] == "dp" and not seg["noise_secure"]]
        if predictable:
            steps = sum(segment_steps(segment) for segment in predictable)
            return (
                f"{steps} of the weights' DP steps drew predictable noise ({DEFAULT_OWNER}.seed set in "
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
        self._explained = True

    def note_open_segment(self, **facts: Any) -> None:
        """Update public facts of the open DP segment (e.g. the quantile bound C_t it has reached)."""
        if self._open is not None:
            self._open.update(facts)

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
        self._explained = True

    # --- binding the history to the weights' content -------------------------------------------------------------

    def record_origin(self, description: str, digest: str) -> None:
        """Record the public starting point the weights were just built from, and seal their digest.

        Args:
            description: what the starting point is (a hub model, a local folder, a dplit export, a random
                initialisation), in words a card can publish.
            digest: the weights' content digest now (:func:`dplit.privacy.weights_content.content_digest`).
        """
        self._origin = {"description": description, "digest": digest}
        self.seal(digest)

    def seal(self, digest: str, *, derived: tuple[str, ...] = ()) -> None:
        """Record that the weights now have ``digest`` and that the history so far explains them.

        Args:
            digest: the weights' content digest.
            derived: digests of weights computed from them during a DP fit (e.g. an average of its iterates a
                callback put in a checkpoint), which the history explains too.
        """
        self._digest, self._derived, self._explained = digest, tuple(derived), False
        self._sealed_at = len(self._segments)

    def verify(self, digest: str, *, where: str, public_change: str | None = None) -> str | None:
        """Compare the weights' digest now with the last seal; a change no recorded step explains becomes a segment.

        Steps recorded since the last seal (DP or not) and a DP segment still open explain any change. An
        unexplained change is a ``non_private`` segment, or, when ``public_change`` states that it used no private
        data, a ``public_change`` segment quoting that statement. Either way the new digest is sealed.

        Args:
            digest: the weights' content digest now.
            where: the boundary, for the segment and the line (e.g. ``"before a DP-SGD fit"``).
            public_change: the user's statement that an unexplained change used no private data (quoted verbatim).

        Returns:
            The line to say when an unexplained change was found, else ``None``.
        """
        if public_change and self._public_steps_since_seal(public_change, where):
            self.seal(digest)
            return f"the optimizer steps taken outside DP-SGD since the last boundary are recorded as public: {public_change!r}"
        explained = self._open is not None or self._explained or digest in (self._digest, *self._derived)
        if explained or (self._digest is None and self._origin is None and not self._segments):
            if self._origin is None and not self._segments:
                self._origin = {"description": NOT_RECORDED_ORIGIN, "digest": digest}
            self.seal(digest)
            return None
        self.seal(digest)
        if public_change:
            self._segments.append({"kind": "public_change", "statement": public_change, "where": where})
            return f"the weights changed outside any step dplit recorded ({where}); recorded as a public change: {public_change!r}"
        self._segments.append({"kind": "non_private", "steps": 0, "reason": f"{UNRECORDED_CHANGE} ({where})"})
        return (
            f"these weights are now NOT differentially private: they changed outside any step dplit recorded ({where}: "
            "a training loop outside dplit, load_state_dict, or an edit); train them only through dplit, load "
            "checkpoints with --ckpt_path or Module.load_from_checkpoint, or, if the change used no private data, say "
            f"so with {DEFAULT_OWNER}.public_change='<what was done>' (the card quotes it)"
        )

    def _public_steps_since_seal(self, statement: str, where: str) -> bool:
        """Turn the non-private optimizer steps recorded since the last seal into one stated public change."""
        recent = self._segments[self._sealed_at :]
        if not recent or any(s["kind"] != "non_private" or s["reason"] != NON_PRIVATE_STEP for s in recent):
            return False
        steps = sum(segment_steps(segment) for segment in recent)
        del self._segments[self._sealed_at :]
        self._segments.append({"kind": "public_change", "statement": statement, "where": where, "steps": steps})
        return True

    def weights_loaded(self) -> None:
        """Called after weights are loaded into the model: they must match the last seal (see :meth:`verify`).

        While a DP segment runs, the loaded weights replace what its steps made, so the load is not private.
        """
        if self._open is not None:
            self._segments.append({"kind": "non_private", "steps": 0, "reason": LOADED_DURING_FIT})
        self._explained = False

    def abandon_open_segment(self) -> None:
        """Forget a DP segment an earlier run left open (never finished): what changed since the seal must match it."""
        if self._open is not None:
            self._open, self._dp_step_pending, self._explained = None, False, False

    def close_dp_segment(self, digest: str | None) -> None:
        """End the open DP segment (a fit's end, or its interruption) and seal ``digest`` when it is known.

        Without a digest (an interrupted run of several processes) nothing since the last seal is explained: the
        next boundary's digest must match it (a resume reloads the checkpoint's weights and history anyway).
        """
        self._open = None
        self._dp_step_pending = False
        if digest is not None:
            self.seal(digest)
        else:
            self._explained = False

    # --- persistence ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The history as plain lists and dicts (``torch.load(weights_only=True)`` and JSON both read it)."""
        state = {"version": 2, "segments": self.segments, "origin": self.origin, "digest": self._digest}
        return {**state, "derived_digests": list(self._derived)} if self._derived else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the history by a saved one (the open segment, if any, starts afresh)."""
        self._segments = [copy.deepcopy(dict(segment)) for segment in state.get("segments", [])]
        self._open = None
        self._dp_step_pending = False
        self._origin = copy.deepcopy(state.get("origin"))
        self._digest, self._explained = state.get("digest"), False
        self._derived = tuple(state.get("derived_digests", ()))
        self._sealed_at = len(self._segments)

    def extend(self, segments: Iterable[Segment]) -> None:
        """Append segments (e.g. steps an earlier model took before these weights were built from it)."""
        self._segments.extend(copy.deepcopy(dict(segment)) for segment in segments)


def _reason(segment: Segment) -> str:
    """Why a segment that is not DP-SGD makes the weights non-private (a kind this dplit does not know counts too)."""
    if segment["kind"] == "non_private":
        return str(segment["reason"])
    return f"a history segment of a kind this dplit does not know ({segment['kind']!r}) counts as not private"


def segment_steps(segment: Segment) -> int:
    """The number of steps in one segment."""
    if segment["kind"] == "dp":
        return sum(int(count) for _, _, count in segment["accountant"])
    return int(segment.get("steps", 0))


def history_in_checkpoint(checkpoint: dict[str, Any], *, check_weights: bool = False) -> PrivacyHistory:
    """The privacy history of a Lightning checkpoint's weights.

    A checkpoint from before weights kept their history gets the one its run ledger implies (one DP segment), or,
    without a ledger, one non-private segment of its ``global_step`` steps. A history from before histories kept a
    digest of the weights gets the digest of the checkpoint's weights when dplit's integrity seal vouches for them.

    Args:
        checkpoint: the loaded checkpoint.
        check_weights: verify that the checkpoint's weights are those its history sealed (a mismatch is a change
            no recorded step explains: a non-private segment).
    """
    history = PrivacyHistory()
    if HISTORY_KEY in checkpoint:
        history.load_state_dict(checkpoint[HISTORY_KEY])
    elif CHECKPOINT_KEY in checkpoint:
        history.extend(history_of_ledger(checkpoint[CHECKPOINT_KEY]))
    elif checkpoint.get("global_step"):
        history.record_non_private_steps(int(checkpoint["global_step"]), reason=UNKNOWN_HISTORY)
    weights = checkpoint.get("state_dict")
    if weights is None or not (check_weights or history.digest is None):
        return history
    digest = content_digest(weights)
    if history.digest is None and _integrity_vouches(checkpoint):
        history.seal(digest)
    elif check_weights:
        history.verify(digest, where="found in the checkpoint")
    return history


def _integrity_vouches(checkpoint: dict[str, Any]) -> bool:
    """Whether dplit's integrity seal covers the checkpoint's weights and history, and they are intact."""
    sealed = checkpoint.get(DIGEST_KEY) or {}
    if "state_dict" not in sealed:
        return False
    try:
        check_digests(checkpoint, source="checkpoint")
    except ValueError:
        return False
    return True


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


def inherited_history(pretrained: str | Path | None, *, name: str | None = None) -> tuple[list[Segment], str | None]:
    """The history a model built from the folder ``pretrained`` starts with, and how its origin describes it.

    An intact (sealed) dplit export brings its guarantee's privacy history; a folder that carries a trace of dplit
    (a guarantee, a card, or weight files marked by an export) whose seal does not hold brings one segment of
    weights of unknown history (not private); anything else (another folder, ``None``) brings nothing.

    Args:
        pretrained: the local folder the weights were loaded from (a hub model's downloaded snapshot included).
        name: how to name it (default: the folder's name; a hub model's name for its snapshot).

    Returns:
        The inherited segments, and the starting point's description for an export or a broken one (``None``:
        the caller describes a plain source).
    """
    if pretrained is None or not Path(pretrained).expanduser().is_dir():
        return [], None
    folder = Path(pretrained).expanduser()
    shown = name or f"folder {folder.resolve().name}"
    check = check_export(folder)
    if check.kind == "plain":
        return [], None
    if check.kind == "broken":
        reason = f"built from weights of unknown history ({shown}: {check.reason})"
        return [{"kind": "non_private", "steps": 0, "reason": reason}], f"{shown}, weights of unknown history"
    history = (check.guarantee or {}).get("privacy_history") or {}
    origin = (history.get("origin") or {}).get("description") or "not recorded"
    segments = list(history.get("segments", []))
    return segments, f"dplit export {name or folder.resolve().name} (seal intact; its history starts from {origin})"
