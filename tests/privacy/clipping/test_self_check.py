"""The ghost engine checks itself on the user's model: the audit's three silent failures, each refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dplit.privacy.clipping import GhostEngine
from dplit.privacy.clipping.engine import Batch
from dplit.privacy.clipping.norms import NORM_RULES, ExampleGradient, NormRule
from dplit.privacy.clipping.self_check import check_ghost_norms
from tests.helpers.brute_force import gradient_norms, per_example_gradients
from tests.helpers.fitting import fit, make_model


class TimeFirstLinear(nn.Module):
    """(a) A covered Linear applied to a [T, B, d] tensor: dim 0 is the position, not the example."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def per_example_loss(self, batch: Batch) -> Tensor:
        x = batch["x"]  # [B, T, 4]
        return self.proj(x.transpose(0, 1)).transpose(0, 1).tanh().pow(2).sum((1, 2))  # [T, B, 4] inside


class ReplacedForward(nn.Module):
    """(b) An nn.Linear whose forward is replaced on the instance (still exactly type nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.proj.forward = lambda x: F.linear(x * x, self.proj.weight, self.proj.bias)  # type: ignore[method-assign]

    def per_example_loss(self, batch: Batch) -> Tensor:
        return self.proj(batch["x"]).pow(2).sum((1, 2))


class CachedWeight(nn.Module):
    """(c) A tensor derived from a parameter before the forward (a cast copy, not a view) used in the forward."""

    def __init__(self, keep_graph: bool) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        with torch.set_grad_enabled(keep_graph):
            self.cached_head = self.head.weight * 1.0  # no longer the parameter or a view of it

    def per_example_loss(self, batch: Batch) -> Tensor:
        return F.linear(self.proj(batch["x"]).tanh(), self.cached_head).pow(2).sum((1, 2))


def batch(size: int, positions: int) -> Batch:
    return {"x": torch.randn(size, positions, 4, generator=torch.Generator().manual_seed(0))}


def test_a_time_first_input_is_silently_wrong_then_refused_by_the_self_check() -> None:
    torch.manual_seed(0)
    model, data = TimeFirstLinear(), batch(3, 3)  # T == B: the engine's dim-0 check cannot tell
    engine = GhostEngine(model, max_grad_norm=1.0)
    norms = engine.accumulate(model.per_example_loss, data).norms
    truth = gradient_norms(per_example_gradients(model, model.per_example_loss, data))
    assert not torch.allclose(norms, truth.to(norms.dtype), rtol=0.05)  # the silent failure the self-check exists for
    with pytest.raises(ValueError, match=r"self-check failed for trainable parameter 'proj\.(weight|bias)'"):
        check_ghost_norms(engine, model, model.per_example_loss, data)
    with pytest.raises(ValueError, match=r"'proj' \(Linear\) received input of shape \(5, 3, 4\)"):
        check_ghost_norms(engine, model, model.per_example_loss, batch(3, 5))  # T != B: refused by shape


def test_b_a_forward_replaced_on_the_instance_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'proj\.weight' belongs to 'proj' \(Linear\), whose forward was replaced"):
        GhostEngine(ReplacedForward(), max_grad_norm=1.0).check_parameters()


@pytest.mark.parametrize("keep_graph", [True, False], ids=["derived-with-graph", "derived-without-graph"])
def test_c_a_parameter_hidden_behind_a_derived_tensor_is_refused_by_name(keep_graph: bool) -> None:
    torch.manual_seed(0)
    model, data = CachedWeight(keep_graph), batch(3, 2)
    engine = GhostEngine(model, max_grad_norm=1.0)
    engine.check_parameters()  # every parameter has a rule: only running the model shows the hidden use
    with pytest.raises(ValueError, match=r"'head\.weight' is not used by any covered layer"):
        check_ghost_norms(engine, model, model.per_example_loss, data)


def test_a_correct_model_passes_and_grads_and_mode_are_untouched() -> None:
    model = make_model("tied")
    data = {"input_ids": torch.randint(0, 40, (4, 6)), "attention_mask": torch.ones(4, 6, dtype=torch.long)}
    data["labels"] = torch.tensor([0, 1, 1, 0])
    model.train()
    check_ghost_norms(GhostEngine(model, max_grad_norm=0.1), model, model.per_example_loss, data)
    assert model.training and all(p.grad is None for p in model.parameters())


def _doubled_bias_rule(rule: NormRule) -> NormRule:
    """A LayerNorm rule whose bias gradient is twice the truth (a wrong rule, as a buggy registration would be)."""

    def gradients(module: nn.Module, activation: Tensor, output_grad: Tensor) -> dict:
        uses = rule.gradients(module, activation, output_grad)
        return {**uses, "bias": ExampleGradient(2 * uses["bias"].values)}

    return NormRule(rule.parameter_names, gradients, rule.refusal)


def test_strategy_self_check_runs_before_the_first_step_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(NORM_RULES, nn.LayerNorm, _doubled_bias_rule(NORM_RULES[nn.LayerNorm]))
    with pytest.raises(ValueError, match=r"self-check failed for trainable parameter 'backbone\.transformer\.\S+\.bias'"):
        fit(tmp_path / "checked", make_model("tied"), max_steps=1)
    trainer, strategy = fit(tmp_path / "unchecked", make_model("tied"), max_steps=1, self_check=False)
    assert strategy.accountant.steps == 1  # without the check the wrong norms would have been used silently
