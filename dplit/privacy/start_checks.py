"""What DP-SGD refuses when a run starts, before any step: δ, N on resume, the ranks' rows, users per micro-batch."""

from __future__ import annotations

from dplit.privacy.fingerprint import IndexedRows, rows_fingerprint
from dplit.privacy.ledger import RunLedger
from dplit.privacy.refusal import OWNER, SettingError
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.training_units import TrainingUnits
from dplit.privacy.user_sampling import UserLevel
from dplit.privacy.warnings import warn
from dplit.privacy.world import World


def check_start(
    settings: DPSGDSettings, world: World, *, delta: float, units: TrainingUnits, ledger: RunLedger
) -> None:
    """Every start-time refusal, in one line each (see the functions below)."""
    check_same_dataset_size(ledger.restored_dataset_size, units.size)
    check_delta(settings, world, delta=delta, size=units.size)
    check_ranks_hold_the_same_rows(world, units.rows)
    check_users_fit_a_micro_batch(settings, units.users)
    check_packing_engine(settings, units)


def check_same_dataset_size(restored: int | None, dataset_size: int) -> None:
    """Refuse resuming a run on a training set of another size: q = B/N, δ = N^-1.1 and ε all depend on N."""
    if restored is not None and restored != dataset_size:
        raise ValueError(
            f"the training set has {dataset_size} rows, but the checkpoint's run trained on {restored}: a resumed run "
            "must train on the same rows (its sampling rate q = data.batch_size / N, its default δ = N^-1.1 and its ε "
            "depend on N); resume with the same data, or start a new run from the exported model"
        )


def check_delta(settings: DPSGDSettings, world: World, *, delta: float, size: int) -> None:
    """Refuse δ ≥ 1/N (it permits releasing whole examples) unless ``allow_large_delta``, and then warn."""
    if delta < 1 / size:
        return
    owner = settings.flag_owner
    message = (
        f"{owner}.target_delta={delta:.3g} is ≥ 1/N = {1 / size:.3g} for N={size} training examples: a δ that large "
        "permits releasing whole examples"
    )
    if not settings.allow_large_delta:
        raise ValueError(f"{message}; use δ ≤ N^-1.1 (the default) or set {owner}.allow_large_delta=true")
    warn(world, f"{message} (allowed by {owner}.allow_large_delta)")


def check_ranks_hold_the_same_rows(world: World, rows: IndexedRows | None) -> None:
    """Refuse, on every rank, data-parallel ranks whose training datasets differ (in N or in any row).

    Each rank samples its own shard of the indices, which is one Poisson sample only if the datasets agree.
    """
    if world.size == 1 or rows is None:
        return
    local = rows_fingerprint(rows)
    if not world.all_agree(local == world.broadcast(local)):
        raise ValueError(
            "the training rows differ between data-parallel ranks (in number or content): each rank Poisson-samples "
            "its own shard of ONE dataset, so every rank must build the same rows in the same order; a random "
            "split, shuffle or subsample that is not seeded (or depends on the rank) is the likely cause: seed it"
        )


def check_users_fit_a_micro_batch(settings: DPSGDSettings, users: UserLevel | None) -> None:
    """Refuse micro-batches smaller than k: a user's rows are clipped together, in one micro-batch."""
    size = settings.max_physical_batch_size
    if users is not None and size < users.max_rows_per_user:
        raise ValueError(
            f"{settings.flag_owner}.max_physical_batch_size={size} is below data.max_rows_per_user="
            f"{users.max_rows_per_user}: a user's rows are clipped together in one micro-batch"
        )


def check_packing_engine(settings: DPSGDSettings, units: TrainingUnits) -> None:
    """Refuse packed rows to an engine that clips whole rows (only the ghost engine clips per document)."""
    if units.packing and settings.clipping != "ghost":
        raise SettingError(
            f"data.packing=true needs {OWNER}.clipping=ghost: the {settings.clipping} engine clips whole rows, and a "
            "packed row holds several documents",
            owner=settings.flag_owner,
        )
