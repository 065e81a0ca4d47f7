"""DP-SGD over users (data.privacy_unit: user): N and q count users, each user's summed gradient is clipped once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from opacus.accountants import PRVAccountant
from torch.utils.data import DataLoader

from dplit.backbone.embeddings import TiedEmbeddings
from dplit.cli.lightning_cli import run_cli
from dplit.data.batches import PadCollator, TokenizedDataset
from dplit.privacy.accounting import default_delta
from dplit.privacy.clipping.units import UNIT_KEY, split_batch, units_of
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.history import HISTORY_KEY, PrivacyHistory
from dplit.privacy.ledger import CHECKPOINT_KEY, LEDGER_FILE, history_steps
from dplit.privacy.settings import DPSGDSettings
from dplit.release.export import export_checkpoint
from dplit.release.guarantee import GUARANTEE_FILE, PRIVACY_UNIT, guarantee_of
from dplit.tasks.classifier import CausalLMClassifier
from tests.helpers.brute_force import clipped_sum, per_unit_gradients
from tests.helpers.commands import checkpoint_of, quickstart_args, steps
from tests.helpers.executable import run_dplit, run_dplit_in_process
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB

USERS = [0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4, 4, 5]
"""13 rows of 6 users, of 1 to 5 rows."""
CLIP = 0.05


def user_dataset(max_rows: int = 3) -> TokenizedDataset:
    """Random prompts of 2 to 8 tokens owned by :data:`USERS`."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator)
               for _ in USERS]  # fmt: skip
    return TokenizedDataset([p.tolist() for p in prompts], [int(p[0]) % 2 for p in prompts], users=USERS,
                            max_rows_per_user=max_rows)  # fmt: skip


def classifier() -> CausalLMClassifier:
    torch.manual_seed(0)
    model = CausalLMClassifier(
        config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS, embeddings=TiedEmbeddings()
    )
    return model.double()


def dpsgd_on(model: CausalLMClassifier, dataset: TokenizedDataset, *, batch: int, micro: int) -> DPSGD:
    settings = DPSGDSettings(
        max_grad_norm=CLIP, noise_multiplier=0.0, target_delta=1e-3, max_physical_batch_size=micro, self_check=False
    )
    dpsgd = DPSGD(model, settings, history=PrivacyHistory())
    dpsgd.sample(DataLoader(dataset, batch_size=batch, collate_fn=PadCollator(pad_token_id=0)))
    return dpsgd


def test_n_and_q_count_users_and_each_users_rows_are_clipped_together() -> None:
    """σ = 0, float64: the release is Σ_u clip_C(Σ_{i∈u} g_i) / (q·U), micro-batches never splitting a user."""
    model, dataset = classifier(), user_dataset(max_rows=3)
    dpsgd = dpsgd_on(model, dataset, batch=3, micro=3)
    assert dpsgd.dataset_size == 6 and dpsgd.sample_rate == pytest.approx(3 / 6)
    dpsgd.start(planned_steps=1)
    rows = [0, 1, 2, 3, 4, 5, 7, 8, 9]  # users 0, 1, 2 whole (1, 2, 3 rows) and 3 of user 4's 5 rows
    batch = PadCollator(pad_token_id=0)([dataset[i] for i in rows])
    dpsgd.clip(model.per_example_loss, batch)
    dpsgd.release()
    plain = {key: value for key, value in batch.items() if key != UNIT_KEY}
    users = per_unit_gradients(model, model.per_example_loss, plain, batch[UNIT_KEY])
    expected = clipped_sum(users, CLIP)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name] / 3, rtol=0, atol=1e-12, msg=name)


def one_step(
    model: CausalLMClassifier, dataset: TokenizedDataset, history: PrivacyHistory, *, private_diagnostics: bool = True
) -> DPSGD:
    """One noisy DP step on the whole of ``dataset`` (example- or user-level, as the dataset says)."""
    settings = DPSGDSettings(
        max_grad_norm=CLIP, noise_multiplier=1.0, target_delta=1e-3, self_check=False,
        private_diagnostics=private_diagnostics,
    )  # fmt: skip
    mechanism = DPSGD(model, settings, history=history)
    mechanism.sample(DataLoader(dataset, batch_size=3, collate_fn=PadCollator(pad_token_id=0)))
    mechanism.start(planned_steps=1)
    mechanism.clip(model.per_example_loss, PadCollator(pad_token_id=0)([dataset[i] for i in range(len(dataset))]))
    mechanism.release()
    model.zero_grad(set_to_none=True)
    return mechanism


