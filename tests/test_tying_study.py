"""The tying study's own machinery: paired statistics, the plan, the learning-rate sweep's data, and resuming."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.machine import child_environment
from benchmarks.study import sst2
from benchmarks.study.paired import VERDICTS, paired_statistics, seeds_for_half_width, sign_test
from benchmarks.tying import Study, chosen_lr, grid_runs, parse_args, recorded_rows, settings_key
from dplit.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.model import CausalLMClassifier
from dplit.privacy.engine import trainable_parameters
from tests.glue_files import SST2_HEADER, SST2_ROWS, write_tsv

ROOT = Path(__file__).resolve().parents[1]
T_975 = {9: 2.2621571627, 16: 2.1199052992, 17: 2.1098155778}
"""Student t 97.5% quantiles by degrees of freedom (printed tables)."""


def exact_sign_p(positive: int, n: int) -> float:
    """Two-sided sign-test p-value from exact binomial sums."""
    tail = sum(Fraction(comb(n, k), 2**n) for k in range(min(positive, n - positive) + 1))
    return float(min(Fraction(1), 2 * tail))


@pytest.mark.parametrize(("positive", "negative", "ties"), [(9, 1, 0), (8, 2, 0), (10, 0, 0), (3, 3, 4), (1, 6, 2)])
def test_the_sign_test_is_the_exact_binomial_tail_with_ties_dropped(positive: int, negative: int, ties: int) -> None:
    result = sign_test([0.01] * positive + [-0.02] * negative + [0.0] * ties)
    assert (result["positive"], result["negative"], result["ties"]) == (positive, negative, ties)
    assert result["p"] == pytest.approx(exact_sign_p(positive, positive + negative), rel=1e-12)


def test_the_paired_t_interval_is_mean_plus_minus_t_times_the_standard_error() -> None:
    differences = [0.004, 0.012, -0.003, 0.008, 0.015, 0.001, 0.009, 0.006, 0.011, 0.002]
    result = paired_statistics(differences)
    mean = sum(differences) / 10
    std = (sum((d - mean) ** 2 for d in differences) / 9) ** 0.5
    half = T_975[9] * std / 10**0.5
    assert result["mean"] == pytest.approx(mean) and result["std"] == pytest.approx(std)
    assert result["ci"] == pytest.approx([mean - half, mean + half], rel=1e-8)


def test_a_direction_is_claimed_only_when_the_interval_and_the_sign_test_agree() -> None:
    nine_of_ten = [0.01, 0.012, 0.008, 0.011, 0.009, 0.01, 0.013, 0.007, 0.01, -0.001]
    assert paired_statistics(nine_of_ten)["verdict"] == "untied better"
    assert paired_statistics([-d for d in nine_of_ten])["verdict"] == "tied better"
    eight_of_ten = [0.01, 0.012, 0.008, 0.011, 0.009, 0.01, 0.013, 0.007, -0.001, -0.001]
    result = paired_statistics(eight_of_ten)
    assert result["ci"][0] > 0 and result["sign_test"]["p"] > 0.05  # t alone would claim it; the sign test does not
    assert result["verdict"] == "no difference resolved"
    spread = paired_statistics([0.03, -0.02, 0.01, -0.01, 0.02, -0.03])
    assert spread["ci"][0] < 0 < spread["ci"][1] and spread["verdict"] == "no difference resolved"
    single = paired_statistics([0.05])
    assert single["ci"] is None and single["verdict"] == VERDICTS[2]


def test_seed_sizing_uses_the_t_quantile_of_the_sample_it_sizes() -> None:
    # std 1 point, half-width 0.5: 17 seeds give 2.120 / √17 = 0.514 > 0.5, 18 give 2.110 / √18 = 0.497
    assert T_975[16] / 17**0.5 > 0.5 > T_975[17] / 18**0.5
    assert seeds_for_half_width(0.01, 0.005) == 18
    assert seeds_for_half_width(0.004, 0.005) == 5


def test_the_grid_runs_whole_pairs_seed_by_seed() -> None:
    args = parse_args(["--seeds", "0", "1", "--epsilons", "3", "8"])
    names = [run["name"] for run in grid_runs(args, ("dp_tied", "dp_untied"), 160)]
    assert names[:4] == [
        "rows160-dp_tied-eps3-seed0",
        "rows160-dp_untied-eps3-seed0",
        "rows160-dp_tied-eps8-seed0",
        "rows160-dp_untied-eps8-seed0",
    ]
    assert len(names) == 8 and names[-1] == "rows160-dp_untied-eps8-seed1"


def test_common_noise_gives_both_arms_of_a_seed_the_same_dp_seed_and_independent_noise_none(tmp_path: Path) -> None:
    sources = {"pretrained": "m", "gguf_file": None, "data_dir": None, "kind": "hub"}

    def dp_seeds(*flags: str) -> dict[str, str | None]:
        args = parse_args(["--seeds", "4", "--epsilons", "3", "--logs", str(tmp_path), *flags])
        study = Study(args, sources, None, "abc")
        seeds = {}
        for run in grid_runs(args, ("dp_tied", "dp_untied"), 160):
            command = study.command(run, tmp_path / run["name"])
            flag = "--trainer.strategy.init_args.seed"
            seeds[run["arm"]] = command[command.index(flag) + 1] if flag in command else None
        return seeds

    assert dp_seeds() == {"dp_tied": "4", "dp_untied": "4"}
    assert dp_seeds("--noise", "independent") == {"dp_tied": None, "dp_untied": None}


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_an_untied_model_draws_its_extra_noise_after_every_parameter_it_shares_with_the_tied_one(
    model_type: str,
) -> None:
    # DPStrategy's GradientBuffer draws noise parameter by parameter in trainable_parameters' order: with one DP seed,
    # the tied and untied arms then get the same noise on every shared parameter only if the untied head comes last
    config = {"model_type": model_type, "vocab_size": 50, "tie_word_embeddings": True}
    config |= (
        {"n_layer": 1, "n_embd": 16, "n_head": 2}
        if model_type == "gpt2"
        else {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    )
    names = {}
    for policy in (TiedEmbeddings(), UntiedEmbeddings(init="copy")):
        model = CausalLMClassifier(config=config, embeddings=policy, label_word_ids=[3, 7], vocab_size=50)
        names[type(policy).__name__] = list(trainable_parameters(model))
    tied, untied = names["TiedEmbeddings"], names["UntiedEmbeddings"]
    assert len(untied) == len(tied) + 1 and untied[: len(tied)] == tied and "lm_head" in untied[-1]


def test_each_arm_gets_a_port_of_its_own_and_no_inherited_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "29533")
    monkeypatch.setenv("RANK", "3")
    first, second = child_environment(1), child_environment(1)
    assert "RANK" not in first and first["MASTER_PORT"] != "29533" and first["MASTER_PORT"] != second["MASTER_PORT"]


def test_the_sweep_chooses_the_best_held_out_rate_only_once_every_candidate_finished() -> None:
    rows = [
        {"sweep": True, "rows": 160, "lr": lr, "val_acc": acc, "status": "ok"}
        for lr, acc in [(1e-5, 0.80), (3e-5, 0.86), (1e-4, 0.86)]
    ]
    assert chosen_lr(rows, 160, [1e-5, 3e-5, 1e-4]) == 3e-5  # a tie goes to the smaller rate
    assert chosen_lr(rows, 160, [1e-5, 3e-5, 1e-4, 3e-4]) is None
    assert chosen_lr(rows, 1000, [1e-5]) is None


def sst2_folder(folder: Path, rows: int) -> Path:
    """SST-2-format train.tsv (numbered rows, so each is distinct) and dev.tsv."""
    lines = [f"row {i} {SST2_ROWS[i % 3].split(chr(9))[0]}\t{i % 2}" for i in range(rows)]
    write_tsv(folder, "train.tsv", SST2_HEADER, lines)
    write_tsv(folder, "dev.tsv", SST2_HEADER, [f"dev {line}" for line in lines[:16]])
    return folder


def test_the_sweep_validates_on_held_out_training_rows_it_never_trains_on(tmp_path: Path) -> None:
    data = sst2_folder(tmp_path / "sst2", 100)
    args = parse_args(["--holdout-rows", "30", "--logs", str(tmp_path / "logs"), "--data-dir", str(data)])
    sources = {"pretrained": str(tmp_path / "model"), "gguf_file": None, "data_dir": str(data), "kind": "local folder"}
    holdout = sst2.prepare_holdout(args, sources)
    train = (data / "train.tsv").read_text().splitlines()[1:]
    held_out = (Path(holdout["data_dir"]) / "dev.tsv").read_text().splitlines()[1:]
    assert sorted(held_out) == sorted(train[-30:])  # the last training rows, not one dev row
    assert sst2.sweep_train_rows(60, holdout, 30) == 60 and sst2.sweep_train_rows(90, holdout, 30) == 70
    assert sst2.sweep_train_rows(None, holdout, 30) == 70  # "all rows" stops before the held-out slice
    study = Study(args, sources, holdout, "abc")
    run = {"arm": "non_private", "epsilon": None, "seed": 0, "rows": 90, "lr": 1e-4, "sweep": True, "name": "s"}
    command = study.command(run, tmp_path / "logs" / "s")
    assert command[command.index("--data.data_dir") + 1] == holdout["data_dir"]
    assert command[command.index("--data.max_train_examples") + 1] == "70"
    assert command[command.index("--model.lr") + 1] == "0.0001"
    with pytest.raises(SystemExit, match="--holdout-rows 100"):
        sst2.prepare_holdout(parse_args(["--holdout-rows", "100", "--logs", str(tmp_path / "l2")]), sources)


def test_a_fingerprint_holds_the_command_and_code_but_no_machine_path(tmp_path: Path) -> None:
    args = parse_args(["--logs", str(tmp_path / "logs")])
    sources = {
        "pretrained": str(tmp_path / "model"),
        "gguf_file": None,
        "data_dir": str(tmp_path / "sst2"),
        "kind": "local folder",
    }
    run = grid_runs(args, ("dp_tied",), 160)[0]
    printed = Study(args, sources, None, "abc").fingerprint(run)
    assert str(tmp_path) not in printed and "<logs>" in printed and "<sst2>" in printed
    moved = {**sources, "pretrained": "/elsewhere/model", "data_dir": "/elsewhere/sst2"}
    args_moved = parse_args(["--logs", "/elsewhere/logs"])
    assert Study(args_moved, moved, None, "abc").fingerprint(run) == printed
    assert Study(args, sources, None, "def").fingerprint(run) != printed
    assert (
        Study(parse_args(["--logs", str(tmp_path / "logs"), "--lr", "1e-4"]), sources, None, "abc").fingerprint(run)
        != printed
    )


def test_rows_of_other_settings_or_failed_rows_are_not_kept() -> None:
    args = parse_args([])
    sources = {"pretrained": "m", "gguf_file": None, "data_dir": None, "kind": "hub"}
    key = settings_key(args, sources, "abc")
    rows = [{"status": "ok", "fingerprint": "a"}, {"status": "failed", "fingerprint": "b"}]
    earlier = {"settings_key": key, "runs": rows}
    assert recorded_rows(earlier, key) == ([rows[0]], 1)
    assert recorded_rows(earlier, settings_key(parse_args(["--batch-size", "16"]), sources, "abc")) == ([], 2)
    assert recorded_rows(earlier, settings_key(args, sources, "def")) == ([], 2)


# --------------------------------------------------------------------------------------------------------------------
# The real study, on a tiny random GPT-2: each arm a dplit process; a rerun skips what is recorded


@pytest.fixture
def tiny_pretrained(tmp_path: Path, tiny_bpe_dir: Path) -> Path:
    """A random tied GPT-2 with the tiny BPE tokenizer, saved as a local pretrained folder."""
    folder = tmp_path / "tiny-gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=400, n_layer=1, n_embd=16, n_head=2, n_positions=64)).save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tiny_bpe_dir / name, folder / name)
    return folder


def study(tmp_path: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "benchmarks.tying", "--pretrained", str(model), "--data-dir",
               str(tmp_path / "sst2"), "--train-examples", "16", "--batch-size", "8", "--epsilons", "8",
               "--arms", "dp_tied", "dp_untied", "non_private", "--sweep-lrs", "0.001", "0.01",
               "--holdout-rows", "16", "--reference-seeds", "1", "--eval-batch-size", "16", "--max-length", "32",
               "--physical-batch-size", "8", "--timeout", "300", "--out", str(tmp_path / "out"), "--logs",
               str(tmp_path / "logs"), *extra]  # fmt: skip
    # as after an in-process DP run (Lightning exports MASTER_PORT): the arms, 2 at a time, must not share it
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": "29533", "MASTER_ADDR": "127.0.0.1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=environment, check=False)


def test_the_study_resumes_from_its_results_and_pairs_by_seed(tmp_path: Path, tiny_pretrained: Path) -> None:
    sst2_folder(tmp_path / "sst2", 48)
    first = study(tmp_path, tiny_pretrained, "--seeds", "0")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    names = {r["name"]: r for r in results["runs"]}
    assert set(names) == {
        "rows16-dp_tied-eps8-seed0",
        "rows16-dp_untied-eps8-seed0",
        "rows16-sweep-lr0.001",
        "rows16-sweep-lr0.01",
        "rows16-non_private-seed0",
    }
    assert all(r["status"] == "ok" for r in names.values()) and results["complete"]
    sweep = results["summary"]["sweep"][0]
    assert sweep["held_out_rows"] == 16 and sweep["train_rows"] == 16
    assert names["rows16-non_private-seed0"]["lr"] == sweep["chosen_lr"]
    assert names["rows16-dp_tied-eps8-seed0"]["epsilon_spent"] == pytest.approx(8.0, abs=0.05)
    assert names["rows16-dp_untied-eps8-seed0"]["noise"].startswith("explicit_seed")  # common random numbers

    again = study(tmp_path, tiny_pretrained, "--seeds", "0")
    assert again.returncode == 0 and "4 of 4 runs already recorded" in again.stdout, again.stdout[-3000:]
    assert "1 of 1 runs already recorded" in again.stdout
    rerun = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["name"] for r in rerun["runs"]] == [r["name"] for r in results["runs"]]
    assert len(rerun["sittings"]) == 2 and rerun["sittings"][1]["arms_run"] == 0

    more = study(tmp_path, tiny_pretrained, "--seeds", "0", "1")
    assert more.returncode == 0, more.stdout[-3000:]
    grown = json.loads((tmp_path / "out" / "results.json").read_text())
    assert grown["sittings"][2]["arms_run"] == 2  # only seed 1's pair: the sweep and the reference are recorded
    (cell,) = grown["summary"]["untied_minus_tied"]
    assert cell["n"] == 2 and cell["seeds"] == [0, 1] and cell["verdict"] in VERDICTS
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| full fine-tuning | 16 | 8 | 2 |" in table and "held-out TRAINING rows" in table
