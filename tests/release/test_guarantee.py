"""The card and ``dp_guarantee.json`` compose the weights' history by the relation they state (issue 49 §3-§5).

Units and datasets are not one: under a per-example claim a user-level segment is replace-one, δ is the smallest
of the segments', N is stated per dataset; a user-level card says so everywhere; an unnoised count is published
only when asked for by name; each segment's own mechanism (unit, k, clip mode, C, N, δ) is on the card.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from dplit.backbone.embeddings import TiedEmbeddings
from dplit.cli.lightning_cli import run_cli
from dplit.data.batches import PadCollator, TokenizedDataset
from dplit.privacy.accounting import PrivacyAccountant, default_delta
from dplit.privacy.accounting.relations import epsilon_composed, epsilon_under
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.history import HISTORY_KEY, PrivacyHistory
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.privacy.settings import DPSGDSettings
from dplit.release.card import model_card
from dplit.release.export import export_checkpoint, export_summary
from dplit.release.guarantee import GUARANTEE_FILE, guarantee_of
from dplit.tasks.classifier import CausalLMClassifier
from tests.helpers.commands import checkpoint_of, quickstart_args, steps
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB

USERS = [0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4, 4, 5]
"""13 rows of 6 users, of 1 to 5 rows (the largest user has 5)."""
K_ROWS = 3
CLIP = 0.05
K_EPSILON = "a person with k rows in the training data is protected at about k·ε"


def prompts(count: int) -> tuple[list[list[int]], list[int]]:
    """``count`` random prompts of 2 to 8 tokens and their labels (seeded)."""
    generator = torch.Generator().manual_seed(count)
    ids = [torch.randint(0, VOCAB, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator).tolist()
           for _ in range(count)]  # fmt: skip
    return ids, [row[0] % 2 for row in ids]


def user_rows() -> TokenizedDataset:
    """:data:`USERS`' 13 rows, each user a unit of at most :data:`K_ROWS` rows per step."""
    ids, labels = prompts(len(USERS))
    return TokenizedDataset(ids, labels, users=USERS, max_rows_per_user=K_ROWS)


def example_rows(count: int = len(USERS)) -> TokenizedDataset:
    """``count`` rows, each its own unit (the first 13 are :func:`user_rows`' rows)."""
    return TokenizedDataset(*prompts(count))


def classifier() -> CausalLMClassifier:
    torch.manual_seed(0)
    model = CausalLMClassifier(
        config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS, embeddings=TiedEmbeddings()
    )
    return model.double()


def dp_run(
    model: CausalLMClassifier, dataset: TokenizedDataset, history: PrivacyHistory, *, steps: int = 2,
    delta: float = 1e-3, batch: int = 3, **settings: Any,
) -> DPSGD:  # fmt: skip
    """``steps`` noisy DP steps (σ = 1) on the first 6 rows of ``dataset``: one segment of ``history``."""
    chosen = DPSGDSettings(**{
        "max_grad_norm": CLIP, "noise_multiplier": 1.0, "target_delta": delta, "self_check": False, **settings
    })  # fmt: skip
    mechanism = DPSGD(model, chosen, history=history)
    collate = PadCollator(pad_token_id=0)
    mechanism.sample(DataLoader(dataset, batch_size=batch, collate_fn=collate))
    mechanism.start(planned_steps=steps)
    for _ in range(steps):
        mechanism.clip(model.per_example_loss, collate([dataset[i] for i in range(6)]))  # users 0-2: whole
        mechanism.release()
        model.zero_grad(set_to_none=True)
    return mechanism


def checkpoint(history: PrivacyHistory, run: DPSGD | None = None) -> dict[str, Any]:
    """The privacy entries of a checkpoint of the weights ``history`` describes (and the last run's ledger)."""
    return {HISTORY_KEY: history.state_dict(), **({CHECKPOINT_KEY: run.state_dict()} if run else {})}


def prv_add_remove(history: PrivacyHistory, delta: float) -> float:
    """What the card said before issue 49: every segment composed as add/remove one example (PRV)."""
    accountant = PrivacyAccountant(delta=delta)
    accountant.load_state_dict({**accountant.state_dict(), "history": history.accountant_history()})
    return accountant.epsilon()


