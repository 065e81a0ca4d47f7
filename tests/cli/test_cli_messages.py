"""dplit.cli.messages: jsonargparse's parse errors, exactly as the installed jsonargparse writes them → dplit's line.

:data:`REWRITES` pins each shape of message dplit rewrites, captured from ``dplit fit --config
configs/quickstart.yaml`` plus the flag shown (jsonargparse 4.53.0, Lightning 2.6.6). The catalogue of
``test_bad_inputs.py`` checks the same lines end to end; here a change of the rewriting shows as the one message
it broke, and :func:`test_the_installed_jsonargparse_still_writes_the_pinned_messages` fails first when a
jsonargparse upgrade changes how it writes them.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Literal, NamedTuple, Optional, Union

import pytest
from jsonargparse import ArgumentParser

from dplit.backbone.adapters import MISSING_PEFT
from dplit.cli.messages import essential_error
from dplit.flag_types import Number, PositiveNumber


class Rewrite(NamedTuple):
    """One parse error: what the user gave, the message jsonargparse wrote, the line dplit prints after ``error:``."""

    name: str
    given: str
    message: str
    line: str


REWRITES = [
    Rewrite(
        "delta-text",
        "--trainer.strategy.init_args.target_delta abc",
        (
            'Parser key "target_delta":\n'
            "  Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'dplit.flag_types.Number'>, <class 'NoneType'>]\n"
            "  Errors:\n"
            "    - Not of type Number: 'abc': must be a number\n"
            "    - Expected a <class 'NoneType'>\n"
            "  Given value type: <class 'str'>\n"
            "  Given value: abc"
        ),
        "target_delta='abc': must be a number",
    ),
    Rewrite(
        "lr-text",
        "--model.lr abc",
        "Parser key \"model.lr\":\n  Not of type PositiveNumber: 'abc': must be a finite number > 0",
        "model.lr='abc': must be a finite number > 0",
    ),
    Rewrite(
        "negative-lr",
        "--model.lr -0.001",
        'Parser key "model.lr":\n  Not of type PositiveNumber: -0.001: must be a finite number > 0',
        "model.lr=-0.001: must be a finite number > 0",
    ),
    Rewrite(
        "both",
        "--trainer.strategy.init_args.noise_multiplier 1.0 (the quickstart sets target_epsilon)",
        (
            "Does not validate against any of the Union subtypes\n"
            "Subtypes: [<class 'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>]\n"
            "Errors:\n"
            "  - Expected a <class 'str'>\n"
            "  - set exactly one of DPStrategy.noise_multiplier and DPStrategy.target_epsilon (got noise_multiplier=1.0, target_epsilon=8.0)\n"
            "Given value type: <class 'jsonargparse._namespace.Namespace'>\n"
            "Given value: Namespace(class_path='dplit.strategy.DPStrategy', init_args=Namespace(max_grad_norm=1.0, noise_multiplier=1.0, target_epsilon=8.0, target_delta=None, accountant='prv', clipping='ghost', tied_norm='exact', max_physical_batch_size=512, self_check=True, seed=None, allow_large_delta=False, private_diagnostics=True, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision_plugin=None, ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None, model_averaging_period=None, process_group_backend=None, timeout=datetime.timedelta(seconds=1800), start_method='popen', output_device=None, dim=0, broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False, gradient_as_bucket_view=False, static_graph=False, delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False, bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None))"
        ),
        "set exactly one of DPStrategy.noise_multiplier and DPStrategy.target_epsilon (got noise_multiplier=1.0, target_epsilon=8.0)",
    ),
    Rewrite(
        "strategy-refusal",
        "--trainer.strategy.init_args.clip_mode quantile --trainer.strategy.init_args.clip_learning_rate 1000",
        (
            "Does not validate against any of the Union subtypes\n"
            "Subtypes: [<class 'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>]\n"
            "Errors:\n"
            "  - Expected a <class 'str'>\n"
            "  - DPStrategy.clip_learning_rate=1000.0 is above 5.0: one update moves C by up to a factor e^η, so C would under- or overflow within a few steps (default 0.2)\n"
            "Given value type: <class 'jsonargparse._namespace.Namespace'>\n"
            "Given value: Namespace(class_path='dplit.strategy.DPStrategy', init_args=Namespace(max_grad_norm=1.0, clip_mode='quantile', clip_learning_rate=1000.0))"
        ),
        "DPStrategy.clip_learning_rate=1000.0 is above 5.0: one update moves C by up to a factor e^η, so C would under- or overflow within a few steps (default 0.2)",
    ),
    Rewrite(
        "seed-maybe",
        "--seed_everything maybe",
        (
            'Parser key "seed_everything":\n'
            "  Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'bool'>, <class 'int'>]\n"
            "  Errors:\n"
            "    - Expected a <class 'bool'>\n"
            "    - Expected a <class 'int'>\n"
            "  Given value type: <class 'str'>\n"
            "  Given value: maybe"
        ),
        "seed_everything='maybe': expected true or false or an integer",
    ),
    Rewrite(
        "lora-maybe",
        '--model.peft \'{... "init_lora_weights": "maybe"}\'',
        (
            'Parser key "init_lora_weights":\n'
            "  Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'bool'>, typing.Literal['gaussian', 'eva', 'olora', 'pissa', 'pissa_niter_[number of iters]', 'corda', 'loftq', 'orthogonal', 'mica']]\n"
            "  Errors:\n"
            "    - Expected a <class 'bool'>\n"
            "    - Expected a typing.Literal['gaussian', 'eva', 'olora', 'pissa', 'pissa_niter_[number of iters]', 'corda', 'loftq', 'orthogonal', 'mica']\n"
            "  Given value type: <class 'str'>\n"
            "  Given value: maybe"
        ),
        "init_lora_weights='maybe': expected true or false or one of 'gaussian', 'eva', 'olora', 'pissa', 'pissa_niter_[number of iters]', 'corda', 'loftq', 'orthogonal', 'mica'",
    ),
    Rewrite(
        "embeddings-typo",
        "--model.embeddings dplit.embeddings.UntiedEmbedding",
        (
            'Parser key "model.embeddings":\n'
            "\n"
            "  - Expected a path but dplit.embeddings.UntiedEmbedding either not accessible or invalid\n"
            "  - Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'dplit.backbone.embeddings.EmbeddingPolicy'>, <class 'NoneType'>]\n"
            "  Errors:\n"
            "    - Problem with given class_path 'dplit.embeddings.UntiedEmbedding':\n"
            "        module 'dplit.embeddings' has no attribute 'UntiedEmbedding'\n"
            "    - Expected a <class 'NoneType'>\n"
            "  Given value type: <class 'str'>\n"
            "  Given value: dplit.embeddings.UntiedEmbedding"
        ),
        "model.embeddings: Problem with given class_path 'dplit.embeddings.UntiedEmbedding': module 'dplit.embeddings' has no attribute 'UntiedEmbedding'",
    ),
    Rewrite(
        "peft-linear",
        '--model.peft \'{"class_path": "torch.nn.Linear", ...}\'',
        (
            'Parser key "model.peft":\n'
            "\n"
            '  - Expected a path but {"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 2}} either not accessible or invalid\n'
            "  - Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'dplit.backbone.adapters.AdapterConfig'>, <class 'NoneType'>]\n"
            "  Errors:\n"
            "    - Import path torch.nn.Linear does not correspond to a subclass of AdapterConfig\n"
            "    - Expected a <class 'NoneType'>\n"
            "  Given value type: <class 'dict'>\n"
            "  Given value: {'class_path': 'torch.nn.Linear', 'init_args': {'in_features': 2, 'out_features': 2}}"
        ),
        "model.peft: Import path torch.nn.Linear does not correspond to a peft config class (model.peft takes {class_path: peft.LoraConfig, init_args: {...}})",
    ),
    Rewrite(
        "max-epochs-text",
        "--trainer.max_epochs abc",
        (
            'Parser key "trainer.max_epochs":\n'
            "  Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'int'>, <class 'NoneType'>]\n"
            "  Errors:\n"
            "    - Expected a <class 'int'>\n"
            "    - Expected a <class 'NoneType'>\n"
            "  Given value type: <class 'str'>\n"
            "  Given value: abc"
        ),
        "trainer.max_epochs='abc': expected an integer",
    ),
    Rewrite(
        "progress-bar-text",
        "--trainer.enable_progress_bar maybe",
        (
            'Parser key "trainer.enable_progress_bar":\n'
            "  Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'bool'>, <class 'NoneType'>]\n"
            "  Errors:\n"
            "    - Expected a <class 'bool'>\n"
            "    - Expected a <class 'NoneType'>\n"
            "  Given value type: <class 'str'>\n"
            "  Given value: maybe"
        ),
        "trainer.enable_progress_bar='maybe': expected true or false",
    ),
    Rewrite(
        "batch-size-text",
        "--data.batch_size many",
        ("Parser key \"data.batch_size\":\n  Expected a <class 'int'>. Got value: many"),
        "data.batch_size='many': expected an integer",
    ),
    Rewrite(
        "tied-norm-choice",
        "--trainer.strategy.init_args.tied_norm loose",
        "Parser key \"tied_norm\":\n  Expected a typing.Literal['exact', 'bound']. Got value: loose",
        "tied_norm='loose': expected one of 'exact', 'bound'",
    ),
    Rewrite(
        "unknown-flag",
        "--model.nonsense 1",
        "unrecognized arguments: --model.nonsense 1",
        "unrecognized arguments: --model.nonsense 1",  # already one line: kept as it is
    ),
]


@pytest.mark.parametrize("rewrite", REWRITES, ids=[rewrite.name for rewrite in REWRITES])
def test_each_parse_error_becomes_its_one_line(rewrite: Rewrite) -> None:
    assert essential_error(rewrite.message) == rewrite.line
    assert "\n" not in rewrite.line


DOTTED_PATH_WITHOUT_PEFT = (
    'Parser key "model.peft":\n'
    "\n"
    '  - Expected a path but {"class_path": "peft.LoraConfig", "init_args": {"r": 4, "target_modules": ["c_attn"]}} either not accessible or invalid\n'
    "  - Does not validate against any of the Union subtypes\n"
    "  Subtypes: [<class 'dplit.backbone.adapters.AdapterConfig'>, <class 'NoneType'>]\n"
    "  Errors:\n"
    "    - Problem with given class_path 'peft.LoraConfig':\n"
    "        No module named 'peft'\n"
    "    - Expected a <class 'NoneType'>\n"
    "  Given value type: <class 'dict'>\n"
    "  Given value: {'class_path': 'peft.LoraConfig', 'init_args': {'r': 4, 'target_modules': ['c_attn']}}"
)
"""What jsonargparse writes for ``--model.peft '{"class_path": "peft.LoraConfig", ...}'`` where peft cannot be imported."""

SHORT_NAME_WITHOUT_PEFT = (
    'Parser key "model.peft":\n'
    "\n"
    '  - Expected a path but {"class_path": "LoraConfig", "init_args": {"r": 4}} either not accessible or invalid\n'
    "  - Does not validate against any of the Union subtypes\n"
    "  Subtypes: [<class 'dplit.backbone.adapters.AdapterConfig'>, <class 'NoneType'>]\n"
    "  Errors:\n"
    "    - Expected a dot import path string: LoraConfig\n"
    "    - Expected a <class 'NoneType'>\n"
    "  Given value type: <class 'dict'>\n"
    "  Given value: {'class_path': 'LoraConfig', 'init_args': {'r': 4}}"
)
"""What jsonargparse writes for ``--model.peft '{"class_path": "LoraConfig", ...}'`` where peft cannot be imported."""


@pytest.mark.parametrize("message", [DOTTED_PATH_WITHOUT_PEFT, SHORT_NAME_WITHOUT_PEFT], ids=["dotted", "short"])
def test_any_model_peft_value_without_peft_is_the_missing_package_line(
    message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # ``import peft`` now fails, as where it is not installed
    assert essential_error(message) == MISSING_PEFT


def test_with_peft_a_short_name_it_cannot_resolve_is_not_called_missing() -> None:
    line = "model.peft: Expected a dot import path string: LoraConfig (model.peft takes {class_path: peft.LoraConfig, init_args: {...}})"
    assert essential_error(SHORT_NAME_WITHOUT_PEFT) == line


LIVE = [
    ("seed-maybe", "seed_everything", Union[bool, int], "maybe"),  # noqa: UP007 (the type as Lightning declares it)
    ("delta-text", "target_delta", Optional[Number], "abc"),  # noqa: UP045 (as DPStrategy declares it)
    ("lr-text", "model.lr", PositiveNumber, "abc"),
    ("negative-lr", "model.lr", PositiveNumber, "-0.001"),
    ("tied-norm-choice", "tied_norm", Literal["exact", "bound"], "loose"),
    ("batch-size-text", "data.batch_size", int, "many"),
    ("max-epochs-text", "trainer.max_epochs", Optional[int], "abc"),  # noqa: UP045
    ("progress-bar-text", "trainer.enable_progress_bar", Optional[bool], "maybe"),  # noqa: UP045
]
"""Pinned messages a one-flag jsonargparse parser writes the same: (the pinned name, flag, its type, the value)."""


def parse_error(flag: str, kind: Any, value: str) -> str:
    """The message a jsonargparse parser with the one flag ``--flag`` of type ``kind`` reports for ``value``."""
    messages: list[str] = []

    class Recording(ArgumentParser):
        def error(self, message: str, *args: Any, **kwargs: Any) -> Any:
            messages.append(message)
            raise SystemExit(2)

    parser = Recording()
    parser.add_argument(f"--{flag}", type=kind)
    with pytest.raises(SystemExit):
        parser.parse_args([f"--{flag}", value])
    return messages[0]


@pytest.mark.parametrize(("name", "flag", "kind", "value"), LIVE, ids=[row[0] for row in LIVE])
def test_the_installed_jsonargparse_still_writes_the_pinned_messages(
    name: str, flag: str, kind: Any, value: str
) -> None:
    pinned = next(rewrite for rewrite in REWRITES if rewrite.name == name)
    assert parse_error(flag, kind, value) == pinned.message


@pytest.mark.parametrize("value", ["inf", ".inf", "nan", "1e400"])
def test_a_number_flag_takes_inf_and_nan_for_its_owner_to_refuse(value: str) -> None:
    """``--...target_epsilon inf`` reaches DPSGDSettings, which words the refusal of ``.inf`` in YAML the same way."""
    parser = ArgumentParser()
    parser.add_argument("--target_epsilon", type=Optional[Number])  # noqa: UP045
    parsed = parser.parse_args(["--target_epsilon", value]).target_epsilon
    assert type(parsed) is float and not math.isfinite(parsed)
