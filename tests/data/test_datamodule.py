"""The DataModule base: one set of shared options, the unit a dataset declares, the diagnostics a strategy allows."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from dplit.data.batches import TokenizedDataset
from dplit.data.datamodule import DPDataModule
from dplit.data.glue import GlueDataModule
from dplit.data.preference import PreferenceDataModule, PreferenceDataset
from dplit.data.text import TextDataModule, TextDataset
from dplit.privacy.diagnostics import private_diagnostics_allowed
from dplit.privacy.training_units import PAIR_UNIT, row_unit_of
from dplit.privacy.user_sampling import UnitDataset, user_level_of

MODULES = (GlueDataModule, TextDataModule, PreferenceDataModule)
SHARED = [name for name in inspect.signature(DPDataModule.__init__).parameters if name not in ("self", "privacy_unit")]


@pytest.mark.parametrize("module", MODULES, ids=lambda module: module.__name__)
def test_every_datamodule_takes_the_shared_options_once_with_their_defaults(module: type[DPDataModule]) -> None:
    parameters = inspect.signature(module).parameters  # what the config checks read
    names = list(parameters)
    assert len(names) == len(set(names)) and set(SHARED) <= set(names) and "privacy_unit" in names
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    defaults = module.option_defaults()
    assert (defaults["batch_size"], defaults["eval_batch_size"], defaults["max_length"]) == (32, 64, 256)
    assert defaults["tokenizer"] == "gpt2" and defaults["max_rows_per_user"] == 1


def test_hyperparameters_hold_every_option_of_every_level() -> None:
    """A checkpoint's data hyperparameters (read back by ``dplit export``) hold the base's options and the subclass'."""
    data = TextDataModule(batch_size=5, builtin_train_size=10, overlength="refuse")
    assert dict(data.hparams) == {**TextDataModule.option_defaults(), "batch_size": 5, "builtin_train_size": 10,
                                  "overlength": "refuse"}  # fmt: skip
    assert PreferenceDataModule(seed=3).hparams.privacy_unit == PAIR_UNIT


def test_the_shared_checks_refuse_for_every_module() -> None:
    for module in MODULES:
        with pytest.raises(ValueError, match=r"^data.batch_size must be a positive integer, got 0$"):
            module(batch_size=0)
        with pytest.raises(ValueError, match=r"^data.max_train_examples must be a positive integer, got -1$"):
            module(max_train_examples=-1)
    with pytest.raises(ValueError, match=r"^data.privacy_unit must be one of pair, user, got 'example'$"):
        PreferenceDataModule(privacy_unit="example")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^data.max_rows_per_user=2 is set but data.privacy_unit='pair'"):
        PreferenceDataModule(max_rows_per_user=2)


def test_datasets_declare_their_unit_and_users_to_dp_sgd() -> None:
    examples = TextDataset([{"input_ids": [1, 2], "loss_mask": [0, 1]}] * 3, users=[0, 1, 0], max_rows_per_user=2)
    prompts = TokenizedDataset([[1], [2]], [0, 1])
    pairs = PreferenceDataset([{"chosen_ids": [1], "chosen_mask": [1], "rejected_ids": [2], "rejected_mask": [1]}])
    assert all(isinstance(dataset, UnitDataset) for dataset in (examples, prompts, pairs))
    level = user_level_of(examples)
    assert level is not None and level.user_rows == [[0, 2], [1]] and level.max_rows_per_user == 2
    assert examples[2] == {"input_ids": [1, 2], "loss_mask": [0, 1], "user": 0} and "user" not in prompts[0]
    assert user_level_of(prompts) is None and user_level_of(TensorDataset(torch.zeros(2))) is None
    assert (row_unit_of(pairs), row_unit_of(prompts), row_unit_of(TensorDataset(torch.zeros(2)))) == (
        PAIR_UNIT, "example", "example"
    )  # fmt: skip
    with pytest.raises(ValueError, match="2 users but 3 items"):
        TextDataset([{"input_ids": [1], "loss_mask": [1]}] * 3, users=[0, 1])


def test_diagnostics_are_kept_out_only_where_the_strategy_says_so() -> None:
    assert private_diagnostics_allowed(None) and private_diagnostics_allowed(object())
    assert private_diagnostics_allowed(SimpleNamespace(private_diagnostics=True))
    assert not private_diagnostics_allowed(SimpleNamespace(private_diagnostics=False))
    data = GlueDataModule("synthetic", synthetic_train_size=20, synthetic_val_size=4)
    assert data.private_diagnostics  # no trainer yet
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(private_diagnostics=False))  # type: ignore[assignment]
    assert not data.private_diagnostics