# --- §3: mixed units, both orders ---------------------------------------------------------------------------------


@pytest.mark.parametrize("user_first", [True, False], ids=["user-then-example", "example-then-user"])
def test_a_user_level_segment_counts_as_replace_one_under_a_per_example_claim(user_first: bool) -> None:
    """The issue's reproduction: the card composed both as add/remove (2.111 for an honest 2.659 there)."""
    model, history = classifier(), PrivacyHistory()
    runs = [(user_rows(), "replace_one", 3 / 6), (example_rows(), "add_remove", 3 / 13)]
    for dataset, _, _ in runs if user_first else runs[::-1]:
        last = dp_run(model, dataset, history)
    guarantee = guarantee_of(checkpoint(history, last))
    order = runs if user_first else runs[::-1]
    honest = epsilon_composed([(relation, 1.0, rate, 2) for _, relation, rate in order], delta=1e-3)  # type: ignore[misc]
    assert guarantee["differentially_private"] is True and guarantee["epsilon"] == pytest.approx(honest, abs=1e-9)
    assert guarantee["epsilon"] > prv_add_remove(history, 1e-3) + 0.05  # what the card said before
    assert guarantee["protected_unit"] == "example" and "users" not in guarantee
    card = model_card(guarantee, kind="classifier")
    assert card.splitlines()[0].endswith("per training example (add/remove one)")
    assert "replace-one" in guarantee["neighbouring_relation"] and "PLD" in guarantee["accountant"]
    assert "1 segment(s) that trained over users count as replace-one" in card
    assert "N = 6 users" in card and "N = 13 rows" in card and "of the 13 training rows" not in card
    assert "| sampling rate q | per segment, see the history |" in card and guarantee["sample_rate"] is None


def test_the_run_ledger_composes_mixed_units_as_the_card_does_and_refuses_a_target_over_them() -> None:
    model, history = classifier(), PrivacyHistory()
    dp_run(model, user_rows(), history)
    last = dp_run(model, example_rows(), history)
    guarantee = guarantee_of(checkpoint(history, last))
    assert last.budget.epsilon_spent == pytest.approx(guarantee["epsilon"], abs=1e-9)  # the ledger and the logs
    assert last.budget.epsilon_spent > prv_add_remove(history, 1e-3) + 0.05
    with pytest.raises(ValueError, match="target_epsilon cannot bound a privacy history that mixes units"):
        dp_run(model, user_rows(), history, noise_multiplier=None, target_epsilon=50.0)


def test_an_example_level_history_keeps_the_prv_epsilon_and_one_relation() -> None:
    model, history = classifier(), PrivacyHistory()
    run = dp_run(model, example_rows(), history)
    guarantee = guarantee_of(checkpoint(history, run))
    assert guarantee["epsilon"] == pytest.approx(prv_add_remove(history, 1e-3), rel=1e-9)
    assert guarantee["accountant"] == "prv" and guarantee["protected_unit"] == "example"
    card = model_card(guarantee, kind="classifier")
    assert "of the 13 training rows" in card and "replace-one for one row" not in card and K_EPSILON in card


# --- §3: datasets: δ is the smallest, N per dataset ---------------------------------------------------------------


def test_a_smaller_second_dataset_neither_raises_delta_nor_hides_the_first_n() -> None:
    """200 rows at δ = 1e-3, then 20 rows at δ = 0.037: the card keeps δ = 1e-3 and names both N."""
    model, history = classifier(), PrivacyHistory()
    dp_run(model, example_rows(200), history, delta=1e-3, batch=20)
    last = dp_run(model, example_rows(20), history, delta=0.037, batch=2)
    guarantee = guarantee_of(checkpoint(history, last))
    assert guarantee["delta"] == 1e-3  # never the last segment's
    assert guarantee["epsilon"] == pytest.approx(prv_add_remove(history, 1e-3), rel=1e-9)
    assert guarantee["dataset_sizes"] == [200, 20] and guarantee["dataset_size"] is None
    card = model_card(guarantee, kind="classifier")
    assert "of the 20 training rows" not in card and "N = 200 rows" in card and "N = 20 rows" in card
    assert "| training rows N (users, under user-level DP) | per segment, see the history |" in card


