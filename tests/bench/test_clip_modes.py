"""bench/clip_modes.py without the shared data: its arms are valid DPStrategy settings, its table pairs by seed.

The runs themselves need SmolLM2 and SST-2 (10 minutes each on a CPU); the recorded study is in
bench/results/clip_modes/.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import clip_modes
from bench.clip_modes import STRATEGY, arm_flags, parse_args, table
from bench.machine import git_info
from dplit.privacy.settings import DPSGDSettings
from tests.bench.study_sitting import MACHINE_LINE, data_root, sitting, study_argv


def test_every_arm_is_a_valid_dpstrategy_setting_at_its_own_bound() -> None:
    arms = arm_flags(parse_args([]))
    assert list(arms) == ["fixed_C0.01", "fixed_C0.1", "fixed_C1", "quantile", "automatic"]
    for bound, flags in arms.values():
        values = dict(zip(flags[::2], flags[1::2], strict=True))
        settings = {key.removeprefix(STRATEGY): value for key, value in values.items()}
        if "target_quantile" in settings:
            settings["target_quantile"] = float(settings["target_quantile"])
        checked = DPSGDSettings(max_grad_norm=bound, noise_multiplier=1.0, **settings)
        assert checked.clip_mode in ("fixed", "quantile", "automatic")


def run(arm: str, seed: int, accuracy: float) -> dict:
    return {"name": f"{arm}_seed{seed}", "arm": arm, "seed": seed, "status": "ok", "val_acc": accuracy,
            "epsilon_spent": 8.0, "noise_multiplier": 0.4, "steps": 125, "step_time_median_s": 4.0,
            "clip": {"clip_mode": "quantile" if arm == "quantile" else "fixed", "clip_bound": 0.05,
                     "gradient_noise_multiplier": 0.45} if arm == "quantile" else {"clip_mode": "fixed"}}  # fmt: skip


def test_the_table_pairs_each_adaptive_mode_with_each_fixed_bound_by_seed() -> None:
    runs = [run("fixed_C0.1", seed, 0.80 + 0.01 * seed) for seed in range(3)]
    runs += [run("quantile", seed, 0.82 + 0.01 * seed) for seed in range(3)]
    runs.append(run("quantile", 9, 0.5))  # no fixed partner: left out of the pairs
    results = {"command": "python -m bench.clip_modes", "runs": runs, "model": "SmolLM2",
               "settings": {k: str(v) for k, v in vars(parse_args([])).items()},
               "machine": {"cpu_model": "test cpu", "logical_cpus": 2, "memory_gib": 1.0, "gpu": None,
                           "torch": "x", "transformers": "x", "lightning": "x", "opacus": "x"},
               "git": {"commit": "abc", "uncommitted_changes": False}}  # fmt: skip
    text = table(results)
    assert "| quantile − fixed_C0.1 | 3 | +2.0 | [+2.0, +2.0] | 3/0/0, 0.25 |" in text
    assert "| quantile | 3 | 83.0 ± 1.0% |" in text and "0.05–0.05" in text and "0.400 (0.450)" in text
    assert "| fixed_C0.1 | 3 | 81.0 ± 1.0% |" in text  # arm means over the paired seeds: they differ by the +2.0
    assert "Left out (their seed lacks a finished run of another arm): quantile_seed9." in text


@pytest.mark.parametrize("bad", [["--seeds"], ["--fixed-bounds", "x"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)


def test_each_new_row_records_the_commit_and_machine_it_ran_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planned = sitting(clip_modes, monkeypatch, study_argv(tmp_path, data_root(tmp_path), "--seeds", "0", "--jobs", "1"))
    assert [run["name"] for run in planned] == [f"{arm}_seed0" for arm in arm_flags(parse_args([]))]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    describe = git_info("dplit", "configs", "bench")["describe"]
    assert all(row["git"] == describe and row["machine"] == MACHINE_LINE for row in rows)


def test_the_committed_table_renders_byte_for_byte_from_its_results(tmp_path: Path) -> None:
    recorded = Path(__file__).parents[2] / "bench" / "results" / "clip_modes"
    (tmp_path / "results.json").write_bytes((recorded / "results.json").read_bytes())
    clip_modes.main(["--render", "--out", str(tmp_path)])
    assert (tmp_path / "table.md").read_text() == (recorded / "table.md").read_text()
