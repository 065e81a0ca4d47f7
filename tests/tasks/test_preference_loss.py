"""The preference losses against TRL's DPOTrainer loss code (the `trl` package, test-only), values and gradients."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dplit.tasks.preference_loss import PairLogProbs, check_preference_settings, preference_losses

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402

PAIRS, WIDTH = 5, 6


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def gather(value: torch.Tensor) -> torch.Tensor:
        return value


def trl_loss(pairs: PairLogProbs, *, beta: float, loss_type: str, label_smoothing: float = 0.0) -> torch.Tensor:
    """TRL 1.x's ``DPOTrainer._compute_loss`` on one pair (its batch mean is that pair's loss), run on a stub trainer.

    The stub model returns the policy's log-probabilities as per-token values (the sequence's in the first column),
    the reference's are precomputed inputs; TRL's code then forms the loss exactly as in training.
    """
    chosen_tokens, rejected_tokens = pairs.chosen_tokens, pairs.rejected_tokens
    completion = torch.zeros(2, WIDTH + 1)
    completion[0, : int(chosen_tokens)] = 1
    completion[1, : int(rejected_tokens)] = 1
    log_probs = torch.zeros(2, WIDTH, dtype=pairs.policy_chosen.dtype)
    log_probs = log_probs.index_put((torch.tensor([0, 1]), torch.tensor([0, 0])),
                                    torch.stack([pairs.policy_chosen, pairs.policy_rejected]).reshape(2))  # fmt: skip
    outputs = SimpleNamespace(
        log_probs=log_probs, entropy=torch.zeros(2, WIDTH), mean_logits=torch.zeros(2, WIDTH),
        is_top1=torch.zeros(2, WIDTH, dtype=torch.bool),
    )  # fmt: skip
    model = SimpleNamespace(training=True)
    stub = SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {
        "input_ids": torch.zeros(2, WIDTH + 1, dtype=torch.long), "attention_mask": torch.ones(2, WIDTH + 1),
        "completion_mask": completion, "ref_chosen_logps": pairs.reference_chosen.reshape(1),
        "ref_rejected_logps": pairs.reference_rejected.reshape(1),
    }  # fmt: skip
    return DPOTrainer._compute_loss(stub, lambda **_: outputs, inputs, return_outputs=False)


def _pairs(seed: int) -> tuple[PairLogProbs, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    policy = (-torch.rand(2, PAIRS, generator=generator, dtype=torch.float64) * 20).requires_grad_()
    reference = -torch.rand(2, PAIRS, generator=generator, dtype=torch.float64) * 20
    tokens = torch.randint(1, WIDTH + 1, (2, PAIRS), generator=generator).double()
    pairs = PairLogProbs(policy[0], policy[1], reference[0], reference[1], tokens[0], tokens[1])
    return pairs, policy


# TRL 1.x's "sigmoid" has no label smoothing; its "aot" loss on one pair (a sort of one value) is cDPO's form.
CASES = [("sigmoid", "sigmoid", 0.1, 0.0), ("sigmoid", "sigmoid", 2.0, 0.0), ("sigmoid", "aot", 0.5, 0.2),
         ("ipo", "ipo", 0.1, 0.0), ("ipo", "ipo", 1.5, 0.0)]  # fmt: skip


@pytest.mark.parametrize(("ours", "theirs", "beta", "smoothing"), CASES)
def test_losses_and_gradients_match_trl(ours: str, theirs: str, beta: float, smoothing: float) -> None:
    pairs, policy = _pairs(seed=int(beta * 10))
    losses = preference_losses(pairs, beta=beta, label_smoothing=smoothing, loss_type=ours)
    for index in range(PAIRS):
        one = PairLogProbs(*(getattr(pairs, field)[index] for field in PairLogProbs.__dataclass_fields__))
        expected = trl_loss(one, beta=beta, loss_type=theirs, label_smoothing=smoothing)
        ours_value, theirs_value = losses[index].item(), expected.item()
        assert abs(ours_value - theirs_value) <= 1e-6 * max(1.0, abs(theirs_value))
        ours_grad = torch.autograd.grad(losses[index], policy, retain_graph=True)[0]
        theirs_grad = torch.autograd.grad(expected, policy, retain_graph=True)[0]
        torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-6, rtol=1e-6)
        assert ours_grad[:, index].abs().sum() > 0  # the pair's loss moves both its answers' log-probabilities


def test_margin_is_beta_times_the_log_ratio_difference() -> None:
    pairs = PairLogProbs(*(torch.tensor([value], dtype=torch.float64) for value in (-3.0, -5.0, -4.0, -4.5)))
    assert float(pairs.margins(0.5)) == pytest.approx(0.5 * ((-3 + 4) - (-5 + 4.5)))


@pytest.mark.parametrize(
    ("beta", "smoothing", "loss_type", "flag"),
    [(0.0, 0.0, "sigmoid", "model.beta"), (-1.0, 0.0, "sigmoid", "model.beta"),
     (float("nan"), 0.0, "sigmoid", "model.beta"), (0.1, 0.5, "sigmoid", "model.label_smoothing"),
     (0.1, 0.0, "hinge", "model.loss_type"), (0.1, 0.1, "ipo", "model.label_smoothing")],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_flag(beta: float, smoothing: float, loss_type: str, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        check_preference_settings(beta, smoothing, loss_type)