def test_mixed_units_at_different_deltas_compose_at_the_smallest() -> None:
    model, history = classifier(), PrivacyHistory()
    dp_run(model, example_rows(200), history, delta=1e-4, batch=20)
    last = dp_run(model, user_rows(), history, delta=1e-3)
    guarantee = guarantee_of(checkpoint(history, last))
    honest = epsilon_composed([("add_remove", 1.0, 0.1, 2), ("replace_one", 1.0, 0.5, 2)], delta=1e-4)
    assert guarantee["delta"] == 1e-4 and guarantee["epsilon"] == pytest.approx(honest, abs=1e-9)


# --- §4: a user-level card says users everywhere; no unnoised count unless asked for ------------------------------


def test_a_user_level_card_says_per_user_in_its_title_relation_and_not_covered_list() -> None:
    model, history = classifier(), PrivacyHistory()
    run = dp_run(model, user_rows(), history)
    guarantee = guarantee_of(checkpoint(history, run))
    card = model_card(guarantee, kind="classifier")
    assert card.splitlines()[0].endswith("per user (add/remove one user)")
    assert guarantee["protected_unit"] == "user" and guarantee["neighbouring_relation"].startswith(
        "add/remove one user"
    )
    assert "| neighbouring relation | add/remove one user" in card and "add/remove one example" not in card
    assert K_EPSILON not in card and all("k·ε" not in item for item in guarantee["not_covered"])
    assert "of the 6 training users" in card
    assert export_summary(Path("out"), guarantee).endswith("-DP per user, see README.md")


def test_the_largest_users_rows_are_published_only_when_asked_for_by_name() -> None:
    model, history = classifier(), PrivacyHistory()
    run = dp_run(model, user_rows(), history, private_diagnostics=True)
    default = guarantee_of(checkpoint(history, run))
    assert "largest_user_rows" not in json.dumps(default) and "has 5 rows" not in model_card(default, kind="x")
    assert "withheld" in default["privacy_unit"]
    published = guarantee_of(checkpoint(history, run), publish_private_diagnostics=True)
    assert published["largest_user_rows"] == 5 and published["private_diagnostics_published"] == ["largest_user_rows"]
    card = model_card(published, kind="x")
    assert "| rows of the largest user (computed without noise: not covered by ε) | 5 |" in card
    assert "the largest user has 5 rows, a count computed from the private data without noise" in card
    assert "withheld" not in published["privacy_unit"]
    off = dp_run(classifier(), user_rows(), PrivacyHistory(), private_diagnostics=False)
    asked = guarantee_of(checkpoint(off.history, off), publish_private_diagnostics=True)
    assert "largest_user_rows" not in asked and "not recorded" in asked["privacy_unit"]


# --- §5: each segment's own mechanism ----------------------------------------------------------------------------


def dp_segment(**facts: Any) -> dict[str, Any]:
    """A DP segment as the history keeps it (σ = 1, q = 0.1, 5 steps unless ``facts`` say otherwise)."""
    return {
        "kind": "dp", "run_id": "r", "accountant": [[1.0, 0.1, 5]], "max_grad_norm": 1.0, "dataset_size": 200,
        "delta": 1e-5, "mechanism": "prv", "noise": "os_entropy", "noise_secure": True, **facts,
    }  # fmt: skip


def test_the_history_table_shows_each_segments_unit_clipping_n_and_delta() -> None:
    segments = [
        dp_segment(privacy_unit="user", users=50, max_rows_per_user=4, dataset_size=50, clip_mode="quantile",
                   clip_bound_start=1.0, clip_bound_end=1.317, target_quantile=0.5),
        dp_segment(privacy_unit="user", users=50, max_rows_per_user=2, dataset_size=50, clip_mode="fixed",
                   max_grad_norm=1.0),
        dp_segment(),  # an old segment: no unit, no clip mode
    ]  # fmt: skip
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": segments}})
    card = model_card(guarantee, kind="causal LM")
    assert "| 1 | DP-SGD | 5 | 1, 0.1 (5) | user (k = 4) | quantile, C 1 → 1.317 | 50 | 1e-05 |" in card
    assert "| 2 | DP-SGD | 5 | 1, 0.1 (5) | user (k = 2) | fixed, C = 1 | 50 | 1e-05 |" in card
    assert "| 3 | DP-SGD | 5 | 1, 0.1 (5) | — | —, C = 1 | 200 | 1e-05 |" in card
    assert "| clipping bound | per segment, see the history |" in card


