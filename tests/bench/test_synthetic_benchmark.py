"""The synthetic-data pipeline's own pieces: the files it hands to dplit and the statistics it reports."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from bench.synthetic.arguments import parse_args
from bench.synthetic.commands import classifier_args, lm_fit_args
from bench.synthetic.files import (
    CONTROL_PROMPTS,
    prepare_files,
    read_sst2_rows,
    write_instructions,
    write_prompts,
    write_synthetic_tsv,
)
from bench.synthetic.sitting import plan
from bench.synthetic.statistics import describe_synthetic, distinct_n, overlap_share, words
from dplit.cli.lightning_cli import run_cli, run_lm_cli
from dplit.data import GlueDataModule
from dplit.data.text import TextDataModule
from dplit.release.generate import read_prompts
from tests.helpers.glue_files import SST2_HEADER, SST2_ROWS, write_tsv


def test_rows_are_read_with_quoting_off_from_an_offset(tmp_path: Path) -> None:
    path = write_tsv(tmp_path, "train.tsv", SST2_HEADER, SST2_ROWS)
    assert read_sst2_rows(path, 0, 2) == [("it 's a charming and often affecting journey . ", "1"),
                                          ("unflinchingly bleak and desperate ", "0")]
    assert read_sst2_rows(path, 2, None) == [('" the emperor \'s new clothes " is a waste of time . ', "0")]


def test_private_rows_become_instructions_with_the_loss_on_the_review_only(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    rows = read_sst2_rows(write_tsv(tmp_path, "train.tsv", SST2_HEADER, SST2_ROWS), 0, None)
    train = write_instructions(rows, tmp_path / "lm" / "train.jsonl")
    data = TextDataModule(train_file=str(train), val_file=str(train), prompt_column="prompt",
                          response_column="response", tokenizer=str(tiny_bpe_dir), max_length=64)
    tokenizer = data.tokenizer
    for (sentence, label), example in zip(rows, data.dataset("train"), strict=True):
        prompt_ids = tokenizer.encode(CONTROL_PROMPTS[label])
        assert example["input_ids"][: len(prompt_ids)] == prompt_ids
        assert example["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(example["input_ids"]) - len(prompt_ids))
        assert tokenizer.decode(example["input_ids"][len(prompt_ids) : -1]) == sentence


def test_the_prompts_file_asks_each_label_by_its_control_prompt(tmp_path: Path) -> None:
    prompts = read_prompts(write_prompts(tmp_path / "prompts.jsonl"))
    assert [(p.text, p.label) for p in prompts] == [(text, label) for label, text in CONTROL_PROMPTS.items()]


def test_synthetic_samples_become_a_glue_folder_dplit_reads(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    dev = write_tsv(tmp_path / "real", "dev.tsv", SST2_HEADER, SST2_ROWS)
    samples = [{"label": "1", "text": "a fine\tfilm\nwith heart"}, {"label": "0", "text": "  \n"},
               {"label": "0", "text": 'a " dull one'}]
    counts = write_synthetic_tsv(samples, tmp_path / "synthetic", dev)
    assert counts == {"rows": 2, "dropped_empty": 1, "positive": 1}
    data = GlueDataModule("sst2", data_dir=str(tmp_path / "synthetic"), tokenizer=str(tiny_bpe_dir),
                          label_words={"0": " negative", "1": " positive"})
    assert [int(example["label"]) for example in data.dataset("train")] == [1, 0]
    assert len(data.dataset("dev")) == len(SST2_ROWS)
    assert (tmp_path / "synthetic" / "train.tsv").read_text().splitlines()[1] == "a fine film with heart\t1"


def test_distinct_n_by_hand() -> None:
    texts = ["the film is good", "The film is bad"]
    assert distinct_n(texts, 1) == pytest.approx(5 / 8)  # the, film, is, good, bad
    assert distinct_n(texts, 2) == pytest.approx(4 / 6)  # the film, film is, is good, is bad
    assert distinct_n(["one"], 2) is None


def test_overlap_counts_verbatim_8_grams_of_the_private_rows() -> None:
    private = ["a b c d e f g h i j"]  # 8-grams: a..h, b..i, c..j
    synthetic = ["x a b c d e f g h", "c d e f g h i j"]  # 2 + 1 8-grams, of which 1 + 1 are private
    assert overlap_share(synthetic, private) == pytest.approx(2 / 3)
    assert overlap_share(["too short"], private) is None


def test_profiles_fill_every_setting_and_flags_override_them() -> None:
    args = parse_args(["--seeds", "3", "--synthetic-per-label", "5"])
    assert args.seeds == [3] and args.synthetic_per_label == 5 and args.train_examples == 320
    assert parse_args(["--train-examples", "0", "--full"]).train_examples is None
    with pytest.raises(SystemExit):
        parse_args(["--lm-batch-size", "0"])
    json.dumps({key: value for key, value in vars(args).items() if not isinstance(value, Path)})


def test_the_plan_runs_the_pretrained_control_and_both_dp_arms_per_seed_and_epsilon() -> None:
    assert plan(parse_args(["--seeds", "0", "1", "--epsilons", "3"])) == [
        ("zero_shot", None, 0),
        ("synthetic", None, 0), ("dp_tied", 3.0, 0), ("synthetic", 3.0, 0),
        ("synthetic", None, 1), ("dp_tied", 3.0, 1), ("synthetic", 3.0, 1),
    ]  # fmt: skip


def test_words_split_clitics_and_punctuation_as_sst2_does() -> None:
    assert words("It doesn't work, it's DULL.") == words("it does n't work , it 's dull .")
    assert words("it does n't work") == ["it", "does", "n't", "work"]


def test_synthetic_statistics_count_copies_and_the_chance_overlap() -> None:
    private = ["a b c d e f g h i j", "it 's a charming film ."]
    described = describe_synthetic(["It's a charming film.", "x y z"], private, held_out=["a b c d e f g h z"])
    assert described["copied_rows"] == pytest.approx(1 / 2)
    assert described["held_out_overlap_8gram"] == pytest.approx(1 / 2)  # a..h is private, b..z is not
    assert describe_synthetic(["x"], private, held_out=None)["held_out_overlap_8gram"] is None


def test_held_out_rows_follow_the_private_set_or_come_from_its_end_when_it_is_the_whole_split(tmp_path: Path) -> None:
    data = tmp_path / "sst2"
    write_tsv(data, "train.tsv", SST2_HEADER, SST2_ROWS)
    sources = {"data_dir": str(data)}
    files = prepare_files(parse_args(["--train-examples", "2", "--lm-val-examples", "5", "--logs", str(tmp_path / "a")]),
                          sources)
    assert len(files["private_texts"]) == 2 and len(files["held_out_texts"]) == 1
    assert len(files["val"].read_text().splitlines()) == 1
    whole = prepare_files(parse_args(["--full", "--lm-val-examples", "2", "--logs", str(tmp_path / "b")]), sources)
    assert len(whole["private_texts"]) == 3 and whole["held_out_texts"] is None
    assert [json.loads(line)["response"] for line in whole["val"].read_text().splitlines()] == whole["private_texts"][-2:]


def printed_config(argv: list[str]) -> dict:
    """What dplit's own parser makes of a benchmark command line (``--print_config``: nothing runs)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        run_lm_cli([*argv[1:], "--print_config"]) if argv[0] == "lm" else run_cli([*argv, "--print_config"])
    assert exit_.value.code in (0, None), out.getvalue()
    return yaml.safe_load(out.getvalue())


