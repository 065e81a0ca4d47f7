"""Private next-token fine-tuning: exact clipped updates (float64, σ = 0, brute force), data, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dplit.backbone.embeddings import EmbeddingPolicy, TiedEmbeddings, UntiedEmbeddings, is_tied
from dplit.cli.lightning_cli import run_lm_cli
from dplit.data.text import TextDataModule
from dplit.privacy.clipping import GhostEngine
from dplit.strategy import DPStrategy
from dplit.tasks.language_model import CausalLanguageModel
from tests.helpers.families import FAMILIES, VOCAB, attention_for, check, instruction_batch
from tests.helpers.oracles import check_against_oracles
from tests.helpers.paths import REPOSITORY

CONFIGS = REPOSITORY / "configs"
TINY_GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 64}
POLICIES = [TiedEmbeddings(), UntiedEmbeddings()]


def language_model(
    policy: EmbeddingPolicy, config: dict, reduction: str = "sum", attention: str = "eager"
) -> CausalLanguageModel:
    torch.manual_seed(0)
    model = CausalLanguageModel(
        config=config, vocab_size=VOCAB, embeddings=policy, loss_reduction=reduction, attn_implementation=attention
    )
    return model.double()




@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_gpt2_clipped_update_is_exact(policy: EmbeddingPolicy, side: str, reduction: str) -> None:
    model = language_model(policy, TINY_GPT2, reduction)
    check_against_oracles(model, model.per_example_loss, instruction_batch(side), clip=0.5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_llama_family_clipped_update_is_exact(family: str, policy: EmbeddingPolicy, side: str) -> None:
    model = language_model(policy, FAMILIES[family], attention=attention_for(side))
    check(model, model.per_example_loss, instruction_batch(side, seed=1), clip=0.5, side=side)


@pytest.mark.parametrize("policy", POLICIES, ids=["tied", "untied"])
def test_each_example_contributes_at_most_clip(policy: EmbeddingPolicy) -> None:
    model = language_model(policy, TINY_GPT2)
    batch = instruction_batch("right")
    engine = GhostEngine(model, max_grad_norm=0.05)
    for i in range(4):  # one example at a time: its whole clipped contribution
        model.zero_grad(set_to_none=True)
        engine.accumulate(model.per_example_loss, {key: value[i : i + 1] for key, value in batch.items()})
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
        assert norm <= 0.05 * (1 + 1e-9)


def test_prompt_tokens_and_padding_carry_no_loss() -> None:
    model = language_model(UntiedEmbeddings(), TINY_GPT2)
    batch = instruction_batch("left")
    losses, trained = model.token_losses(batch)
    assert trained[0].sum() == 9 - 4 and trained[1].sum() == 2  # response of 5; a text of 3 predicts 2 tokens
    changed = {key: value.clone() for key, value in batch.items()}
    changed["input_ids"][0, -9:-5] = (changed["input_ids"][0, -9:-5] + 1) % VOCAB  # edit the prompt only
    assert torch.equal(trained, model.token_losses(changed)[1])
    assert (losses[trained == 0] == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sample_tokens": 0}, r"^model.sample_tokens=0: must be an integer ≥ 1 \(tokens generated per sample\)$"),
        ({"sample_tokens": -3}, r"^model.sample_tokens=-3: must be an integer ≥ 1"),
        ({"sample_prompts": ["the movie", ""]}, r"^model.sample_prompts\[1\]='': each prompt must be a non-empty string \(null: the default prompts; \[\]: no samples\)$"),
    ],
    ids=["zero-tokens", "negative-tokens", "empty-prompt"],
)  # fmt: skip
def test_sample_settings_are_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CausalLanguageModel(config=TINY_GPT2, vocab_size=VOCAB, **kwargs)


class WordTokenizer:
    """One token per whitespace-separated word (so a blank prompt has none)."""

    def encode(self, text: str) -> list[int]:
        return [1] * len(text.split())


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (["fine", "   "], r"^model.sample_prompts\[1\]='   ': the tokenizer encodes it to no tokens$"),
        (["word " * 60], r"^model.sample_prompts\[0\] is 60 tokens: with model.sample_tokens=5 that passes the model's position limit of 64 tokens$"),
    ],
    ids=["no-tokens", "too-long"],
)  # fmt: skip
def test_sample_prompts_are_checked_against_the_tokenizer_at_setup(prompts: list[str], message: str) -> None:
    trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=WordTokenizer()))  # all that setup reads
    model = CausalLanguageModel(config=TINY_GPT2, vocab_size=VOCAB, sample_prompts=prompts, sample_tokens=5)
    model._trainer = trainer
    with pytest.raises(ValueError, match=message):
        model.setup("fit")
    model = CausalLanguageModel(config=TINY_GPT2, vocab_size=VOCAB, sample_prompts=[])  # []: no samples
    model._trainer = trainer
    model.setup("fit")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def datamodule(tmp_path: Path, tokenizer: Path, rows: list[dict], **kwargs: object) -> TextDataModule:
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    return TextDataModule(train_file=str(train), val_file=str(train), tokenizer=str(tokenizer), **kwargs)


def test_files_of_every_format_and_instruction_masks(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    rows = [{"prompt": "Question: Is it great?", "response": " yes", "text": "It was great."}]
    data = datamodule(tmp_path, tiny_bpe_dir, rows, prompt_column="prompt", response_column="response")
    example = data.dataset("train")[0]
    prompt = data.tokenizer.encode("Question: Is it great?")
    assert example["input_ids"][: len(prompt)] == prompt and example["input_ids"][-1] == data.tokenizer.eos_token_id
    assert example["loss_mask"] == [0] * len(prompt) + [1] * (len(example["input_ids"]) - len(prompt))
    (tmp_path / "t.csv").write_text('text,label\n"It was great.",1\n')
    (tmp_path / "t.txt").write_text("It was great.\nIt was terrible.\n")
    for name, count in [("t.csv", 1), ("t.txt", 2)]:
        files = TextDataModule(train_file=str(tmp_path / name), val_file=str(tmp_path / name), tokenizer=str(tiny_bpe_dir))
        assert len(files.dataset("train")) == count and all(files.dataset("train")[0]["loss_mask"])


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        ([{"body": "hi"}], {}, r"train.jsonl: missing column\(s\) \['text'\]; the file has \['body'\]"),
        ([{"text": "fine"}, {"text": "  "}], {}, r"train.jsonl, row 2: empty text"),
        ([{"text": "great " * 40}], {"overlength": "refuse", "max_length": 16}, r"train.jsonl, row 1: \d+ tokens, longer than data.max_length=16"),
        ([], {}, r"train.jsonl: the file is empty"),
    ],
    ids=["missing-column", "empty-text", "too-long", "empty-file"],
)  # fmt: skip
def test_bad_rows_name_the_file_and_row(
    rows: list[dict], options: dict, message: str, tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    data = datamodule(tmp_path, tiny_bpe_dir, rows, **options)
    with pytest.raises(ValueError, match=message):
        data.dataset("train")


def test_truncation_packing_and_flag_pairs(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    data = datamodule(tmp_path, tiny_bpe_dir, [{"text": "great " * 40}], max_length=16)
    assert len(data.dataset("train")[0]["input_ids"]) == 16
    with pytest.raises(ValueError, match="data.prompt_column and data.response_column"):
        TextDataModule(prompt_column="prompt")


def lm_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--config", str(CONFIGS / "lm_quickstart.yaml"),
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
        "--data.builtin_train_size", "600",
        "--data.builtin_val_size", "100",
        "--data.batch_size", "60",
        *extra,
    ]  # fmt: skip


def test_lm_quickstart_takes_a_private_step_and_logs_samples(tmp_path: Path) -> None:
    one_step = ("--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "1")
    cli = run_lm_cli(["fit", *lm_args(tmp_path, *one_step)])
    assert isinstance(cli.trainer.strategy, DPStrategy) and cli.trainer.strategy.accountant.steps == 1
    assert {"val/loss", "val/perplexity", "privacy/epsilon"} <= set(cli.trainer.callback_metrics)
    samples = cli.model.generate_text(["the movie is"], cli.datamodule.tokenizer, max_new_tokens=4)
    assert len(samples) == 1 and isinstance(samples[0], str)


def test_lm_quickstart_perplexity_falls_far_below_the_untrained_model(tmp_path: Path) -> None:
    untrained = run_lm_cli(["validate", *lm_args(tmp_path / "before")]).trainer.callback_metrics["val/perplexity"]
    cli = run_lm_cli(["fit", *lm_args(tmp_path / "after", "--data.builtin_train_size", "3000", "--trainer.max_epochs", "1")])
    trained = cli.trainer.callback_metrics["val/perplexity"]
    assert trained < untrained / 4, (float(untrained), float(trained))  # ~90 → well under 22
    assert cli.trainer.callback_metrics["privacy/epsilon"] <= 8.0


@pytest.mark.parametrize("config", ["smollm2_lm.yaml", "smollm2_lm_lora.yaml", "smollm2_lm_packed.yaml"])
def test_smollm2_lm_config_runs_a_step_offline_on_a_tiny_llama(config: str, tmp_path: Path, tiny_bpe_dir: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"It was great {i}."} for i in range(16)])
    llama = {**FAMILIES["llama"], "max_position_embeddings": 256}
    cli = run_lm_cli([
        "fit", "--config", str(CONFIGS / config),
        "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "1",
        "--model.pretrained", "null", "--model.config", json.dumps(llama),
        "--data.tokenizer", str(tiny_bpe_dir), "--data.train_file", str(train), "--data.val_file", str(train),
        "--data.batch_size", "4", "--data.eval_batch_size", "4",
        *(["--data.max_length", "64"] if "packed" in config else []),
    ])  # fmt: skip
    assert cli.trainer.strategy.accountant.steps == 1 and is_tied(cli.model.backbone)
    lora = [name for name, p in cli.model.named_parameters() if p.requires_grad and "lora_" in name]
    assert bool(lora) == config.endswith("_lora.yaml")


def test_hub_dataset_by_name_goes_through_load_dataset(monkeypatch: pytest.MonkeyPatch, tiny_bpe_dir: Path) -> None:
    asked: list[tuple[str, str]] = []

    def fake_load_dataset(name: str, split: str) -> datasets.Dataset:
        asked.append((name, split))
        return datasets.Dataset.from_dict({"text": ["It was great.", "It was terrible."][: 1 if ":" in split else 2]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = TextDataModule(dataset="someone/notes", tokenizer=str(tiny_bpe_dir), max_train_examples=1)
    assert len(data.dataset("train")) == 1 and len(data.dataset("validation")) == 2
    assert asked == [("someone/notes", "train[:1]"), ("someone/notes", "validation")]


def test_greedy_samples_reach_tensorboard_as_text(tmp_path: Path) -> None:
    args = lm_args(tmp_path, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "1")
    run_lm_cli(["fit", *args])
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    texts = [event.tensor_proto.string_val[0].decode() for event in events.Tensors("samples/greedy/text_summary")]
    assert texts and all("**the movie is very** →" in text for text in texts)


def test_the_lm_quickstart_with_a_corpus_does_not_warn_about_its_own_settings(
    tmp_path: Path, tiny_bpe_dir: Path
) -> None:
    import warnings

    corpus = tmp_path / "notes.txt"
    corpus.write_text("".join(f"the note number {index} was short\n" for index in range(40)))
    config = REPOSITORY / "configs" / "lm_quickstart.yaml"
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
            "--data.train_file", str(corpus), "--data.val_file", str(corpus), "--data.batch_size", "8",
            "--data.tokenizer", str(tiny_bpe_dir), "--model.config", json.dumps({"n_layer": 1, "n_embd": 16, "n_head": 2})]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_lm_cli(args)
    assert not [w for w in caught if "builtin" in str(w.message) and "is ignored" in str(w.message)]