def test_the_facts_table_describes_no_step_with_the_last_segments_k_when_k_changed() -> None:
    segments = [dp_segment(privacy_unit="user", users=50, max_rows_per_user=k, dataset_size=50) for k in (4, 2)]
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": segments}})
    card = model_card(guarantee, kind="causal LM")
    assert "| rows of a user per step (at most) | per segment, see the history |" in card
    assert "max_rows_per_user" in guarantee["per_segment"] and guarantee["max_rows_per_user"] is None
    assert "at most k of them (k per segment, see the history)" in guarantee["privacy_unit"]
    bounds = [dp_segment(max_grad_norm=1.0), dp_segment(max_grad_norm=0.5)]
    card = model_card(guarantee_of({HISTORY_KEY: {"version": 1, "segments": bounds}}), kind="causal LM")
    assert "| clipping bound C | per segment, see the history |" in card and "clipped to norm C =" not in card
    same = guarantee_of({HISTORY_KEY: {"version": 1, "segments": [dp_segment(max_grad_norm=0.5)] * 2}})
    assert same["max_grad_norm"] == 0.5 and "| clipping bound C | 0.5 |" in model_card(same, kind="causal LM")


def test_a_declared_public_change_is_on_the_card_verbatim_and_adds_no_epsilon() -> None:
    statement = "re-initialised the LM head from gpt2 | nothing private used"
    change = {"kind": "public_change", "statement": statement, "where": "found before a DP-SGD fit"}
    plain = guarantee_of({HISTORY_KEY: {"version": 1, "segments": [dp_segment()]}})
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": [dp_segment(), change]}})
    assert guarantee["differentially_private"] is True and guarantee["epsilon"] == plain["epsilon"]
    assert guarantee["non_private_steps"] == 0 and guarantee["public_changes"] == 1
    card = model_card(guarantee, kind="causal LM")
    row = next(line for line in card.splitlines() if line.startswith("| 2 |"))
    quoted = '"' + statement.replace("|", "\\|") + '"'  # verbatim, its pipe escaped for the table
    assert "public change (declared by the user)" in row and quoted in row
    assert row.endswith("(found before a DP-SGD fit) |")


def test_a_non_private_segment_makes_the_card_not_private_and_is_on_it() -> None:
    segments = [dp_segment(), {"kind": "non_private", "steps": 3, "reason": "an unrecorded change of the weights"}]
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": segments}})
    assert guarantee["differentially_private"] is False and "an unrecorded change" in guarantee["reason"]
    card = model_card(guarantee, kind="causal LM")
    assert card.startswith("# NOT differentially private") and "| 2 | NOT private | 3 |" in card


def test_a_segment_of_an_unknown_kind_is_not_private() -> None:
    segments = [dp_segment(), {"kind": "from_the_future"}]
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": segments}})
    assert guarantee["differentially_private"] is False and "from_the_future" in guarantee["reason"]


def test_the_starting_point_is_in_the_record_and_on_the_card() -> None:
    origin = {"description": "hub model gpt2", "digest": "sha256:0123"}
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": [dp_segment()], "origin": origin}})
    assert guarantee["starting_point"] == "hub model gpt2" and guarantee["starting_point_digest"] == "sha256:0123"
    card = model_card(guarantee, kind="causal LM")
    assert "| starting point (public weights) | hub model gpt2 |" in card and "starting from hub model gpt2" in card
    assert guarantee["privacy_history"]["origin"] == origin
    assert "starting_point" not in guarantee_of({HISTORY_KEY: {"version": 1, "segments": [dp_segment()]}})


