"""The controlled-sentiment DPO study: its judge, its prompts, and a tiny smoke configuration end to end (issue 53)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from bench import dpo_sentiment
from bench.sentiment_judge import SentimentJudge
from dplit.data.tokenizer import load_tokenizer
from tests.helpers.families import SMALL


def test_the_judge_is_naive_bayes_with_add_one_smoothing() -> None:
    judge = SentimentJudge.fit(["good good fun", "bad", "bad dull"], [1, 0, 0])
    # vocabulary {good, fun, bad, dull}: positive counts 3 words (+4), negative 3 words (+4)
    assert judge.weights["good"] == pytest.approx(math.log(3 / 7) - math.log(1 / 7))
    assert judge.weights["bad"] == pytest.approx(math.log(1 / 7) - math.log(3 / 7))
    assert judge.prior == pytest.approx(math.log(1 / 2))
    assert judge.score("Good, GOOD!") == pytest.approx(judge.prior + 2 * judge.weights["good"])
    assert judge.positive("good fun") and not judge.positive("dull") and not judge.positive("unseen words")
    assert judge.accuracy(["good", "bad"], [1, 0]) == 1.0
    assert SentimentJudge(**json.loads(json.dumps(judge.to_json()))) == judge
    with pytest.raises(ValueError, match="positive and negative rows"):
        SentimentJudge.fit(["good"], [1])


def test_prompts_are_prefixes_of_distinct_long_enough_sentences() -> None:
    sentences = ["one two three four five six", "short one", "a b c d e f g h", "a b c d e f g h"]
    prompts, sources = dpo_sentiment.prompts_of(sentences, 5, 3, random.Random(0))
    assert sorted(prompts) == ["a b c", "one two three"] and set(sources) == {sentences[0], sentences[2]}


def tiny_model(folder: Path) -> Path:
    """A tiny random tied Llama and a small byte-level BPE tokenizer in one folder (the study's --model)."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["a great movie, a terrible film, it was good and bad and dull"] * 20, vocab_size=300,
                            min_frequency=2, special_tokens=["<|endoftext|>"])  # fmt: skip
    folder.mkdir()
    bpe.save_model(str(folder))
    tokenizer = load_tokenizer(folder)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMALL, "vocab_size": len(tokenizer), "max_position_embeddings": 128,
                            "tie_word_embeddings": True})  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.slow  # three dplit processes and a build: about two minutes on 2 cores
def test_the_data_build_and_a_smoke_study_run_end_to_end_and_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import _shared_data

    shared = _shared_data()  # skips without $DPLIT_DATA_DIR
    model, data = tiny_model(tmp_path / "model"), tmp_path / "data"
    common = ["--model", str(model), "--new-tokens", "6"]
    facts = dpo_sentiment.main(["build", *common, "--data-dir", str(shared), "--train-prompts", "24",
                                "--eval-prompts", "6", "--out", str(data)])  # fmt: skip
    assert 0.75 < facts["judge_dev_accuracy"] < 0.9 and facts["train_prompts"] == 24 and facts["eval_prompts"] == 6
    assert facts["judge_train_rows"] < dpo_sentiment.read_sst2(shared / "glue" / "sst2" / "train.tsv")[0].__len__()
    judge = SentimentJudge(**json.loads((data / "judge.json").read_text()))
    pairs = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(pairs) == facts["train_pairs"] > 0
    assert all(judge.score(p["chosen"]) > judge.score(p["rejected"]) and len(p["prompt"].split()) == 4 for p in pairs)
    study = ["study", *common, "--data", str(data), "--seeds", "0", "--epsilons", "8", "--max-steps", "1",
             "--epochs", "1", "--batch-size", "4", "--eval-batch-size", "8", "--max-length", "64",
             "--accelerator", "cpu", "--threads", "1", "--out", str(tmp_path / "results"),
             "--logs", str(tmp_path / "runs")]  # fmt: skip
    results = dpo_sentiment.main(study)
    rows = {row["arm"]: row for row in results["runs"]}
    assert [row["status"] for row in rows.values()] == ["ok"] * 3, [r.get("message") for r in rows.values()]
    reference = rows["reference"]
    assert reference["reward_accuracy"] == 0.0 and reference["kl_to_reference"] == 0.0  # every margin 0: π = π_ref
    assert reference["steps"] == 0 and rows["non_private"]["steps"] == rows["dp_eps8"]["steps"] == 1
    assert rows["non_private"]["epsilon_spent"] is None and 0 < rows["dp_eps8"]["epsilon_spent"] <= 8 + 1e-6
    assert all(0 <= row["positive_rate"] <= 1 and row["eval_prompts"] == 6 for row in rows.values())
    table = (tmp_path / "results" / "table.md").read_text()
    assert "| dp_eps8 | 8.00 | 1 |" in table and "judge accuracy on SST-2 dev" in table
    assert dpo_sentiment.main(study)["runs"] == results["runs"]  # resumed: every run recorded, none rerun
    capsys.readouterr()
    dpo_sentiment.main([*study, "--dry-run", "--seeds", "0", "1"])  # a new seed: only its runs are planned
    planned = capsys.readouterr().out.splitlines()
    assert len(planned) == 3 and all("--seed_everything 1 " in line for line in planned)
    with pytest.raises(SystemExit, match="run `python -m bench.dpo_sentiment build` first"):
        dpo_sentiment.main([*study, "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "other")])
    with pytest.raises(SystemExit, match="other settings"):
        dpo_sentiment.main([*study[:-4], "--lr", "0.5", *study[-4:]])
