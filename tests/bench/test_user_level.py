"""bench/user_level.py without the shared data: the user-column copy, the users-per-batch rule, seeds and the table.

The arms themselves need SmolLM2 and SST-2 (minutes on a CPU); the study's recorded runs are in
bench/results/user_level/: a rerun with the default settings must keep them (not run them again).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import user_level
from bench.machine import git_info
from bench.study.paired import paired_runs
from bench.study.resume import earlier_sitting, planned_runs, study_settings
from bench.user_level import NOT_RECORDED, main, migrate, parse_args, table, user_batch, write_user_tsv
from dplit.data.users import synthetic_users
from tests.bench.study_sitting import MACHINE_LINE, data_root, sitting, study_argv


def test_write_user_tsv_adds_the_seeded_users(tmp_path: Path) -> None:
    source = tmp_path / "train.tsv"
    source.write_text("sentence\tlabel\n" + "".join(f"row {i} \t{i % 2}\n" for i in range(50)), encoding="utf-8")
    users = write_user_tsv(source, tmp_path / "out" / "train.tsv", 30, most_rows=5)
    assert users == synthetic_users(30, seed=0, most_rows=5)
    lines = (tmp_path / "out" / "train.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "sentence\tlabel\tuser"
    assert lines[1:] == [f"row {i} \t{i % 2}\t{user}" for i, user in enumerate(users)]


def test_user_batch_matches_the_expected_rows_per_step() -> None:
    users = ["a"] * 10 + ["b"] * 2 + ["c"]  # min(rows, 4): 4, 2, 1 → 7/3 rows per sampled user
    batch, per_user = user_batch(users, 8, 4)
    assert per_user == 7 / 3
    assert batch == 3  # 8 / (7/3) = 3.43
    assert user_batch(["a"], 1, 4)[0] == 1


MACHINE = {"cpu_model": "test cpu", "logical_cpus": 2, "memory_gib": 1.0, "gpu": None, "torch": "x",
           "transformers": "x", "lightning": "x", "opacus": "x"}  # fmt: skip


def run(arm: str, seed: int, accuracy: float, **extra: object) -> dict:
    return {"name": f"{arm}_seed{seed}", "arm": arm, "seed": seed, "status": "ok", "val_acc": accuracy,
            "batch_size": 8 if arm == "example" else 2, "epsilon_spent": 8.0, "delta": 1e-3, "noise_multiplier": 0.4,
            "steps": 128 if arm == "example" else 46, "step_time_median_s": 4.0 + seed, "step_batch_sizes": [6, 10],
            "git": "abc", **extra}  # fmt: skip


def record(runs: list[dict], settings: dict[str, str] | None = None) -> dict:
    return {"command": "python -m bench.user_level", "settings": settings or study_settings(parse_args([])),
            "machine": MACHINE, "git": {"commit": "abc", "uncommitted_changes": False, "describe": "abc"},
            "model": "SmolLM2", "train_rows": 1024, "dev_rows": 256, "users": 91, "largest_user_rows": 20, "k": 4,
            "mean_rows_per_sampled_user": 3.8, "seeds": sorted({r["seed"] for r in runs if "seed" in r}),
            "runs": runs}  # fmt: skip


def test_the_recorded_study_resumes_without_rerunning_its_finished_runs() -> None:
    recorded = Path(__file__).parents[2] / "bench" / "results" / "user_level"
    args = parse_args([])
    previous, kept = earlier_sitting(recorded, study_settings(args), migrate)
    finished = {(row["arm"], row["seed"]) for row in kept}
    assert {("example", 0), ("user", 0)} <= finished  # the first sitting's runs, named by arm alone, are seed 0
    planned = planned_runs(args.seeds, ARMS, {row["name"] for row in kept})
    assert not {(run["arm"], run["seed"]) for run in planned} & finished
    assert {run["seed"] for run in planned} <= set(args.seeds) == {0, 1, 2, 3, 4}


ARMS = {"example": {"privacy_unit": "example", "batch_size": 8}, "user": {"privacy_unit": "user", "batch_size": 2}}


def test_planned_runs_pair_both_arms_of_each_seed() -> None:
    stamp = {"git": "abc", "machine": "test cpu"}
    planned = planned_runs([0, 1, 2], ARMS, {"example_seed0", "user_seed0", "user_seed1"}, stamp)
    assert [(r["arm"], r["seed"], r["batch_size"]) for r in planned] == [("example", 1, 8), ("example", 2, 8),
                                                                        ("user", 2, 2)]  # fmt: skip
    assert all(r["git"] == "abc" and r["machine"] == "test cpu" and r["privacy_unit"] == r["arm"] for r in planned)


def test_a_study_with_other_settings_is_refused_and_a_moved_one_resumes(tmp_path: Path) -> None:
    other = study_settings(parse_args(["--k", "2"]))
    (tmp_path / "results.json").write_text(json.dumps(record([run("user", 0, 0.8)], other)))
    with pytest.raises(SystemExit, match="other settings"):
        earlier_sitting(tmp_path, study_settings(parse_args([])))
    moved = study_settings(parse_args(["--out", "/elsewhere", "--logs", "/elsewhere/logs", "--jobs", "1"]))
    failed = {**run("user", 1, 0.0), "status": "failed", "message": "killed"}
    (tmp_path / "results.json").write_text(json.dumps(record([run("user", 0, 0.8), failed], moved)))
    _, kept = earlier_sitting(tmp_path, study_settings(parse_args(["--seeds", "7"])))
    assert [row["name"] for row in kept] == ["user_seed0"]  # a failed run is run again


def test_the_table_pairs_the_arms_by_seed_and_renders_from_results_json(tmp_path: Path) -> None:
    runs = [run("example", seed, acc) for seed, acc in enumerate([0.80, 0.81, 0.82])]
    runs += [run("user", seed, acc) for seed, acc in enumerate([0.81, 0.83, 0.82])]  # user − example: +1, +2, 0
    runs += [run("user", 9, 0.5), {**run("example", 3, 0.0), "status": "failed", "message": "timed out"}]
    (tmp_path / "results.json").write_text(json.dumps(record(runs)))
    results = main(["--render", "--out", str(tmp_path)])
    text = (tmp_path / "table.md").read_text()
    assert text == table(results)
    assert "| user − example | 3 | +1.0 | [-1.5, +3.5] | 2/0/1, 0.50 |" in text  # t(0.975, 2) · 1 / √3 = 2.48
    assert "| example | 3 | 8 rows | 81.0 ± 1.0% | 8.00 (1.0e-03) | 0.400 | 128 | 5.00 | 8.0 |" in text
    assert "| user | 3 | 2 users | 82.0 ± 1.0% | 8.00 (1.0e-03) | 0.400 | 46 | 5.00 | 8.0 |" in text  # seed 9: no pair
    assert "Left out (their seed lacks a finished run of another arm): user_seed9." in text
    assert "Failed: example_seed3 (timed out)." in text


def test_the_first_sittings_runs_are_read_as_seed_0() -> None:
    old = {"name": "user", "privacy_unit": "user", "status": "ok", "val_acc": 0.8}
    results = migrate({**record([]), "seeds": [0], "runs": [old]})
    assert results["runs"] == [{**old, "name": "user_seed0", "arm": "user", "seed": 0, "git": "abc"}]
    assert migrate(results) == results


def test_the_footer_names_every_commit_and_machine_of_the_runs_it_tabulates() -> None:
    runs = [run("example", 0, 0.8, git="old"), run("user", 0, 0.8, git="old")]  # recorded before rows named machines
    runs += [run(arm, 1, 0.8, git="new", machine="cpu A") for arm in ("example", "user")]
    runs += [run(arm, 2, 0.8, git="new", machine="cpu B; torch 9") for arm in ("example", "user")]
    text = table(record(runs))
    assert "Runs by commit: seeds [0] at `old`; seeds [1, 2] at `new`." in text
    assert f"- seeds [0]: {NOT_RECORDED}\n- seeds [1]: cpu A\n- seeds [2]: cpu B; torch 9\n" in text
    assert "Last sitting. Machine: test cpu, 2 logical CPUs, 1.0 GiB, no GPU; torch x" in text


def test_a_sitting_stamps_each_new_row_with_its_commit_and_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = study_argv(tmp_path, data_root(tmp_path), "--train-rows", "40", "--seeds", "0", "1")
    assert [run["name"] for run in sitting(user_level, monkeypatch, argv)] == [
        "example_seed0", "user_seed0", "example_seed1", "user_seed1"]  # fmt: skip
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    describe = git_info("dplit", "configs", "bench")["describe"]
    assert all(row["git"] == describe and row["machine"] == MACHINE_LINE for row in rows)
    assert f"- seeds [0, 1]: {MACHINE_LINE}\n" in (tmp_path / "out" / "table.md").read_text()


def test_arms_sharing_no_seed_keep_every_finished_run() -> None:
    runs = [run("example", 0, 0.8), run("user", 1, 0.9), {**run("user", 2, 0.0), "status": "failed"}]
    assert paired_runs(runs) == (runs[:2], [])
    assert paired_runs([*runs, run("example", 1, 0.7)]) == ([runs[1], run("example", 1, 0.7)], ["example_seed0"])


def test_the_committed_table_renders_unchanged_but_for_its_footer(tmp_path: Path) -> None:
    recorded = Path(__file__).parents[2] / "bench" / "results" / "user_level"
    (tmp_path / "results.json").write_bytes((recorded / "results.json").read_bytes())
    main(["--render", "--out", str(tmp_path)])
    rendered = (tmp_path / "table.md").read_text()
    committed = (recorded / "table.md").read_text()
    assert rendered.split("\nRuns by commit: ")[0] == committed.split("\nMachine: ")[0]
    runs = committed.split(". Runs: ")[1]  # the runs' commits, as committed; their machines were not recorded
    assert f"Runs by commit: {runs}\n" in rendered and f"- seeds [0, 1, 2, 3, 4]: {NOT_RECORDED}\n" in rendered