def test_a_replace_one_epsilon_over_users_equals_dp_accounting() -> None:
    segments = [dp_segment(privacy_unit="user", users=200, max_rows_per_user=4)]
    guarantee = guarantee_of({HISTORY_KEY: {"version": 1, "segments": segments}})
    assert guarantee["epsilon_replace_one"] == pytest.approx(epsilon_under("replace_one", [(1.0, 0.1, 5)], delta=1e-5))


# --- the same routes end to end: fit, export, refit from the export, export (the reproductions) -----------

SIGMA = ["--trainer.strategy.init_args.target_epsilon", "null", "--trainer.strategy.init_args.noise_multiplier", "1"]


def fit_and_export(folder: Path, *extra: str) -> dict[str, Any]:
    """``dplit fit`` of the quickstart (σ = 1, 2 steps, ``extra``), then ``dplit export``: its guarantee."""
    run_cli(["fit", *quickstart_args(folder / "run", *steps(2), *SIGMA, *extra)])
    export_checkpoint(checkpoint_of(folder / "run"), folder / "export")
    return json.loads((folder / "export" / GUARANTEE_FILE).read_text())


def built_on(export: Path) -> list[str]:
    return ["--model.config", "null", "--model.pretrained", str(export)]


@pytest.mark.slow
def test_a_refit_over_rows_of_a_user_level_export_is_composed_per_example(tmp_path: Path) -> None:
    users = fit_and_export(tmp_path / "users", "--data.privacy_unit", "user", "--data.max_rows_per_user", "4")
    assert users["protected_unit"] == "user"
    guarantee = fit_and_export(tmp_path / "rows", *built_on(tmp_path / "users" / "export"))
    first, second = [segment["accountant"] for segment in guarantee["privacy_history"]["segments"]]
    related = [("replace_one", *entry) for entry in first] + [("add_remove", *entry) for entry in second]
    honest = epsilon_composed(related, delta=guarantee["delta"])  # type: ignore[arg-type]
    assert guarantee["protected_unit"] == "example" and guarantee["epsilon"] == pytest.approx(honest, abs=1e-9)
    old = PrivacyAccountant(delta=guarantee["delta"])  # what the card said: both as add/remove one example
    old.load_state_dict({**old.state_dict(), "history": guarantee["accountant_history"]})
    assert guarantee["epsilon"] > old.epsilon()
    card = (tmp_path / "rows" / "export" / "README.md").read_text()
    assert "per training example (add/remove one)" in card.splitlines()[0] and "count as replace-one" in card


@pytest.mark.slow
def test_a_refit_on_a_smaller_dataset_keeps_the_first_datasets_delta_and_n(tmp_path: Path) -> None:
    """The issue: 4 more steps on 20 rows lowered a card from (1.357, δ = 0.0029) to (0.987, δ = 0.037)."""
    first = fit_and_export(tmp_path / "big")
    assert first["delta"] == default_delta(200)
    small = ["--data.synthetic_train_size", "20", "--data.batch_size", "2"]
    guarantee = fit_and_export(tmp_path / "small", *built_on(tmp_path / "big" / "export"), *small)
    assert guarantee["delta"] == default_delta(200) < default_delta(20)
    assert guarantee["epsilon"] > first["epsilon"] and guarantee["dataset_sizes"] == [200, 20]
    card = (tmp_path / "small" / "export" / "README.md").read_text()
    assert "of the 20 training rows" not in card and "N = 200 rows; N = 20 rows" in card


def test_a_history_of_pair_segments_protects_a_pair_and_a_mixed_one_an_example() -> None:
    """Issue 53: DPO segments protect one preference pair; beside row-level segments the claim is per example."""
    from dplit.privacy.composition import PER_UNIT, protected_unit
    from dplit.release.guarantee import PAIR_UNIT, privacy_unit_text

    pair, row = {"kind": "dp", "privacy_unit": "pair"}, {"kind": "dp", "privacy_unit": "example"}
    assert protected_unit([pair, pair]) == "pair" and PER_UNIT["pair"] == "per preference pair"
    assert protected_unit([row, pair]) == "example" and protected_unit([]) == "example"
    assert privacy_unit_text("pair", {}) == PAIR_UNIT and PAIR_UNIT.startswith("one preference pair")
