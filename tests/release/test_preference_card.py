"""The card of a DPO model (issue 53): built from a DP SFT export, per user of pairs, its training values not covered.

The user states whether the preference data's people are also in the SFT data (``DPStrategy.people_overlap``);
ε always composes every segment, and only a stated disjointness adds each dataset's own ε.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from dplit.cli.lightning_cli import run_dpo_cli, run_lm_cli
from dplit.privacy.accounting import History, PrivacyAccountant
from dplit.privacy.composition import disjoint_datasets, later_runs
from dplit.privacy.history import HISTORY_KEY
from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.training_units import TrainingUnits
from dplit.privacy.user_sampling import UserLevel
from dplit.release.card import model_card
from dplit.release.export import export_checkpoint
from dplit.release.guarantee import (
    EXAMPLE_OR_PAIR_UNIT,
    GUARANTEE_FILE,
    NOT_COVERED,
    PREFERENCE_DIAGNOSTICS,
    guarantee_of,
)
from tests.helpers.commands import checkpoint_of, dpo_args, lm_args, steps

DELTA = 1e-5


def segment(run: str, unit: str, sigma: float, rate: float, count: int, **facts: Any) -> dict[str, Any]:
    """A DP segment of run ``run`` over ``unit`` s: ``count`` steps at (σ, q)."""
    return {
        "kind": "dp", "run_id": run, "accountant": [[sigma, rate, count]], "max_grad_norm": 1.0, "dataset_size": 200,
        "delta": DELTA, "mechanism": "prv", "noise": "os_entropy", "noise_secure": True, "privacy_unit": unit,
        **facts,
    }  # fmt: skip


def sft_then_dpo(overlap: bool | None) -> list[dict[str, Any]]:
    """An SFT fit over rows, then a DPO fit over pairs (stating ``overlap``) that was resumed once."""
    stated = {} if overlap is None else {"people_overlap": overlap}
    return [
        segment("sft", "example", 1.0, 0.1, 6),
        segment("dpo", "pair", 0.8, 0.05, 4, **stated),
        segment("dpo", "pair", 0.8, 0.05, 3, **stated, note="resumed"),
    ]


def epsilon_of(history: History, delta: float = DELTA) -> float:
    """What the PRV accountant says of ``history`` alone at ``delta`` (the reference for each part)."""
    accountant = PrivacyAccountant(delta=delta, mechanism="prv")
    accountant.load_state_dict({"delta": delta, "mechanism": "prv", "history": history})
    return accountant.epsilon()


def card_of(segments: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    guarantee = guarantee_of({HISTORY_KEY: {"version": 2, "segments": segments}})
    return guarantee, model_card(guarantee, kind="causal LM")


def test_overlapping_people_compose_both_fits_for_one_person() -> None:
    guarantee, card = card_of(sft_then_dpo(True))
    both = epsilon_of([(1.0, 0.1, 6), (0.8, 0.05, 7)])
    assert guarantee["epsilon"] == pytest.approx(both, rel=1e-9) and guarantee["people_overlap"] == [[2, True]]
    assert "epsilon_per_dataset" not in guarantee
    assert guarantee["privacy_unit"] == EXAMPLE_OR_PAIR_UNIT and "one pair" in guarantee["privacy_unit"]
    assert "Row 2 starts a later fit from these weights: the user stated that its data shares people" in card
    assert "for one unit of each together (sequential composition)" in card


def test_disjoint_people_add_each_datasets_own_epsilon_and_keep_the_composed_one() -> None:
    guarantee, card = card_of(sft_then_dpo(False))
    sft, dpo = epsilon_of([(1.0, 0.1, 6)]), epsilon_of([(0.8, 0.05, 7)])
    assert guarantee["epsilon"] == pytest.approx(epsilon_of([(1.0, 0.1, 6), (0.8, 0.05, 7)]), rel=1e-9)
    (first_rows, first), (second_rows, second) = guarantee["epsilon_per_dataset"]
    assert (first_rows, second_rows) == ([1], [2, 3])
    assert first == pytest.approx(sft, rel=1e-9) and second == pytest.approx(dpo, rel=1e-9)
    assert max(first, second) < guarantee["epsilon"]
    assert "no person in its data is in the data of the fits above it (DPStrategy.people_overlap=false" in card
    assert f"row(s) 1: ε = {first:.6g}; row(s) 2, 3: ε = {second:.6g}" in card


def test_an_unstated_overlap_is_composed_as_if_the_people_were_the_same() -> None:
    guarantee, card = card_of(sft_then_dpo(None))
    assert guarantee["people_overlap"] == [[2, None]] and "epsilon_per_dataset" not in guarantee
    assert "was not stated (DPStrategy.people_overlap): ε above composes every row as if they do" in card


def test_a_later_fit_that_may_share_people_with_any_earlier_one_voids_the_per_dataset_epsilon() -> None:
    segments = [*sft_then_dpo(False), segment("third", "pair", 1.0, 0.1, 2, people_overlap=True)]
    assert later_runs(segments) == [1, 3] and disjoint_datasets(segments) is None
    guarantee, _ = card_of(segments)
    assert guarantee["people_overlap"] == [[2, False], [4, True]] and "epsilon_per_dataset" not in guarantee
    disjoint = [*sft_then_dpo(False), segment("third", "pair", 1.0, 0.1, 2, people_overlap=False)]
    assert disjoint_datasets(disjoint) == [[0], [1, 2], [3]]


def test_one_fit_and_its_resumes_say_nothing_of_people() -> None:
    guarantee, card = card_of(sft_then_dpo(True)[1:])
    assert "people_overlap" not in guarantee and "starts a later fit" not in card


def test_people_overlap_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match=r"^DPStrategy.people_overlap must be true, false or null, got 'yes'$"):
        DPSGDSettings(max_grad_norm=1.0, noise_multiplier=1.0, people_overlap="yes")  # type: ignore[arg-type]


def test_the_training_pairs_dpo_values_are_named_not_covered_beside_the_diagnostics() -> None:
    dpo, _ = card_of(sft_then_dpo(True))
    sft, _ = card_of(sft_then_dpo(True)[:1])
    assert sft["not_covered"] == list(NOT_COVERED) and PREFERENCE_DIAGNOSTICS not in sft["not_covered"]
    assert dpo["not_covered"] == [*NOT_COVERED[:2], PREFERENCE_DIAGNOSTICS, *NOT_COVERED[2:]]
    for value in ("train/loss", "reward accuracy", "margin", "log-probability"):
        assert value in PREFERENCE_DIAGNOSTICS


def users_of_pairs(**facts: Any) -> dict[str, Any]:
    """A DPO segment over users (50 of them, at most 2 pairs each per step), as the history records it."""
    return segment("dpo", "user", 1.0, 0.1, 5, users=50, max_rows_per_user=2, dataset_size=50, **facts)


def test_a_per_user_card_of_pairs_says_pairs_where_it_says_rows() -> None:
    guarantee, card = card_of([users_of_pairs(user_rows="pairs")])
    assert guarantee["protected_unit"] == "user" and guarantee["user_rows"] == "pairs"
    assert guarantee["privacy_unit"].startswith("one user (all of that user's training preference pairs; at most 2")
    assert "a user's preference pairs beyond that" in guarantee["privacy_unit"]
    assert "add/remove one user with all of that user's preference pairs" in guarantee["neighbouring_relation"]
    assert "| preference pairs of a user per step (at most) | 2 |" in card and PREFERENCE_DIAGNOSTICS in card
    rows, rows_card = card_of([users_of_pairs()])  # a dplit lm segment over users: rows, as before
    assert "user_rows" not in rows and "training rows;" in rows["privacy_unit"]
    assert "| rows of a user per step (at most) | 2 |" in rows_card
    mixed, _ = card_of([users_of_pairs(), users_of_pairs(user_rows="pairs")])  # rows then pairs: not all pairs
    assert "user_rows" not in mixed and "training rows;" in mixed["privacy_unit"]


def test_a_user_level_dpo_run_records_that_its_users_items_are_pairs() -> None:
    level = UserLevel(user_rows=[[0, 1], [2]], max_rows_per_user=2)
    units = partial(TrainingUnits, size=2, sample_rate=0.5, rows=[])
    assert units(name="user", item="pair", users=level).facts(private_diagnostics=False)["user_rows"] == "pairs"
    assert "user_rows" not in units(name="user", item="example", users=level).facts(private_diagnostics=False)
    assert units(name="pair", item="pair").facts(private_diagnostics=False) == {"privacy_unit": "pair"}


# --- end to end: dplit lm fit, export, dplit dpo fit from that export, export ---------------------------------------

SIGMA = ["--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1"]


def from_export(folder: Path) -> list[str]:
    return ["--model.config", "null", "--model.pretrained", str(folder)]


@pytest.mark.slow
def test_dpo_from_a_dp_sft_export_composes_both_fits_and_a_tampered_export_is_unknown_history(tmp_path: Path) -> None:
    run_lm_cli(["fit", *lm_args(tmp_path / "sft", *steps(2), *SIGMA)])
    export_checkpoint(checkpoint_of(tmp_path / "sft"), tmp_path / "sft_export")
    sft = json.loads((tmp_path / "sft_export" / GUARANTEE_FILE).read_text())
    overlap = ["--trainer.strategy.init_args.people_overlap", "true"]
    run_dpo_cli(
        ["fit", *dpo_args(tmp_path / "dpo", *steps(2), *SIGMA, *overlap, *from_export(tmp_path / "sft_export"))]
    )
    export_checkpoint(checkpoint_of(tmp_path / "dpo"), tmp_path / "dpo_export")
    guarantee = json.loads((tmp_path / "dpo_export" / GUARANTEE_FILE).read_text())
    first, second = guarantee["privacy_history"]["segments"]
    assert (first["privacy_unit"], second["privacy_unit"]) == ("example", "pair")
    assert first["accountant"] == sft["privacy_history"]["segments"][0]["accountant"] and second["people_overlap"]
    composed = epsilon_of([tuple(entry) for entry in first["accountant"] + second["accountant"]], guarantee["delta"])
    assert guarantee["epsilon"] == pytest.approx(composed, rel=1e-9) and guarantee["epsilon"] > sft["epsilon"]
    assert guarantee["differentially_private"] and guarantee["people_overlap"] == [[2, True]]
    assert guarantee["starting_point"].startswith("dplit export sft_export (seal intact")
    card = (tmp_path / "dpo_export" / "README.md").read_text()
    assert (
        "| 1 | DP-SGD | 2 |" in card and "| example |" in card and "| 2 | DP-SGD | 2 |" in card and "| pair |" in card
    )
    assert "Row 2 starts a later fit from these weights: the user stated that its data shares people" in card
    assert "(N differs between the segments: N = 200 rows; N = 100 pairs;" in card
    tampered = tmp_path / "sft_export" / GUARANTEE_FILE
    tampered.write_text(tampered.read_text().replace(f'"epsilon": {sft["epsilon"]}', '"epsilon": 0.01', 1))
    run_dpo_cli(["fit", *dpo_args(tmp_path / "again", *steps(1), *SIGMA, *from_export(tmp_path / "sft_export"))])
    export_checkpoint(checkpoint_of(tmp_path / "again"), tmp_path / "again_export")
    refused = json.loads((tmp_path / "again_export" / GUARANTEE_FILE).read_text())
    assert refused["differentially_private"] is False and "built from weights of unknown history" in refused["reason"]
    assert [segment["kind"] for segment in refused["privacy_history"]["segments"]] == ["non_private", "dp"]
