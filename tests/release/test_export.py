"""``dplit export``: a checkpoint becomes a plain Hugging Face folder whose logits, tying and guarantee are the run's."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from dplit.backbone.embeddings import is_tied
from dplit.cli.lightning_cli import run_cli, run_lm_cli
from dplit.data.corpus import build_corpus_tokenizer
from dplit.data.tokenizer import load_tokenizer
from dplit.privacy.integrity import DIGEST_KEY
from dplit.privacy.ledger import LEDGER_FILE
from dplit.release.export import CLASSIFIER_FILE, HEAD_FILE, export_checkpoint
from dplit.release.guarantee import GUARANTEE_FILE
from dplit.tasks.base import BACKBONE_KEY, TOKENIZER_KEY, positions_of
from tests.helpers.commands import TINY, TINY_LLAMA, checkpoint_of, glue_args, lm_args, lora_on, quickstart_args, steps
from tests.helpers.executable import dplit_executable, refusal_line, run_dplit_in_process, user_environment
from tests.helpers.paths import REPOSITORY

SST2_LORA = REPOSITORY / "configs" / "smollm2_sst2_lora.yaml"
POLICIES = {"tied": "dplit.embeddings.TiedEmbeddings", "untied": "dplit.embeddings.UntiedEmbeddings"}
FAMILIES = {"gpt2": TINY, "llama": TINY_LLAMA}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def quickstart_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a one-step quickstart run, shared by the tests that only read it."""
    root = tmp_path_factory.mktemp("quickstart")
    run_cli(["fit", *quickstart_args(root, *steps(1))])
    return checkpoint_of(root)




def classifier_run(tmp_path: Path, tokenizer: Path, family: str, policy: str, *extra: str) -> object:
    """One DP step of the SST-2 SmolLM2 config on a tiny random ``family`` backbone (real tokenizer files)."""
    config = REPOSITORY / "configs" / f"smollm2_sst2_{'tied' if policy == 'tied' else 'untied'}.yaml"
    args = glue_args(config, tmp_path, tokenizer)
    args[args.index("--model.config") + 1] = FAMILIES[family]
    return run_cli(["fit", *args, "--model.embeddings", POLICIES[policy], *extra])