def test_the_pipelines_commands_mean_what_the_study_says_to_dplits_parsers(tmp_path: Path) -> None:
    args = parse_args(["--smoke", "--logs", str(tmp_path)])
    sources = {"pretrained": str(tmp_path / "model"), "gguf_file": None, "data_dir": str(tmp_path / "private")}
    files = {"train": tmp_path / "private.jsonl", "val": tmp_path / "val.jsonl"}
    lm = printed_config(lm_fit_args(args, sources, files, 3.0, 0, tmp_path / "lm"))
    assert (lm["data"]["train_file"], lm["data"]["prompt_column"], lm["data"]["response_column"]) == (
        str(files["train"]), "prompt", "response")
    assert lm["trainer"]["strategy"]["init_args"]["target_epsilon"] == 3.0
    assert lm["model"]["pretrained"] == sources["pretrained"] and lm["model"]["sample_prompts"] == []
    assert any(c.get("init_args", {}).get("save_last") for c in lm["trainer"]["callbacks"])
    direct = printed_config(classifier_args(args, sources, "dp_tied", 3.0, 0, tmp_path / "dp"))
    assert direct["data"]["data_dir"] == sources["data_dir"] and direct["data"]["max_train_examples"] == 32
    assert direct["trainer"]["strategy"]["init_args"]["target_epsilon"] == 3.0
    synthetic = printed_config(classifier_args(args, sources, "non_private", None, 0, tmp_path / "c",
                                               synthetic=tmp_path / "synthetic"))
    assert synthetic["data"]["data_dir"] == str(tmp_path / "synthetic")  # never the private rows
    assert synthetic["data"]["max_train_examples"] is None and synthetic["non_private"] is True
    assert synthetic["model"]["lr"] == args.synthetic_lr and synthetic["trainer"]["strategy"] == "auto"


def test_every_benchmark_and_study_records_the_machine_and_commit_and_starts_children_with_one_function() -> None:
    import bench.audit
    import bench.run
    from bench import machine
    from bench.study import arm, record, sst2
    from bench.synthetic import sitting as synthetic
    from bench.tying import sitting as tying

    for module in (bench.run, synthetic, tying, bench.audit, record):
        assert module.machine_info is machine.machine_info and module.git_info is machine.git_info, module.__name__
    for module in (bench.run, arm, sst2):
        assert module.child_environment is machine.child_environment, module.__name__
    git = machine.git_info("dplit")
    assert set(git) == {"commit", "uncommitted_changes", "describe"} and git["describe"].startswith(git["commit"][:12])
    assert {"cpu_model", "logical_cpus", "memory_gib", "gpu", "torch", "transformers", "opacus"} <= set(
        machine.machine_info()
    )
