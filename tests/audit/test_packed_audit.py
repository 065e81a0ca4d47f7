"""``dplit lm audit --data.packing true``: the audited run packs its training batches as the fit does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dplit.audit.command import AUDIT_FILE, _check_isolation
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers.commands import TINY, lm_args
from tests.helpers.executable import run_dplit_in_process
from tests.helpers.tiny import VOCAB

FILL = re.compile(r"packing: (\d+) rows of 32 tokens were \d+\.\d% full")


def audit_args(run: Path, mode: str, *extra: str) -> list[str]:
    """A short packed ``dplit lm audit`` of the LM quickstart in ``run``: one epoch, 100 canaries."""
    return [
        *lm_args(run, "--data.packing", "true", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0"),
        "--model.sample_prompts", "[]", "--audit.mode", mode, "--audit.canaries", "100", "--audit.seed", "0",
        "--trainer.strategy.init_args.seed", "0", *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["white_box", "black_box"])
def test_a_packed_lm_audit_trains_on_packed_rows_and_says_so(mode: str, tmp_path: Path) -> None:
    """Black box: the canaries join the documents and are packed with them, each its own unit, as the fit packs."""
    result = run_dplit_in_process("lm", "audit", *audit_args(tmp_path, mode))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert FILL.search(output), output[-3000:]
    ledger = json.loads(next(tmp_path.rglob("privacy_ledger.json")).read_text())
    assert "isolated" in str(ledger.get("packing")), ledger
    report = json.loads(next(tmp_path.rglob(AUDIT_FILE)).read_text())
    assert report["mode"] == mode and report["epsilon_lower_bound"] <= report["claimed_epsilon"]


def test_a_packed_black_box_audit_refuses_a_model_that_cannot_isolate_documents() -> None:
    """The black-box fit runs on loaders (the module's own check reads the datamodule): the audit refuses first.

    (``model.attn_implementation`` takes eager or sdpa only, so the kernel is set on the backbone's config here.)
    """
    model = CausalLanguageModel(config=json.loads(TINY), vocab_size=VOCAB, sample_prompts=[])
    model.backbone.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"^data\.packing=true: attention implementation 'flash_attention_2'"):
        _check_isolation(model, SimpleNamespace(hparams={"packing": True}))
    _check_isolation(model, SimpleNamespace(hparams={"packing": False}))  # unpacked: any kernel