def test_the_card_says_per_user_only_when_every_segment_protected_users() -> None:
    """A refit at user level on weights an example-level run trained protects rows only: the card says so."""
    model, users = classifier(), user_dataset()
    rows = TokenizedDataset(users.input_ids, users.labels)  # the same rows, each its own unit
    mixed, user_only = PrivacyHistory(), PrivacyHistory()
    one_step(model, rows, mixed)
    one_step(model, users, mixed)
    one_step(model, users, user_only)
    assert guarantee_of({HISTORY_KEY: mixed.state_dict()})["privacy_unit"] == PRIVACY_UNIT
    assert "users" not in guarantee_of({HISTORY_KEY: mixed.state_dict()})
    per_user = guarantee_of({HISTORY_KEY: user_only.state_dict()})
    assert per_user["privacy_unit"].startswith("one user") and per_user["users"] == 6


@pytest.mark.parametrize("private_diagnostics", [True, False])
def test_the_card_states_the_largest_users_rows_only_as_a_private_diagnostic(private_diagnostics: bool) -> None:
    """The largest user's row count (5 of :data:`USERS`) is computed without noise: stated outside ε, or not at all.

    The run's ledger records it only while ``private_diagnostics`` is on, and a guarantee states it only when the
    export asks for it by name (issue 49 §4); the weights' history never holds it (it outlives the run), so a later
    run with the diagnostics off leaves nothing to state.
    """
    history = PrivacyHistory()
    run = one_step(classifier(), user_dataset(), history, private_diagnostics=private_diagnostics)
    checkpoint = {HISTORY_KEY: history.state_dict(), CHECKPOINT_KEY: run.state_dict()}
    card = guarantee_of(checkpoint, publish_private_diagnostics=True)
    assert ("largest_user_rows" in card) is private_diagnostics
    assert "largest_user_rows" not in json.dumps(history.state_dict())
    assert "largest_user_rows" not in json.dumps(guarantee_of(checkpoint))  # not asked for: never released
    if private_diagnostics:
        assert card["largest_user_rows"] == max(USERS.count(user) for user in set(USERS)) == 5
        stated = "the largest user has 5 rows, a count computed from the private data without noise"
        assert stated in card["privacy_unit"] and "withheld" not in card["privacy_unit"]
    else:
        assert "the largest user's row count is not stated: not recorded" in card["privacy_unit"]
    refit = one_step(classifier(), user_dataset(), history, private_diagnostics=False)  # on, then off: not recorded
    later = guarantee_of(
        {HISTORY_KEY: history.state_dict(), CHECKPOINT_KEY: refit.state_dict()}, publish_private_diagnostics=True
    )
    assert "largest_user_rows" not in json.dumps(later) and "not recorded" in later["privacy_unit"]


def test_micro_batches_hold_whole_users() -> None:
    batch = {"x": torch.arange(9), UNIT_KEY: torch.tensor([5, 5, 1, 7, 7, 7, 1, 2, 2])}
    chunks = list(split_batch(batch, 4))
    assert sorted(torch.cat([c["x"] for c in chunks]).tolist()) == list(range(9))
    for chunk in chunks:
        assert len(chunk["x"]) <= 4
    owners = [set(chunk[UNIT_KEY].tolist()) for chunk in chunks]
    assert all(not (a & b) for i, a in enumerate(owners) for b in owners[i + 1 :])  # no user in two micro-batches


def test_micro_batches_smaller_than_k_are_refused() -> None:
    dpsgd = dpsgd_on(classifier(), user_dataset(max_rows=3), batch=3, micro=2)
    with pytest.raises(ValueError, match="max_physical_batch_size=2 is below data.max_rows_per_user=3"):
        dpsgd.start(planned_steps=1)


