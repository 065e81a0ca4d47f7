"""DPSGD without Lightning, on a tiny float64 model: exact releases, the hooks, the budget, its state, its settings."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.privacy.accounting import PrivacyAccountant, default_delta
from dplit.privacy.clipping.engine import trainable_parameters
from dplit.privacy.dpsgd import DPSGD
from dplit.privacy.settings import DPSGDSettings
from dplit.tasks.classifier import GPT2Classifier
from tests.helpers import brute_force
from tests.helpers.tiny import LABEL_WORDS, TINY_GPT2, VOCAB, PadCollate, RandomTokens

pytestmark = pytest.mark.filterwarnings("ignore::dplit.privacy.warnings.PrivacyWarning")  # seeded, σ = 0
C = 0.1
ROWS, BATCH = 24, 6


def make_model(policy: str) -> GPT2Classifier:
    torch.manual_seed(0)
    embeddings = TiedEmbeddings() if policy == "tied" else UntiedEmbeddings()
    return GPT2Classifier(config=TINY_GPT2, vocab_size=VOCAB, label_word_ids=LABEL_WORDS, embeddings=embeddings).double()


def make_dpsgd(model: GPT2Classifier, **settings: Any) -> tuple[DPSGD, DataLoader]:
    """A DPSGD on ``model`` (seeded, σ = 0 unless given) and its Poisson loader of variable-length, padded rows."""
    knobs = {"max_grad_norm": C, "noise_multiplier": 0.0, "seed": 0, "max_physical_batch_size": 4, **settings}
    dpsgd = DPSGD(model, DPSGDSettings(**knobs), history=model.privacy_history)
    rows = DataLoader(RandomTokens(ROWS, seed=3), batch_size=BATCH, collate_fn=PadCollate("right"))
    return dpsgd, dpsgd.sample(rows)


def nonempty_batches(loader: DataLoader, count: int) -> list[dict[str, torch.Tensor]]:
    batches = [batch for batch in loader if batch["input_ids"].shape[0] > 1][:count]
    assert len(batches) == count
    return batches


def flat(sums: dict[str, torch.Tensor], model: GPT2Classifier) -> torch.Tensor:
    return torch.cat([sums[name].reshape(-1) for name in trainable_parameters(model)])  # [P]


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("clipping", ["ghost", "per_example"])
def test_a_step_releases_the_brute_force_clipped_sum_over_qn(policy: str, clipping: str) -> None:
    model = make_model(policy)
    dpsgd, loader = make_dpsgd(model, clipping=clipping)
    dpsgd.start(planned_steps=4)
    batch = nonempty_batches(loader, 1)[0]
    grads = brute_force.per_example_gradients(model, model.per_example_loss, batch)
    expected = brute_force.clipped_sum(grads, C)
    assert bool((brute_force.gradient_norms(grads) > C).any())  # clipping bites
    stats = dpsgd.clip(model.per_example_loss, batch)
    assert all(p.grad is None for p in model.parameters())  # nothing is where an optimizer could step before release
    torch.testing.assert_close(stats.norms, brute_force.gradient_norms(grads))
    dpsgd.release()
    for name, param in trainable_parameters(model).items():
        torch.testing.assert_close(param.grad, expected[name] / (ROWS * (BATCH / ROWS)))
    assert dpsgd.budget.steps == 1 and model.privacy_history.dp_steps == 1


def test_the_hooks_see_the_clipped_sum_then_the_noisy_sum_in_their_order_until_removed() -> None:
    model = make_model("tied")
    dpsgd, loader = make_dpsgd(model, noise_multiplier=2.0)
    dpsgd.start(planned_steps=4)
    first, second = nonempty_batches(loader, 2)
    expected = flat(brute_force.clipped_sum(brute_force.per_example_gradients(model, model.per_example_loss, first), C), model)
    seen: list[tuple[str, torch.Tensor]] = []
    dpsgd.register_before_noise_hook(lambda _, clipped: seen.append(("clipped", clipped.clone())))
    handle = dpsgd.register_after_noise_hook(lambda _, noisy: seen.append(("noisy", noisy.clone())))
    dpsgd.register_after_noise_hook(lambda _, noisy: seen.append(("prepended", noisy.clone())), prepend=True)
    dpsgd.clip(model.per_example_loss, first)
    dpsgd.release()
    assert [name for name, _ in seen] == ["clipped", "prepended", "noisy"]
    torch.testing.assert_close(seen[0][1], expected)
    noise = seen[2][1] - seen[0][1]
    assert abs(noise.std().item() / (2.0 * C) - 1) < 0.05  # σC, drawn once per coordinate (P ≈ 10⁵ draws)
    released = torch.cat([p.grad.reshape(-1) for p in trainable_parameters(model).values()])
    torch.testing.assert_close(released, seen[2][1] / dpsgd.expected_batch_size)
    handle.remove()
    seen.clear()
    dpsgd.clip(model.per_example_loss, second)
    dpsgd.release()
    assert [name for name, _ in seen] == ["clipped", "prepended"]


def test_a_before_noise_hook_that_writes_changes_the_release() -> None:
    model = make_model("untied")
    dpsgd, loader = make_dpsgd(model)
    dpsgd.start(planned_steps=4)
    batch = nonempty_batches(loader, 1)[0]
    expected = flat(brute_force.clipped_sum(brute_force.per_example_gradients(model, model.per_example_loss, batch), C), model)
    dpsgd.register_before_noise_hook(lambda _, clipped: clipped.mul_(3.0))
    dpsgd.clip(model.per_example_loss, batch)
    dpsgd.release()
    released = torch.cat([p.grad.reshape(-1) for p in trainable_parameters(model).values()])
    torch.testing.assert_close(released, 3.0 * expected / dpsgd.expected_batch_size)


def test_the_budget_stops_after_the_planned_steps_and_a_forced_step_is_refused() -> None:
    model = make_model("untied")
    dpsgd, loader = make_dpsgd(model, noise_multiplier=None, target_epsilon=2.0, clipping="per_example")
    assert dpsgd.start(planned_steps=3) is False
    stops = []
    for batch in nonempty_batches(loader, 3):
        dpsgd.clip(model.per_example_loss, batch)
        stops.append(dpsgd.release())
    assert stops == [False, False, True]
    assert dpsgd.budget.epsilon_spent <= 2.0 and dpsgd.budget.should_stop
    reference = PrivacyAccountant(delta=default_delta(ROWS))
    reference.load_state_dict({**reference.state_dict(), "history": [(dpsgd.noise_multiplier, BATCH / ROWS, 3)]})
    assert math.isclose(dpsgd.budget.epsilon_spent, reference.epsilon(), rel_tol=1e-9)
    dpsgd.clip(model.per_example_loss, nonempty_batches(loader, 1)[0])
    with pytest.raises(ValueError, match="would spend"):
        dpsgd.release()


def test_its_state_continues_the_ledger_on_the_same_weights() -> None:
    model = make_model("untied")
    dpsgd, loader = make_dpsgd(model, noise_multiplier=1.0, clipping="per_example")
    dpsgd.start(planned_steps=4)
    for batch in nonempty_batches(loader, 2):
        dpsgd.clip(model.per_example_loss, batch)
        dpsgd.release()
    state = dpsgd.state_dict()
    assert state["dataset_size"] == ROWS and state["noise_multiplier"] == 1.0 and "seed" not in state
    resumed, loader = make_dpsgd(model, noise_multiplier=1.0, clipping="per_example")
    resumed.load_state_dict(state)
    resumed.start(planned_steps=4, steps_done=2)
    assert resumed.budget.steps == 2 and resumed.budget.steps_this_run == 0
    resumed.clip(model.per_example_loss, nonempty_batches(loader, 1)[0])
    resumed.release()
    assert resumed.budget.steps == 3 and model.privacy_history.dp_steps == 3


def test_calls_out_of_order_are_refused() -> None:
    model = make_model("untied")
    dpsgd = DPSGD(model, DPSGDSettings(max_grad_norm=C, noise_multiplier=1.0), history=model.privacy_history)
    with pytest.raises(RuntimeError, match="DPSGD.sample first"):
        dpsgd.start(planned_steps=1)
    with pytest.raises(RuntimeError, match="DPSGD.start must run"):
        dpsgd.release()


@pytest.mark.parametrize(
    ("knobs", "flag"),
    [
        ({"max_grad_norm": 0.0, "noise_multiplier": 1.0}, "DPStrategy.max_grad_norm"),
        ({"max_grad_norm": float("nan"), "noise_multiplier": 1.0}, "DPStrategy.max_grad_norm"),
        ({"max_grad_norm": 1.0}, "DPStrategy.noise_multiplier and DPStrategy.target_epsilon"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "target_epsilon": 3.0}, "exactly one of"),
        ({"max_grad_norm": 1.0, "noise_multiplier": -1.0}, "DPStrategy.noise_multiplier"),
        ({"max_grad_norm": 1.0, "target_epsilon": float("inf")}, "DPStrategy.target_epsilon"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "target_delta": 0.5}, "DPStrategy.target_delta"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "max_physical_batch_size": 0}, "max_physical_batch_size"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "clipping": "opacus"}, "DPStrategy.clipping"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "tied_norm": "loose"}, "DPStrategy.tied_norm"),
        ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "accountant": "gdp"}, "DPStrategy.accountant"),
    ],
)
def test_every_bad_setting_is_refused_in_one_line_naming_its_flag(knobs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag) as refusal:
        DPSGDSettings(**knobs)
    assert "\n" not in str(refusal.value)


def test_a_planned_run_asks_the_accountant_for_epsilon_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accountant computes ε a bounded number of times, never once per step.

    One PRV ε costs 0.1-1.5 s: the plan is verified once, ε refreshed at the first and last steps (and, at most
    EPSILON_OVERHEAD of the time, between them: 0 here), and the step past the plan is checked.
    """
    calls: list[dict[str, Any]] = []
    epsilon = PrivacyAccountant.epsilon
    monkeypatch.setattr(PrivacyAccountant, "epsilon", lambda self, **kw: calls.append(kw) or epsilon(self, **kw))
    monkeypatch.setattr("dplit.privacy.budget.EPSILON_OVERHEAD", 0.0)
    model = make_model("untied")
    dpsgd, loader = make_dpsgd(model, noise_multiplier=None, target_epsilon=4.0, clipping="per_example")
    dpsgd.start(planned_steps=8)
    stops = []
    for batch in nonempty_batches(loader, 4) * 2:
        dpsgd.clip(model.per_example_loss, batch)
        stops.append(dpsgd.release())
        if dpsgd.budget.steps in (1, 8):
            assert dpsgd.budget.epsilon_steps == dpsgd.budget.steps
    assert stops == [False] * 7 + [True]
    assert [call.get("extra_steps") for call in calls] == [8, None, 2, None]  # the plan; step 1; does a 9th fit?; step 8
    assert dpsgd.budget.epsilon_steps == 8 and dpsgd.budget.epsilon_spent <= 4.0
