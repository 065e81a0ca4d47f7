"""The tying study's own machinery: paired statistics, the plan, the learning-rate sweep's data, and resuming."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from fractions import Fraction
from math import comb
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bench.machine import child_environment
from bench.study import sst2
from bench.study.paired import VERDICTS, paired_statistics, seeds_for_half_width, sign_test
from bench.study.version import (
    STUDY_CODE_VERSION,
    config_digest,
    migrate_fingerprint,
    portable_command,
    study_code_version,
)
from bench.tying.arguments import parse_args
from bench.tying.arms import ARMS, Study
from bench.tying.plan import chosen_lr, grid_runs
from bench.tying.resume import migrate_record, recorded_rows, rerun_plan, settings_key
from dplit.backbone.embeddings import TiedEmbeddings, UntiedEmbeddings
from dplit.privacy.clipping.engine import trainable_parameters
from dplit.tasks.classifier import CausalLMClassifier
from tests.helpers.glue_files import SST2_HEADER, SST2_ROWS, write_tsv
from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY
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


def test_a_fingerprint_survives_moved_code_and_configs_but_not_a_changed_class_flag_or_value(tmp_path: Path) -> None:
    recorded = ["fit", "--config", "configs/smollm2_sst2_lora.yaml", "--model.embeddings",
                "dplit.embeddings.UntiedEmbeddings", "--trainer.callbacks",
                '[{"class_path": "dplit.callbacks.ResourceMonitor"}, {"class_path": "benchmarks.study.arm.StepTimer"}]',
                "--model.pretrained", "SmolLM2-135M-Instruct.Q4_1.gguf", "--data.template", "Review: {sentence}",
                "--trainer.strategy.init_args.max_grad_norm", "0.1"]  # fmt: skip
    moved = [item.replace("configs/", "configs/studies/").replace("dplit.embeddings.", "dplit.tasks.embeddings.")
             .replace("benchmarks.study.", "bench.study.") for item in recorded]  # fmt: skip
    portable = portable_command(recorded, {})
    assert portable_command(moved, {}) == portable
    assert "UntiedEmbeddings" in portable and "Review: {sentence}" in portable and "StepTimer" in portable[6]
    for changed in ("dplit.embeddings.TiedEmbeddings", "0.2", "--model.lr"):
        other = [changed if item in ("dplit.embeddings.UntiedEmbeddings", "0.1") else item for item in recorded]
        other = other if changed != "--model.lr" else [*recorded, "--model.lr", "0.001"]
        assert portable_command(other, {}) != portable, changed
    # a config by content: comments, layout and a class's module do not count; a value does
    config = ROOT / "configs" / "smollm2_sst2_tied.yaml"
    text = config.read_text()
    rewritten = tmp_path / "rewrapped.yaml"
    rewritten.write_text("# moved\n" + text.replace("dplit.strategy.DPStrategy", "dplit.privacy.dpsgd.DPStrategy"))
    assert config_digest(rewritten) == config_digest(config)
    rewritten.write_text(text.replace("max_grad_norm: 0.1", "max_grad_norm: 0.2"))
    assert config_digest(rewritten) != config_digest(config)


def git(folder: Path, *command: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=folder, check=True,
                   capture_output=True)  # fmt: skip


@pytest.mark.slow
def test_the_code_version_is_the_reviewed_one_whatever_was_committed_plus_uncommitted_changes(tmp_path: Path) -> None:
    assert study_code_version(tmp_path) == STUDY_CODE_VERSION  # not a git checkout: nothing uncommitted to see
    (tmp_path / "dplit").mkdir()
    (tmp_path / "dplit" / "step.py").write_text("noise = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "dplit")
    git(tmp_path, "commit", "-q", "-m", "first")
    assert study_code_version(tmp_path) == STUDY_CODE_VERSION
    (tmp_path / "dplit" / "step.py").write_text("noise = 2\n")
    edited = study_code_version(tmp_path)
    assert edited.startswith(STUDY_CODE_VERSION + "+uncommitted:")
    (tmp_path / "dplit" / "new.py").write_text("x = 1\n")
    assert study_code_version(tmp_path) not in (edited, STUDY_CODE_VERSION)
    (tmp_path / "notes.txt").write_text("elsewhere\n")  # outside dplit/ and configs/: not the arms' code
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "move and change")  # a commit alone changes nothing: the version is reviewed
    assert study_code_version(tmp_path) == STUDY_CODE_VERSION


COMMITTED = ROOT / "bench" / "results" / "tying"
GRIDS = [
    ("results.json", [], True),
    ("lora-lr5e-4/results.json", ["--arms", "lora_tied", "lora_untied", "--train-examples", "160", "--lora-lr", "5e-4"],
     True),
    ("independent-noise/results.json", ["--noise", "independent"], False),  # a partial grid, before --noise existed
]  # fmt: skip
"""Each committed grid, the command that reruns it and whether it is complete."""


@pytest.mark.parametrize(("path", "argv", "complete"), GRIDS, ids=[grid[0] for grid in GRIDS])
def test_every_arm_of_a_committed_grid_is_still_recorded_for_the_current_code(
    path: str, argv: list[str], complete: bool
) -> None:
    """A rerun with the command of every sitting skips each recorded arm and, for a complete grid, runs nothing.

    This fails when a change alters a recorded arm's fingerprint: if its numbers did not change (a move, a rename), the
    fingerprint must not either (bench/study/version.py); if they did, bump STUDY_CODE_VERSION and decide here
    what becomes of the committed grid (rerun it, or keep it as the record of an older code version).
    """
    record = json.loads((COMMITTED / path).read_text())
    names = {row["name"] for row in record["runs"]}
    sittings = [[item for item in shlex.split(s["command"])[3:] if item != "--fresh"] for s in record["sittings"]]
    skipped: set[str] = set()
    for sitting in [argv] + (sittings if complete else []):
        plan = rerun_plan(record, sitting)
        assert plan["dropped"] == [] and set(plan["kept"]) == names, (sitting, plan["dropped"][:5])
        assert not complete or plan["run"] == [], (sitting, plan["run"][:5])
        skipped |= set(plan["skip"])
    assert skipped == names  # every recorded arm is one the current code plans, with the fingerprint it recorded
    if complete:
        assert len(names) == len(record["runs"]) and record["complete"]


def test_format_1_fingerprints_are_migrated_from_their_own_text() -> None:
    record = json.loads((COMMITTED / "results.json").read_text())
    row = next(r for r in record["runs"] if r["arm"] == "lora_untied")
    old = json.loads(row["fingerprint"])
    assert "format" not in old and old["code"] == STUDY_CODE_VERSION
    new = json.loads(migrate_fingerprint(row["fingerprint"]))
    assert new["format"] == 2 and new["config"] == config_digest(ROOT / ARMS["lora_untied"].config)
    assert "UntiedEmbeddings" in new["command"] and "dplit.embeddings.UntiedEmbeddings" not in new["command"]
    assert migrate_fingerprint(json.dumps(new)) == json.dumps(new)  # format 2 stays as it is
    other = json.loads(migrate_fingerprint(json.dumps({**old, "code": "0" * 40})))
    assert other["config"] is None  # a code version whose configs are not known: it matches no current arm
    migrated, count = migrate_record(json.loads((COMMITTED / "independent-noise" / "results.json").read_text()))
    assert count == 42 and migrated["settings_key"]["noise"] == "independent"  # no --noise then: OS entropy
    dp = [r for r in migrated["runs"] if r["arm"].startswith("dp_")]
    assert {r.get("noise") for r in dp} == {"os_entropy", None}  # None: recorded before the arms said
    assert not any("--trainer.strategy.init_args.seed" in r["fingerprint"] for r in dp)


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


def checkout_copy(folder: Path) -> Path:
    """This working tree's dplit/, configs/ and bench/ (its results and outputs left out) in ``folder``.

    The study runs there, so its three sittings run the same code even while dplit/ changes in a shared checkout (the
    code version holds uncommitted changes: an edit between two sittings drops the recorded rows, as it should).
    """

    def ignore(directory: str, names: list[str]) -> list[str]:
        top = Path(directory) == ROOT / "bench"
        return [name for name in names if name == "__pycache__" or (top and name in ("results", "out"))]

    for name in ("dplit", "configs", "bench"):
        shutil.copytree(ROOT / name, folder / name, ignore=ignore)
    return folder


def study(tmp_path: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    checkout = tmp_path / "checkout"
    if not checkout.is_dir():
        checkout_copy(checkout)
    command = [sys.executable, "-m", "bench.tying", "--pretrained", str(model), "--data-dir",
               str(tmp_path / "sst2"), "--train-examples", "16", "--batch-size", "8", "--epsilons", "8",
               "--arms", "dp_tied", "dp_untied", "non_private", "--sweep-lrs", "0.001", "0.01",
               "--holdout-rows", "16", "--reference-seeds", "1", "--eval-batch-size", "16", "--max-length", "32",
               "--physical-batch-size", "8", "--timeout", "300", "--out", str(tmp_path / "out"), "--logs",
               str(tmp_path / "logs"), *extra]  # fmt: skip
    # as after an in-process DP run (Lightning exports MASTER_PORT): the arms, 2 at a time, must not share it
    environment = {**os.environ, "PYTHONPATH": str(checkout), "MASTER_PORT": "29533", "MASTER_ADDR": "127.0.0.1"}
    return subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=900, env=environment,
                          check=False)  # fmt: skip


def failures(results: dict[str, Any], logs: Path) -> str:
    """Why the runs that failed failed: their message and the end of their log (for an assertion's message)."""
    lines = []
    for row in results["runs"]:
        if row.get("status") != "ok":
            log = logs / row["name"] / "output.log"
            tail = log.read_text(errors="replace")[-1500:] if log.is_file() else "(no log)"
            lines.append(f"{row['name']}: {row.get('message')}\n{tail}")
    return "\n".join(lines) or f"every run ok; complete={results['complete']}"


@pytest.mark.slow
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
    why = failures(results, tmp_path / "logs")
    assert all(r["status"] == "ok" for r in names.values()) and results["complete"], why
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
    # only seed 1's pair: the sweep and the reference are recorded
    assert grown["sittings"][2]["arms_run"] == 2, failures(grown, tmp_path / "logs")
    assert {json.loads(r["fingerprint"])["code"] for r in grown["runs"]} == {STUDY_CODE_VERSION}
    (cell,) = grown["summary"]["untied_minus_tied"]
    assert cell["n"] == 2 and cell["seeds"] == [0, 1] and cell["verdict"] in VERDICTS
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| full fine-tuning | 16 | 8 | 2 |" in table and "held-out TRAINING rows" in table