def lm_run(tmp_path: Path, family: str, policy: str, *extra: str) -> object:
    """One DP step of the LM quickstart on a tiny random ``family`` backbone."""
    config = json.loads(FAMILIES[family])
    config["max_position_embeddings" if family == "llama" else "n_positions"] = 64
    return run_lm_cli([
        "fit", *lm_args(tmp_path, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1"),
        "--model.config", json.dumps(config), "--model.embeddings", POLICIES[policy], *extra,
    ])  # fmt: skip


def exported(checkpoint: Path, folder: Path, **kwargs: object) -> tuple[torch.nn.Module, object]:
    """Export, then load the folder with plain transformers (offline), as a user of the release would."""
    export_checkpoint(checkpoint, folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def sentences(tokenizer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Two right-padded sentences of different lengths: input ids and attention mask [2, T]."""
    batch = tokenizer(["It was a great movie.", "terrible"], return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"]


def hf_last_token_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The LM logits [B, V] at each sequence's last real token, positions counting real tokens."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask)).logits  # [B, T, V]
    return logits[torch.arange(ids.shape[0]), mask.sum(1) - 1]


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_exported_classifier_gives_the_modules_logits_in_plain_transformers(
    family: str, policy: str, tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    cli = classifier_run(tmp_path, tiny_bpe_dir, family, policy)
    model, tokenizer = exported(checkpoint_of(tmp_path), tmp_path / "export")
    assert is_tied(model) == (policy == "tied") == model.config.tie_word_embeddings
    if policy == "untied":  # both matrices were trained and saved: they differ after the step
        assert not torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    record = json.loads((tmp_path / "export" / CLASSIFIER_FILE).read_text())
    assert (
        record["label_word_ids"] == cli.datamodule.label_word_ids
        and record["template"] == cli.datamodule.prompt.template
    )
    ids, mask = sentences(tokenizer)
    assert ids.tolist() == sentences(cli.datamodule.tokenizer)[0].tolist()
    module = cli.model.eval()
    with torch.no_grad():
        expected = module(ids, mask)  # [B, K]
        got = hf_last_token_logits(model, ids, mask)[:, record["label_word_ids"]]
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("policy", ["tied", "untied"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_exported_language_model_gives_the_modules_logits_in_plain_transformers(
    family: str, policy: str, tmp_path: Path
) -> None:
    cli = lm_run(tmp_path, family, policy)
    model, tokenizer = exported(checkpoint_of(tmp_path), tmp_path / "export")
    assert is_tied(model) == (policy == "tied") == model.config.tie_word_embeddings
    ids = torch.tensor([tokenizer.encode("the movie is very good and")] * 2)  # [2, T]
    assert ids.tolist()[0] == cli.datamodule.tokenizer.encode("the movie is very good and")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = cli.model.eval().backbone(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask)).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_linear_head_is_saved_beside_the_lm_and_reproduces_the_class_logits(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    cli = classifier_run(tmp_path, tiny_bpe_dir, "gpt2", "untied", "--model.head", "linear")
    model, tokenizer = exported(checkpoint_of(tmp_path), tmp_path / "export")
    record = json.loads((tmp_path / "export" / CLASSIFIER_FILE).read_text())
    weight = load_file(str(tmp_path / "export" / record["head_file"]))["weight"]  # [K, d]
    assert record["head"] == "linear" and record["head_file"] == HEAD_FILE
    ids, mask = sentences(tokenizer)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask), output_hidden_states=True)
        last = hidden.hidden_states[-1][torch.arange(2), mask.sum(1) - 1]  # [B, d]
        torch.testing.assert_close(last @ weight.T, cli.model.eval()(ids, mask), atol=TOLERANCE, rtol=TOLERANCE)


def test_the_card_states_the_ledgers_epsilon_and_every_fact_a_reviewer_needs(tmp_path: Path) -> None:
    run_cli(["fit", *quickstart_args(tmp_path, *steps(3))])
    export_checkpoint(checkpoint_of(tmp_path), tmp_path / "export")
    guarantee = json.loads((tmp_path / "export" / GUARANTEE_FILE).read_text())
    ledger = json.loads(next(tmp_path.rglob(LEDGER_FILE)).read_text())
    assert guarantee["differentially_private"] is True and guarantee["steps"] == 3
    assert (
        guarantee["epsilon"] == pytest.approx(ledger["epsilon"], rel=1e-9)
        and guarantee["delta"] == ledger["accountant"]["delta"]
    )
    assert guarantee["noise_multiplier"] == ledger["noise_multiplier"] and guarantee["dataset_size"] == 200
    assert guarantee["sample_rate"] == pytest.approx(0.1) and guarantee["expected_batch_size"] == pytest.approx(20.0)
    assert (guarantee["sampling"], guarantee["clipping"], guarantee["tied_norm"]) == ("poisson", "ghost", "exact")
    assert guarantee["embedding_policy"]["class_path"] == "dplit.backbone.embeddings.UntiedEmbeddings"  # as the config names it
    card = (tmp_path / "export" / "README.md").read_text()
    assert card.splitlines()[0].startswith("# Differentially private") and f"ε = {guarantee['epsilon']:.4g}" in card
    for fact in ("poisson", "one training example", "clipping bound C", "hyperparameters",
                 "dp/clip_fraction", "perf/samples_per_sec", "private_diagnostics", "non-secure RNG", "dplit commit",
                 "data source", "base model", "replace-one", "Privacy history of these weights"):  # fmt: skip
        assert fact in card, fact


def test_a_resumed_runs_card_counts_every_step(tmp_path: Path) -> None:
    sigma = (
        "--trainer.strategy.init_args.target_epsilon",
        "null",
        "--trainer.strategy.init_args.noise_multiplier",
        "1",
    )
    run_cli(["fit", *quickstart_args(tmp_path, *steps(2), *sigma)])  # fixed σ: a target ε would be spent at step 2
    first = checkpoint_of(tmp_path)
    run_cli(
        ["fit", *quickstart_args(tmp_path, *steps(2), *sigma), "--trainer.max_epochs", "2", "--ckpt_path", str(first)]
    )
    resumed = checkpoint_of(tmp_path)
    assert resumed.parent.parent.name == "version_1"
    export_checkpoint(resumed, tmp_path / "export")
    guarantee = json.loads((tmp_path / "export" / GUARANTEE_FILE).read_text())
    ledger = json.loads((resumed.parent.parent / LEDGER_FILE).read_text())
    assert guarantee["steps"] == 4 == sum(count for _, _, count in ledger["accountant"]["history"])
    assert guarantee["epsilon"] == pytest.approx(ledger["epsilon"], rel=1e-9)


def test_a_non_private_checkpoint_says_so_in_the_first_line_of_its_card(tmp_path: Path) -> None:
    run_cli(["fit", *quickstart_args(tmp_path, *steps(1)), "--trainer.strategy", "auto", "--non_private", "true"])
    export_checkpoint(checkpoint_of(tmp_path), tmp_path / "export")
    card = (tmp_path / "export" / "README.md").read_text()
    assert "NOT differentially private" in card.splitlines()[0]
    assert json.loads((tmp_path / "export" / GUARANTEE_FILE).read_text())["differentially_private"] is False


def test_a_predictable_seed_is_not_exported_as_private(tmp_path: Path) -> None:
    with pytest.warns(UserWarning):
        run_cli(["fit", *quickstart_args(tmp_path, *steps(1)), "--trainer.strategy.init_args.seed", "3"])
    export_checkpoint(checkpoint_of(tmp_path), tmp_path / "export")
    first = (tmp_path / "export" / "README.md").read_text().splitlines()[0]
    assert "NOT differentially private" in first and "predictable" in first


def tiny_pretrained_gpt2(folder: Path) -> Path:
    """A random GPT-2 saved as a local pretrained folder with the builtin corpus' vocabulary (a PeftModel base)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(build_corpus_tokenizer()), n_layer=2, n_embd=16, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_lora_merges_by_default_and_adapter_only_loads_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    base = tiny_pretrained_gpt2(tmp_path / "base")
    cli = run_lm_cli([
        "fit", *lm_args(tmp_path / "run", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1"),
        "--model.config", "null", "--model.pretrained", str(base), "--model.peft", lora_on("c_attn", "c_fc"),
        "--model.embeddings", POLICIES["untied"], "--model.lr", "0.05",
    ])  # fmt: skip
    checkpoint = checkpoint_of(tmp_path / "run")
    ids = torch.tensor([cli.datamodule.tokenizer.encode("the movie is very good")])
    with torch.no_grad():
        expected = cli.model.eval().backbone(input_ids=ids).logits
        merged, _ = exported(checkpoint, tmp_path / "merged")
        assert not any("lora" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=TOLERANCE, rtol=TOLERANCE)
        export_checkpoint(checkpoint, tmp_path / "adapter", adapter_only=True)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "adapter"))
        torch.testing.assert_close(adapted.eval()(input_ids=ids).logits, expected, atol=TOLERANCE, rtol=TOLERANCE)
        untouched = AutoModelForCausalLM.from_pretrained(str(base)).eval()(input_ids=ids).logits
    assert not torch.allclose(untouched, expected, atol=1e-4)  # the adapters moved: the test can fail
    assert json.loads((tmp_path / "adapter" / GUARANTEE_FILE).read_text())["adapters"] == "peft.LoraConfig"


def local_base_run(tmp_path: Path, tokenizer_files: Path, *extra: str) -> tuple[object, Path]:
    """One DP step of ``dplit lm fit`` on a local base folder and a small text file.

    The base folder holds a random tiny GPT-2 and its tokenizer, both in ``tmp_path / "base"``, which
    ``model.pretrained`` and ``data.tokenizer`` name.
    """
    base, rows = tmp_path / "base", tmp_path / "train.jsonl"
    tokenizer = load_tokenizer(tokenizer_files)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    rows.write_text("".join(json.dumps({"text": f"It was a great movie, number {i}."}) + "\n" for i in range(40)))
    cli = run_lm_cli([
        "fit", *lm_args(tmp_path / "run", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1"),
        "--model.config", "null", "--model.pretrained", str(base), "--data.tokenizer", str(base),
        "--data.train_file", str(rows), "--data.val_file", str(rows), "--data.batch_size", "8",
        "--model.sample_prompts", "[]", "--model.lr", "0.05", *extra,
    ])  # fmt: skip
    return cli, base


@pytest.mark.parametrize("policy, peft", [("untied", None), ("tied", lora_on("c_attn", "c_fc"))], ids=["full", "lora"])
def test_export_needs_nothing_but_the_checkpoint(
    policy: str, peft: str | None, tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    adapters = ["--model.peft", peft] if peft else []
    cli, base = local_base_run(tmp_path, tiny_bpe_dir, "--model.embeddings", POLICIES[policy], *adapters)
    checkpoint = checkpoint_of(tmp_path / "run")
    shutil.rmtree(base)  # the base weights and the tokenizer files are gone: only the checkpoint is left
    model, tokenizer = exported(checkpoint, tmp_path / "export")
    trained = {
        name.removeprefix("backbone."): weight
        for name, weight in torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"].items()
    }
    weights = model.state_dict()
    merged = {name for name in weights if peft and (".c_attn." in name or ".c_fc." in name)}  # LoRA folded in
    assert weights.keys() - merged <= trained.keys()
    assert all(torch.equal(weights[name], trained[name]) for name in weights.keys() - merged)
    assert is_tied(model) == (policy == "tied") == model.config.tie_word_embeddings
    text = "It was a great movie"
    ids = torch.tensor([tokenizer.encode(text)])
    assert ids.tolist()[0] == cli.datamodule.tokenizer.encode(text) and tokenizer.pad_token == tokenizer.eos_token
    with torch.no_grad():
        expected = cli.model.eval().backbone(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_checkpoint_without_its_backbone_config_is_exported_from_its_base_model_as_before(
    tmp_path: Path, tiny_bpe_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, base = local_base_run(tmp_path, tiny_bpe_dir, "--model.embeddings", POLICIES["untied"])
    current = checkpoint_of(tmp_path / "run")
    checkpoint = torch.load(current, map_location="cpu", weights_only=True)
    assert {BACKBONE_KEY, TOKENIZER_KEY} <= checkpoint.keys()
    assert not {BACKBONE_KEY, TOKENIZER_KEY} & checkpoint[DIGEST_KEY].keys()  # unsealed: dropping them breaks no digest
    older = tmp_path / "older.ckpt"  # what the previous release wrote: the same checkpoint without the two entries
    torch.save({key: value for key, value in checkpoint.items() if key not in (BACKBONE_KEY, TOKENIZER_KEY)}, older)
    with caplog.at_level(logging.INFO):
        export_checkpoint(older, tmp_path / "from_base")
    assert f"loading its base model model.pretrained={str(base)!r} again" in caplog.text
    export_checkpoint(current, tmp_path / "self_contained")
    files = sorted(path.name for path in (tmp_path / "from_base").iterdir())
    assert files == sorted(path.name for path in (tmp_path / "self_contained").iterdir())
    for name in files:  # weights, config, tokenizer, card and guarantee alike
        assert (tmp_path / "from_base" / name).read_bytes() == (tmp_path / "self_contained" / name).read_bytes(), name
    shutil.rmtree(base)
    with pytest.raises(ValueError, match=rf"^model.pretrained={re.escape(repr(str(base)))}: the folder does not exist"):
        export_checkpoint(older, tmp_path / "no_base")
    assert not (tmp_path / "no_base").exists()


def test_adapter_only_is_refused_when_the_embedding_was_trained_too(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    args = glue_args(SST2_LORA, tmp_path, tiny_bpe_dir)
    run_cli(["fit", *args])
    with pytest.raises(
        ValueError, match=r"--adapter_only: the run also trained .*embed_tokens.* export the merged model"
    ):
        export_checkpoint(checkpoint_of(tmp_path), tmp_path / "adapter", adapter_only=True)
    assert not (tmp_path / "adapter").exists()


@pytest.mark.slow
def test_the_dplit_export_executable_writes_the_folder_and_prints_the_guarantee(
    quickstart_checkpoint: Path, tmp_path: Path
) -> None:
    """The one export through the real executable (the console script end to end; the rest call it in process)."""
    command = [
        dplit_executable(),
        "export",
        "--ckpt_path",
        str(quickstart_checkpoint),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=user_environment(), check=False)
    assert result.returncode == 0, result.stderr
    assert "-DP per training example, see README.md" in result.stdout + result.stderr
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", GUARANTEE_FILE} <= {
        path.name for path in (tmp_path / "out").iterdir()
    }


def test_the_card_names_the_data_by_description_or_base_name_never_a_local_path(
    quickstart_checkpoint: Path, tmp_path: Path
) -> None:
    export_checkpoint(quickstart_checkpoint, tmp_path / "named", data_description="support tickets, 2024")
    named = json.loads((tmp_path / "named" / GUARANTEE_FILE).read_text())
    assert named["data_source"] == "support tickets, 2024"
    checkpoint = torch.load(quickstart_checkpoint, map_location="cpu", weights_only=True)
    from dplit.release.guarantee import data_source, public_name

    assert data_source({"train_file": str(tmp_path / "private" / "notes.jsonl")}) == "file notes.jsonl"
    assert data_source({"task": "sst2", "data_dir": str(tmp_path / "glue" / "SST-2")}) == "GLUE sst2: local SST-2/train.tsv"
    assert public_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B" and public_name("/home/ana/models/gpt2") == "gpt2"
    assert checkpoint["hyper_parameters"] is not None


@pytest.mark.parametrize("config", ["missing.yaml", "lm_quickstart.yaml"])
def test_an_export_config_that_is_missing_or_for_the_other_model_is_refused(
    quickstart_checkpoint: Path, tmp_path: Path, config: str
) -> None:
    path = REPOSITORY / "configs" / config
    error = refusal_line(
        run_dplit_in_process("export", "--ckpt_path", str(quickstart_checkpoint),
                             "--output_dir", str(tmp_path / "export"), "--config", str(path))
    )  # fmt: skip
    expected = "no such file" if config == "missing.yaml" else "configures a `dplit lm fit` (text generation) run"
    assert f"--config {path}: {expected}" in error and not (tmp_path / "export").exists()


def test_an_export_folder_follows_the_umask_not_mkdtemps_0700(quickstart_checkpoint: Path, tmp_path: Path) -> None:
    import os
    import stat

    previous = os.umask(0o022)
    try:
        export_checkpoint(quickstart_checkpoint, tmp_path / "shared")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o755


@pytest.mark.parametrize("problem", ["missing", "not-a-checkpoint", "output-not-empty"])
def test_export_checks_its_input_before_it_announces_work(
    quickstart_checkpoint: Path, tmp_path: Path, problem: str
) -> None:
    """A refused export prints its one line only: never 'exporting ...: rebuilding the model' first (issue 50)."""
    checkpoint = {"missing": tmp_path / "none.ckpt", "not-a-checkpoint": tmp_path / "notes.ckpt"}.get(
        problem, quickstart_checkpoint
    )
    (tmp_path / "notes.ckpt").write_text("not a checkpoint\n")
    (tmp_path / "out").mkdir()
    if problem == "output-not-empty":
        (tmp_path / "out" / "notes.txt").write_text("someone's notes\n")
    result = run_dplit_in_process("export", "--ckpt_path", str(checkpoint), "--output_dir", str(tmp_path / "out"))
    refusal_line(result)
    assert "exporting" not in result.stdout + result.stderr, result.stdout + result.stderr