def test_an_expected_batch_larger_than_the_users_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data.batch_size must be in \[1, 6\] \(the expected users per batch"):
        dpsgd_on(classifier(), user_dataset(), batch=7, micro=8)


def test_a_user_level_batch_without_its_users_is_refused() -> None:
    """A collate function that drops the users would clip rows one by one (k·C per user) while ε counts users."""
    model, dataset = classifier(), user_dataset()
    mechanism = dpsgd_on(model, dataset, batch=3, micro=3)
    mechanism.start(planned_steps=1)
    batch = PadCollator(pad_token_id=0)([dataset[i] for i in (0, 1, 2)])
    del batch[UNIT_KEY]
    with pytest.raises(ValueError, match="the training batch has no 'privacy_unit' field"):
        mechanism.clip(model.per_example_loss, batch)


def test_sampled_users_bring_at_most_k_rows() -> None:
    dpsgd = dpsgd_on(classifier(), user_dataset(max_rows=2), batch=3, micro=4)
    loader = dpsgd.sample(DataLoader(user_dataset(max_rows=2), batch_size=3, collate_fn=PadCollator(pad_token_id=0)))
    for batch in loader:
        units = units_of(batch)
        if units is not None:
            assert units.most_rows <= 2


@pytest.mark.slow
def test_a_user_level_run_accounts_users_and_its_card_says_so(tmp_path: Path) -> None:
    """The quickstart over its synthetic users: ε over (q = B/users, σ, steps) equals opacus' for the same numbers."""
    args = quickstart_args(tmp_path, *steps(3), "--data.privacy_unit", "user", "--data.max_rows_per_user", "4")
    cli = run_cli(["fit", *args, "--trainer.strategy.init_args.target_epsilon", "null",
                   "--trainer.strategy.init_args.noise_multiplier", "1.0"])  # fmt: skip
    dpsgd = cli.trainer.strategy.dpsgd
    users = max(cli.datamodule.dataset("train").users) + 1
    assert dpsgd.dataset_size == users < len(cli.datamodule.dataset("train"))
    reference = PRVAccountant()
    assert dpsgd.budget.steps >= 2 and dpsgd.budget.epsilon_steps == dpsgd.budget.steps  # an epoch is users / batch steps
    reference.history = [(1.0, cli.datamodule.batch_size / users, dpsgd.budget.steps)]
    assert dpsgd.budget.epsilon_spent == pytest.approx(reference.get_epsilon(default_delta(users)), rel=1e-3)
    export_checkpoint(checkpoint_of(tmp_path), tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "with respect to one user (all of that user's training rows; at most 4" in card
    assert f"of the {users} training users" in card
    assert card.splitlines()[0].endswith("per user (add/remove one user)")
    largest = max(Counter(cli.datamodule.dataset("train").users).values())
    guarantee = (tmp_path / "out" / GUARANTEE_FILE).read_text()
    assert f'"users": {users}' in guarantee and '"max_rows_per_user": 4' in guarantee
    assert "largest_user_rows" not in guarantee + card and "the largest user's row count is withheld" in card
    asked = run_dplit_in_process(
        "export", "--ckpt_path", str(checkpoint_of(tmp_path)), "--output_dir", str(tmp_path / "asked"),
        "--publish_private_diagnostics",
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    card = (tmp_path / "asked" / "README.md").read_text()
    assert f"the largest user has {largest} rows, a count computed from the private data without noise" in card
    assert f"| rows of the largest user (computed without noise: not covered by ε) | {largest} |" in card
    guarantee = (tmp_path / "asked" / GUARANTEE_FILE).read_text()
    assert f'"largest_user_rows": {largest}' in guarantee and '"private_diagnostics_published"' in guarantee


@pytest.mark.slow
def test_two_data_parallel_processes_train_over_users_with_a_quantile_bound(tmp_path: Path) -> None:
    """DDP through the real ``dplit``: users sharded over 2 gloo ranks, one noisy count, one C_t, one ledger.

    Users (not rows) are sharded over the ranks, N and q count users; each rank counts its users under the bound,
    rank 0 noises the count, and every rank moves to the same C_t. One two-process run for both (each costs a fresh interpreter per rank); ``test_sharded_strategy.py`` runs the
    same pair on FSDP2.
    """
    users = ["--data.privacy_unit", "user", "--data.max_rows_per_user", "4"]
    ddp = ["--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.limit_train_batches", "2",
           "--trainer.strategy.init_args.clip_mode", "quantile"]  # fmt: skip
    done = run_dplit("fit", *quickstart_args(tmp_path, *ddp, "--trainer.max_epochs", "1", *users))
    assert done.returncode == 0, done.stderr[-3000:]
    ledger = json.loads(max(tmp_path.rglob(LEDGER_FILE), key=lambda path: path.stat().st_mtime).read_text())
    assert ledger["privacy_unit"] == "user" and ledger["users"] == ledger["dataset_size"] < 200
    assert ledger["clip_mode"] == "quantile" and ledger["clip_bound"] != 1.0
    assert history_steps(ledger["accountant"]["history"]) == 2
