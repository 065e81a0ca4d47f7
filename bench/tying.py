"""Tied vs untied embeddings under DP-SGD on a real pretrained LM and task: SmolLM2-135M-Instruct on GLUE SST-2.

    python -m bench.tying --smoke        # tiny subset, 1 seed, 1 ε, 64 dev rows: a few minutes (a check)
    python -m bench.tying                # default CPU profile (see PROFILES): many hours, resumable
    python -m bench.tying --full         # the paper's recipe (all 67,349 rows, B=1000, 3 epochs): for a GPU
    python -m bench.tying --hub          # weights, tokenizer and GLUE from the Hugging Face hub
    python -m bench.tying --arms lora_tied lora_untied lora_frozen   # any subset of ARMS

Arms (:data:`ARMS`), all with the same hyperparameters (expected batch, epochs, max_length, label words, seeds) and,
for the DP arms, the same privacy budget; full fine-tuning at ``--lr``, LoRA at ``--lora-lr``:

* ``zero_shot``: the pretrained model, no training, validation only (``dplit validate``).
* ``non_private``: the same module trained without ``DPStrategy`` (``--trainer.strategy auto --non_private true``), at
  the learning rate a sweep chose (``--sweep-lrs``, one seed, each candidate trained on the scale's rows and validated
  on the last ``--holdout-rows`` rows of SST-2 train: held-out training rows, never the dev set); on the first
  ``--reference-seeds`` seeds.
* ``dp_tied`` / ``dp_untied``: full fine-tuning with ``DPStrategy`` (ghost clipping, ``target_epsilon`` = ε) from
  ``configs/smollm2_sst2_tied.yaml`` (``TiedEmbeddings``, SmolLM2's own) and ``configs/smollm2_sst2_untied.yaml``
  (``UntiedEmbeddings(init="copy")``).
* ``lora_tied`` / ``lora_untied`` / ``lora_frozen``: ``configs/smollm2_sst2_lora.yaml`` (rank-8 LoRA on every
  projection) beside the trained tied embedding, beside a trained untied copy, or with the embedding frozen.

The grid is every arm × ε × seed at every data scale (``--train-examples``: the FIRST N rows of SST-2's train.tsv),
validated once after training on the whole GLUE dev split (872 rows unless ``--eval-examples``). Untied − tied is
compared per seed (:mod:`bench.study.paired`: mean, paired-t interval, sign test, verdict). Runs go in priority
order, ``--jobs`` at a time: full fine-tuning at each scale with its non-private reference, then LoRA.

The study resumes: each arm is recorded in ``results.json`` as it ends, with a fingerprint: the reviewed study code
version (:data:`bench.study.version.STUDY_CODE_VERSION`, not the git history of ``dplit/``, so moving code keeps
the grid), a digest of its config's content and its dplit command without this machine's paths (classes by name);
:mod:`bench.study.version` says what keeps and what invalidates a recorded arm. A rerun with the same settings
skips every arm already recorded with the same fingerprint and drops rows recorded under other settings or code
(rows of an older format are migrated as they are read: :func:`migrate_record`). So the grid can span several
sittings (``--fresh`` starts over). Each arm is ``dplit``'s own CLI in its own process
(:mod:`bench.study.arm`). ``results.json`` (every run, the summary, sittings, machine, commit), ``table.md`` and
``chart.png`` go to ``--out`` (default ``bench/results/tying/``); Lightning logs and each arm's output to
``--logs`` (default ``bench/out/tying/``, git-ignored).

Default CPU profile (see PROFILES): 160 and 1,000 rows, expected batch 8, 1 epoch (20 and 125 optimizer steps),
max_length 64 (no dev prompt is longer than 61 tokens), 10 seeds, ε ∈ {3, 8}, arms zero-shot, non-private, DP
tied/untied and DP LoRA tied/untied; 2 arms at a time with 1 torch thread each. At this scale DP-SGD cannot be
expected to move the model far from its starting point (the privacy noise scales with 1/(N·ε)); ``--full`` is the
paper-sized study, for a GPU.

Speed measures that change nothing in the maths: each arm runs with 1 torch thread (OMP_NUM_THREADS too); the GGUF
checkpoint is dequantised once into a float32 folder (``--no-cache`` to load the GGUF in every arm); dev.tsv is
validated from a length-sorted copy (``--no-sort-dev`` for the file's order), which halves padding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import git_info, machine_info
from bench.study import sst2
from bench.study.arm import install_stop_handlers, run_all
from bench.study.paired import paired_statistics, seeds_for_half_width
from bench.study.record import ROOT, machine_line, mean_std, plus_minus, relative, write_json
from bench.study.version import (
    STUDY_CODE_VERSION,
    config_digest,
    fingerprint,
    migrate_fingerprint,
    portable_command,
    study_code_version,
)

TIED, UNTIED, LORA = (f"configs/smollm2_sst2_{name}.yaml" for name in ("tied", "untied", "lora"))


@dataclass(frozen=True)
class Arm:
    """One arm of the study: a shipped config and the overrides that make it this arm."""

    label: str
    config: str
    private: bool = True
    trains: bool = True
    lora: bool = False
    overrides: tuple[str, ...] = ()


ARMS: dict[str, Arm] = {
    "zero_shot": Arm("zero-shot", TIED, private=False, trains=False),
    "non_private": Arm("non-private", TIED, private=False),
    "dp_tied": Arm("DP tied", TIED),
    "dp_untied": Arm("DP untied", UNTIED),
    "lora_tied": Arm("DP LoRA + tied emb.", LORA, lora=True),
    "lora_untied": Arm("DP LoRA + untied emb.", LORA, lora=True,
                       overrides=("--model.embeddings", "dplit.embeddings.UntiedEmbeddings")),
    "lora_frozen": Arm("DP LoRA, emb. frozen", LORA, lora=True, overrides=("--model.train_embeddings", "false")),
}
PAIRS = (("full fine-tuning", "dp_untied", "dp_tied"), ("LoRA + trained embedding", "lora_untied", "lora_tied"))
"""The untied − tied comparisons the table pairs by seed: (name, untied arm, tied arm)."""
GROUPS = (("dp_tied", "dp_untied"), ("lora_tied", "lora_untied", "lora_frozen"))
"""DP arms in priority order: every scale of a group runs before the next group."""
COLORS = {"zero_shot": "#999999", "non_private": "#4c72b0", "dp_tied": "#dd8452", "dp_untied": "#55a868",
          "lora_tied": "#c44e52", "lora_untied": "#8172b3", "lora_frozen": "#937860"}

GIT_PATHS = ("dplit", "configs", "bench/tying.py", "bench/study")
"""What the study's numbers depend on: uncommitted changes there are recorded."""
NOISE_TEXT = {
    "common": ("common random numbers: both arms of a seed s run DPStrategy(seed=s), so they draw the same Poisson "
               "batches and the same noise on every parameter they share (an untied head's noise comes after), "
               "which sharpens the paired difference; that noise is predictable, so these models are utility "
               "measurements, not private releases"),
    "independent": "noise and Poisson batches from OS entropy in every arm (a seed pairs nothing but the start)",
}
"""How the DP arms draw their batches and noise (``--noise``), as the table says it."""
RESOLUTION = 0.005
"""The untied − tied difference (accuracy, 0.5 points) the seed count is sized to resolve."""

PROFILES: dict[str, dict[str, Any]] = {
    # 2 shared CPU cores, 1 torch thread, measured per arm: ~10 s start-up, ~1 s to load the dequantised checkpoint,
    # ~72 s to validate the 872 dev rows (sorted by length, batches of 32), ~3.3 s per DP step at B = 8 (~2.8 s
    # non-private; the first DP step adds ~10 s for DPStrategy's ghost-clipping self-check); LoRA arms ~3 s per step.
    "default": {
        "train_examples": [160, 1000], "epochs": 1, "batch_size": 8, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 64,
        "eval_batch_size": 32, "max_grad_norm": 0.1, "physical_batch_size": 16, "epsilons": [3.0, 8.0],
        "seeds": list(range(10)), "eval_examples": None, "accelerator": "cpu", "precision": "32-true",
        "timeout": 3600.0, "threads": 1, "jobs": 2, "sweep_lrs": [1e-5, 3e-5, 1e-4, 3e-4], "holdout_rows": 500,
        "reference_seeds": 3,
        "arms": ["zero_shot", "non_private", "dp_tied", "dp_untied", "lora_tied", "lora_untied"],
    },
    "smoke": {
        "train_examples": [32], "epochs": 1, "batch_size": 8, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 64,
        "eval_batch_size": 32, "max_grad_norm": 0.1, "physical_batch_size": 8, "epsilons": [8.0], "seeds": [0],
        "eval_examples": 64, "accelerator": "cpu", "precision": "32-true", "timeout": 600.0, "threads": 1,
        "jobs": 1, "sweep_lrs": [1e-4, 3e-4], "holdout_rows": 64, "reference_seeds": 1, "arms": list(ARMS),
    },
    # Li et al. 2021's SST-2 recipe (the shipped configs' values): meant for a GPU.
    "full": {
        "train_examples": [None], "epochs": 3, "batch_size": 1000, "lr": 5e-4, "lora_lr": 2e-3, "max_length": 128,
        "eval_batch_size": 128, "max_grad_norm": 0.1, "physical_batch_size": 64, "epsilons": [3.0, 8.0],
        "seeds": [0, 1, 2], "eval_examples": None, "accelerator": "auto", "precision": "bf16-mixed",
        "timeout": 6 * 3600.0, "threads": 0, "jobs": 1, "sweep_lrs": [1e-5, 3e-5, 1e-4, 3e-4],
        "holdout_rows": 1000, "reference_seeds": 3, "arms": list(ARMS),
    },
}
NUMERIC_SETTINGS = ("epochs", "batch_size", "lr", "lora_lr", "max_length", "eval_batch_size", "eval_examples",
                    "max_grad_norm", "physical_batch_size", "accelerator", "precision", "sweep_lrs", "holdout_rows",
                    "noise")
"""The settings every row of one results.json shares (the grid's axes, arms × scales × ε × seeds, may grow)."""


# --------------------------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The study's arguments, with the profile's values (``--smoke``, default, ``--full``) where none is given."""
    parser = argparse.ArgumentParser(prog="python -m bench.tying", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--smoke", action="store_true", help="quick check: 32 train rows, 1 seed, ε=8, 64 dev rows")
    profile.add_argument("--full", action="store_true",
                         help="the paper's recipe: whole train set, B=1000, 3 epochs, lr 5e-4, C=0.1, max_length 128, "
                              "bf16-mixed on the best accelerator (a GPU)")
    parser.add_argument("--epsilons", nargs="+", type=float, help="target ε of the DP arms (default 3 8)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (seed_everything; default: the profile's, 0-9 by "
                                                             "default, 0 1 2 with --full)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="arms to run (default: the profile's)")
    parser.add_argument("--train-examples", nargs="+", type=int,
                        help="data scales: the first N rows of SST-2 train, one scale per N (0: all 67,349)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="expected logical batch (Poisson rate q = B/N under DP)")
    parser.add_argument("--lr", type=float, help="AdamW peak learning rate of DP full fine-tuning (linear decay to 0)")
    parser.add_argument("--lora-lr", type=float, help="AdamW peak learning rate of the LoRA arms (default 2e-3)")
    parser.add_argument("--sweep-lrs", nargs="*", type=float,
                        help="the non-private arm's candidate learning rates (none: it trains at --lr)")
    parser.add_argument("--holdout-rows", type=int,
                        help="the sweep validates on the last N rows of SST-2 train (held out; default 500)")
    parser.add_argument("--reference-seeds", type=int, help="the non-private arm runs on the first N seeds (default 3)")
    parser.add_argument("--noise", choices=("common", "independent"), default="common",
                        help="common (default): every DP arm of seed s runs with DPStrategy(seed=s), so the arms of a "
                             "pair draw the same Poisson batches and the same noise on the parameters they share "
                             "(common random numbers: a sharper paired difference; predictable noise, so the trained "
                             "models are measurements, not private releases); independent: OS-entropy noise per arm")
    parser.add_argument("--max-length", type=int, help="longest prompt in tokens (SST-2 dev: 61 with SmolLM2's tokenizer)")
    parser.add_argument("--eval-batch-size", type=int)
    parser.add_argument("--eval-examples", type=int, help="first N dev rows (default: all 872)")
    parser.add_argument("--max-grad-norm", type=float, help="DP clipping bound C")
    parser.add_argument("--physical-batch-size", type=int, help="DPStrategy.max_physical_batch_size")
    parser.add_argument("--accelerator", help="trainer.accelerator (default cpu; auto with --full)")
    parser.add_argument("--precision", help="trainer.precision (default 32-true; bf16-mixed with --full)")
    parser.add_argument("--timeout", type=float, help="seconds per arm before it is killed and reported as failed")
    parser.add_argument("--threads", type=int,
                        help="torch threads per arm (default 1 on CPU: steadier on a shared 2-core machine, where a "
                             "2-thread process stalls whenever another process holds a core; 0: torch's default)")
    parser.add_argument("--jobs", type=int, help="arms running at once (default 2 on CPU, 1 with --full)")
    parser.add_argument("--fresh", action="store_true", help="ignore the arms already in --out's results.json")
    sst2.add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results/tying, .../tying/full with --full, "
                             "bench/out/tying/smoke/results with --smoke)")
    parser.add_argument("--logs", type=Path, default=None, help="logs folder (default bench/out/tying, ignored)")
    parser.add_argument("--dry-run", action="store_true", help="print each arm's dplit command and exit")
    args = parser.parse_args(argv)
    name = "smoke" if args.smoke else "full" if args.full else "default"
    args.profile = name
    for key, value in PROFILES[name].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.train_examples = [n or None for n in dict.fromkeys(args.train_examples)]  # 0: all rows
    args.logs = args.logs or ROOT / "bench" / "out" / "tying" / name  # git-ignored
    default_out = {"default": ROOT / "bench" / "results" / "tying", "full": ROOT / "bench" / "results" / "tying" /
                   "full", "smoke": args.logs / "results"}[name]  # a smoke check's results stay out of git
    args.out = args.out or default_out
    for key in ("epochs", "batch_size", "max_length", "eval_batch_size", "physical_batch_size", "jobs",
                "reference_seeds"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be ≥ 1")
    for rows in args.train_examples:
        if rows is not None and (rows < 0 or args.batch_size > rows):
            parser.error(f"--batch-size {args.batch_size} exceeds --train-examples {rows}")
    return args


# --------------------------------------------------------------------------------------------------------------------
# The plan: every run in priority order, the sweep's choice, fingerprints


def run_name(run: dict[str, Any]) -> str:
    """A run's folder name: its scale, arm, ε and seed (or the sweep's learning rate)."""
    if run["arm"] == "zero_shot":
        return "zero_shot"
    scale = f"rows{run['rows'] or 'all'}"
    if run.get("sweep"):
        return f"{scale}-sweep-lr{run['lr']:g}"
    eps = f"-eps{run['epsilon']:g}" if run["epsilon"] is not None else ""
    return f"{scale}-{run['arm']}{eps}-seed{run['seed']}"


def _named(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**run, "name": run_name(run)} for run in runs]


def grid_runs(args: argparse.Namespace, arms: tuple[str, ...], rows: int | None) -> list[dict[str, Any]]:
    """The DP runs of ``arms`` at one scale, seed by seed (so a partial grid holds whole pairs).

    With common noise both arms of seed s run ``DPStrategy(seed=s)`` (``dp_seed``).
    """
    chosen = [arm for arm in arms if arm in args.arms]
    return _named([{"arm": arm, "epsilon": epsilon, "seed": seed, "rows": rows,
                    "dp_seed": seed if args.noise == "common" else None}
                   for seed in args.seeds for epsilon in args.epsilons for arm in chosen])


def sweep_runs(args: argparse.Namespace, rows: int | None) -> list[dict[str, Any]]:
    """The non-private learning-rate sweep at one scale: one seed, validated on held-out training rows."""
    return _named([{"arm": "non_private", "epsilon": None, "seed": args.seeds[0], "rows": rows, "lr": lr,
                    "sweep": True} for lr in args.sweep_lrs])


def reference_runs(args: argparse.Namespace, rows: int | None, lr: float) -> list[dict[str, Any]]:
    """The non-private arm at one scale, at the sweep's learning rate, on the first ``--reference-seeds`` seeds."""
    return _named([{"arm": "non_private", "epsilon": None, "seed": seed, "rows": rows, "lr": lr}
                   for seed in args.seeds[: args.reference_seeds]])


def chosen_lr(rows: list[dict[str, Any]], scale: int | None, candidates: list[float]) -> float | None:
    """The sweep's learning rate at ``scale``; ``None`` until every candidate has a result.

    The rate with the best held-out accuracy (ties: the smaller rate).
    """
    done = {r["lr"]: r["val_acc"] for r in rows if r.get("sweep") and r["rows"] == scale and r["status"] == "ok"}
    if not candidates or any(lr not in done for lr in candidates):
        return None
    return max(sorted(candidates), key=lambda lr: done[lr])


def model_identity(sources: dict[str, Any]) -> str:
    """The checkpoint, named without this machine's paths: the GGUF file's name, else the hub name or folder."""
    return Path(sources["gguf_source"]).name if sources.get("gguf_source") else str(sources["pretrained"])


def settings_key(args: argparse.Namespace, sources: dict[str, Any], code: str) -> dict[str, Any]:
    """What every row of one results.json shares: the code version, the model and the non-grid settings."""
    return {"code": code, "model": model_identity(sources), **{key: getattr(args, key) for key in NUMERIC_SETTINGS}}


def recorded_rows(earlier: dict[str, Any], key: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The finished rows of an earlier sitting's results with the same settings key, and how many were dropped."""
    rows = earlier.get("runs", [])
    same = earlier.get("settings_key") == key
    kept = [r for r in rows if same and r.get("status") == "ok" and r.get("fingerprint")]
    return kept, len(rows) - len(kept)


def migrate_record(record: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``record`` (a results.json) in the current format, and how many row fingerprints were migrated.

    Row fingerprints of format 1 become format 2 (:func:`bench.study.version.migrate_fingerprint`). A settings key
    without ``noise`` comes from before ``--noise`` existed, when every DP arm drew its noise and batches from OS
    entropy: ``independent`` (its rows record ``"noise": "os_entropy"``). Nothing else (no number) changes.
    """
    key = dict(record.get("settings_key") or {})
    if key and "noise" not in key:
        key["noise"] = "independent"
    runs, migrated = [], 0
    for row in record.get("runs", []):
        if row.get("fingerprint"):
            new = migrate_fingerprint(row["fingerprint"])
            migrated += new != row["fingerprint"]
            row = {**row, "fingerprint": new}
        runs.append(row)
    return {**record, "settings_key": key, "runs": runs}, migrated


def rerun_plan(record: dict[str, Any], argv: list[str], code: str = STUDY_CODE_VERSION) -> dict[str, list[str]]:
    """What ``python -m bench.tying ARGV`` would do with ``record`` as its results.json, at code version ``code``.

    The names of the recorded rows it keeps (``kept``) and drops (``dropped``), of the runs it plans and finds
    recorded (``skip``) and of those it would run (``run``).

    Nothing runs and no data is read: the arms' sources are the ones ``record`` names (the fingerprints leave their
    paths out). A complete grid rerun with the command that made it runs nothing.
    """
    args = parse_args(argv)
    record, _ = migrate_record(record)
    sources = record["sources"]
    holdout = None
    if "non_private" in args.arms and args.sweep_lrs:
        total = (record.get("holdout") or {}).get("train_rows_total") or sst2.TRAIN_ROWS
        holdout = {**sources, "data_dir": "<held-out>", "max_eval_examples": None, "train_rows_total": total}
    study = Study(args, sources, holdout, code)
    kept, _ = recorded_rows(record, settings_key(args, sources, code))
    recorded = {r["fingerprint"] for r in kept}
    planned = {"skip": [], "run": []}
    for chunk in plan(args, lambda rows: chosen_lr(kept, rows, args.sweep_lrs) if args.sweep_lrs else args.lr):
        for run in chunk:
            planned["skip" if study.fingerprint(run) in recorded else "run"].append(run["name"])
    kept_names = {r["name"] for r in kept}
    dropped = [r["name"] for r in record.get("runs", []) if r["name"] not in kept_names]
    return {"kept": sorted(kept_names), "dropped": sorted(dropped), **planned}


# --------------------------------------------------------------------------------------------------------------------
# The arms


def dplit_args(args: argparse.Namespace, sources: dict[str, Any], run: dict[str, Any], log_dir: Path) -> list[str]:
    """The ``dplit`` command line of one arm: its shipped SmolLM2 SST-2 config plus the study's overrides."""
    arm = ARMS[run["arm"]]
    command = ["fit" if arm.trains else "validate", "--config", arm.config, *sst2.source_overrides(sources)]
    callbacks = [{"class_path": "dplit.callbacks.ResourceMonitor"}, {"class_path": "bench.study.arm.StepTimer"}]
    lr = run.get("lr") or (args.lora_lr if arm.lora else args.lr)
    command += [
        "--seed_everything", str(run["seed"]),
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.precision", args.precision,
        "--trainer.max_epochs", str(args.epochs),
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
        # validation once, after training (the child calls trainer.validate), so the fit time is training only
        "--trainer.val_check_interval", "1.0", "--trainer.check_val_every_n_epoch", str(10**6),
        "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(log_dir),
        "--trainer.callbacks", json.dumps(callbacks),
        "--model.lr", repr(lr),
        "--data.batch_size", str(args.batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
        "--data.max_length", str(args.max_length), "--data.label_words", json.dumps(sst2.LABEL_WORDS),
        "--data.template", sst2.TEMPLATE, *arm.overrides,
    ]
    if run.get("rows") is not None and arm.trains:
        command += ["--data.max_train_examples", str(run["rows"])]
    if not arm.private:
        return command + ["--trainer.strategy", "auto", "--non_private", "true"]
    prefix = "--trainer.strategy.init_args."
    return command + [
        prefix + "target_epsilon", repr(float(run["epsilon"])), prefix + "max_grad_norm", repr(args.max_grad_norm),
        prefix + "clipping", "ghost", prefix + "max_physical_batch_size", str(args.physical_batch_size),
        *((prefix + "seed", str(run["dp_seed"])) if run.get("dp_seed") is not None else ()),
    ]


class Study:
    """The sources, the held-out slice and the code version one sitting runs its arms with.

    Args:
        args: the study's arguments (:func:`parse_args`).
        sources: where the model, tokenizer and SST-2 come from (``sst2.prepare``).
        holdout: the held-out slice the learning-rate sweep validates on (``None``: no sweep).
        code: the study code version (:func:`study_code_version`).
    """

    def __init__(self, args: argparse.Namespace, sources: dict[str, Any], holdout: dict[str, Any] | None,
                 code: str) -> None:
        self.args, self.sources, self.holdout, self.code = args, sources, holdout, code
        self.configs = {arm.config: config_digest(ROOT / arm.config) for arm in ARMS.values()}
        model = model_identity(sources) if sources.get("gguf_source") else "<model>"  # a folder's path is this machine's
        self.replacements = {str(sources["pretrained"]): model, str(sources["data_dir"]): "<sst2>"}
        if holdout is not None:
            self.replacements[str(holdout["data_dir"])] = "<sst2 held-out>"

    def command(self, run: dict[str, Any], log_dir: Path) -> list[str]:
        """The dplit command line of ``run`` (a sweep run trains clear of the held-out rows and validates on them)."""
        if not run.get("sweep"):
            return dplit_args(self.args, self.sources, run, log_dir)
        assert self.holdout is not None
        rows = sst2.sweep_train_rows(run["rows"], self.holdout, self.args.holdout_rows)
        return dplit_args(self.args, self.holdout, {**run, "rows": rows}, log_dir)

    def fingerprint(self, run: dict[str, Any]) -> str:
        """The fingerprint of ``run``: the code version, its config's digest and its portable command.

        Its log folder and the machine's paths are left out (:mod:`bench.study.version`).
        """
        folder = self.args.logs / run["name"]
        command = portable_command(self.command(run, folder), {**self.replacements, str(folder): "<logs>"})
        return fingerprint(self.code, self.configs[ARMS[run["arm"]].config], command)


# --------------------------------------------------------------------------------------------------------------------
# Summary


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (scale, arm, ε): accuracy mean ± std over seeds and costs; untied − tied paired by seed; the sweep."""
    trained = [r for r in rows if not r.get("sweep")]
    ok = [r for r in trained if r.get("status") == "ok"]
    keys = list(dict.fromkeys((r.get("rows"), r["arm"], r["epsilon"]) for r in trained))
    arms = []
    for scale, arm, epsilon in keys:
        group = [r for r in ok if (r.get("rows"), r["arm"], r["epsilon"]) == (scale, arm, epsilon)]
        failed = [r for r in trained if (r.get("rows"), r["arm"], r["epsilon"]) == (scale, arm, epsilon)
                  and r.get("status") != "ok"]
        arms.append({
            "rows": scale, "arm": arm, "target_epsilon": epsilon, "seeds": [r["seed"] for r in group],
            "failed": len(failed), "lr": sorted({r["lr"] for r in group if r.get("lr")}) or None,
            **{key: mean_std([r.get(key) for r in group]) for key in (
                "val_acc", "epsilon_spent", "steps", "peak_rss_mb", "train_peak_mb", "step_time_s",
                "noise_multiplier")},
        })
    scales = list(dict.fromkeys(r.get("rows") for r in ok))
    differences = [d for pair in PAIRS for scale in scales for d in paired(ok, scale, *pair)]
    return {"arms": arms, "untied_minus_tied": differences, "sweep": sweep_summary(rows)}


def paired(ok: list[dict[str, Any]], scale: int | None, name: str, untied_arm: str,
           tied_arm: str) -> list[dict[str, Any]]:
    """Per ε at one scale: untied − tied validation accuracy over the seeds both arms finished, with its statistics."""
    here = [r for r in ok if r.get("rows") == scale and r["arm"] in (untied_arm, tied_arm)]
    differences = []
    for epsilon in sorted({r["epsilon"] for r in here}):
        tied = {r["seed"]: r["val_acc"] for r in here if r["arm"] == tied_arm and r["epsilon"] == epsilon}
        untied = {r["seed"]: r["val_acc"] for r in here if r["arm"] == untied_arm and r["epsilon"] == epsilon}
        seeds = sorted(set(tied) & set(untied))
        if not seeds:
            continue
        values = [untied[s] - tied[s] for s in seeds]
        statistics = paired_statistics(values)
        needed = seeds_for_half_width(statistics["std"], RESOLUTION) if statistics["std"] else None
        differences.append({"comparison": name, "rows": scale, "target_epsilon": epsilon, "seeds": seeds,
                            "per_seed": dict(zip(map(str, seeds), values, strict=True)), **statistics,
                            "seeds_for_half_width": {"half_width": RESOLUTION, "seeds": needed}})
    return differences


def sweep_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scale: each candidate learning rate's held-out accuracy and the one chosen."""
    sweeps = [r for r in rows if r.get("sweep") and r.get("status") == "ok"]
    summary = []
    for scale in dict.fromkeys(r["rows"] for r in sweeps):
        here = sorted((r for r in sweeps if r["rows"] == scale), key=lambda r: r["lr"])
        candidates = [r["lr"] for r in here]
        summary.append({"rows": scale, "held_out_rows": here[0]["val_examples"],
                        "train_rows": here[0]["train_examples"],
                        "held_out_acc": {f"{r['lr']:g}": r["val_acc"] for r in here},
                        "chosen_lr": chosen_lr(here, scale, candidates)})
    return summary


# --------------------------------------------------------------------------------------------------------------------
# Table and chart


def _arm_label(arm: str, epsilon: float | None) -> str:
    return ARMS[arm].label + (f", ε = {epsilon:g}" if epsilon is not None else "")


def _rows_text(rows: int | None) -> str:
    return "all" if rows is None else f"{rows:,}"


def _points(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.2f}"


def sittings_line(results: dict[str, Any]) -> str:
    """How long the study took, sitting by sitting, and on what."""
    parts = []
    for s in results.get("sittings", []):
        m = s["machine"]
        where = f"{m['cpu_model']}, {m['logical_cpus']} logical CPUs" + (f", GPU {m['gpu']}" if m.get("gpu") else "")
        parts.append(f"{s['started'][:16]}: {s['wall_s'] / 60:.0f} min, {s['arms_run']} arm(s), {s['jobs']} at a time "
                     f"with {s['threads'] or 'default'} torch thread(s) each, on {where}")
    total = sum(s["wall_s"] for s in results.get("sittings", []))
    arm_hours = sum(r.get("process_wall_s", 0.0) for r in results["runs"]) / 3600
    return (f"{len(parts)} sitting(s), {total / 3600:.1f} h of wall time, {arm_hours:.1f} arm-hours: "
            + "; ".join(parts) + ".")


def render_table(results: dict[str, Any]) -> str:
    """``table.md``: the settings in words, machine and time, paired untied − tied differences, every arm and run."""
    s, subsets = results["settings"], results["training_subsets"]
    scales = ", ".join(f"{sub['rule']} (positive share {sub.get('positive_share', float('nan')):.2f})"
                       for sub in subsets)
    dev = subsets[0]
    lines = [
        "# Tied vs untied embeddings under DP-SGD: SmolLM2-135M-Instruct on SST-2",
        "",
        (f"Profile `{s['profile']}`: data scales {scales}; validation on {dev['dev_rule']} ({dev['dev_rows']} rows); "
         f"expected batch {s['batch_size']}, {s['epochs']} epoch(s), AdamW lr {s['lr']:g} (LoRA arms "
         f"{s['lora_lr']:g}) with linear decay, max_length {s['max_length']}, label words "
         f"{json.dumps(list(sst2.LABEL_WORDS.values()))}, seeds {s['seeds']}; DP: ghost clipping, C = "
         f"{s['max_grad_norm']:g}, σ calibrated by `target_epsilon` over the planned steps, δ = N^-1.1, PRV accountant, "
         f"{NOISE_TEXT[s.get('noise', 'independent')]}; "
         f"non-private reference at the learning rate its sweep chose (below), seeds {s['seeds'][:s['reference_seeds']]}; "
         f"{s['precision']} on {s['accelerator']}. Model: {sst2.model_line(results['sources'])}. Validation order: "
         f"{dev.get('dev_order')}."),
        "",
        machine_line(results) + ".",
        "",
        "Time: " + sittings_line(results),
        "",
        (f"## Untied − tied, paired by seed (dev accuracy, percentage points; {int(100 * 0.95)}% level)"),
        "",
        ("| comparison | train rows | target ε | seeds | mean | 95% CI (paired t) | sign test +/−/0, p | "
         "seeds for ±0.5 | verdict |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in results["summary"]["untied_minus_tied"]:
        ci = "–" if d["ci"] is None else f"[{_points(d['ci'][0])}, {_points(d['ci'][1])}]"
        sign = d["sign_test"]
        needed = d["seeds_for_half_width"]["seeds"]
        lines.append(f"| {d['comparison']} | {_rows_text(d['rows'])} | {d['target_epsilon']:g} | {d['n']} | "
                     f"{_points(d['mean'])} | {ci} | {sign['positive']}/{sign['negative']}/{sign['ties']}, "
                     f"{sign['p']:.3f} | {needed or '–'} | {d['verdict']} |")
    lines += [
        "",
        ("Verdict: a direction only when the paired-t 95% interval excludes 0 and the exact two-sided sign test "
         "(ties dropped) has p < 0.05 on the same side; each cell is tested on its own (no correction across cells). "
         "Seeds for ±0.5: the seeds a paired-t 95% interval needs to have a half-width of 0.5 points at the measured "
         "paired standard deviation."),
        "",
        "Per seed (untied − tied, points):",
        "",
    ]
    for d in results["summary"]["untied_minus_tied"]:
        per_seed = ", ".join(f"{k}: {v * 100:+.1f}" for k, v in d["per_seed"].items())
        lines.append(f"* {d['comparison']}, {_rows_text(d['rows'])} rows, ε = {d['target_epsilon']:g}: {per_seed}")
    lines += ["", "## Every arm", "",
              "| arm | train rows | ε spent | val acc % (mean ± std) | seeds | steps | σ | step time s | peak RSS MB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a in results["summary"]["arms"]:
        if a["arm"] == "non_private":
            eps_text = "∞" + (f" (lr {', '.join(f'{lr:g}' for lr in a['lr'])})" if a.get("lr") else "")
        elif a["arm"] == "zero_shot":
            eps_text = "0 (no training)"
        else:
            eps_text = plus_minus(a["epsilon_spent"], digits=2)
        lines.append(
            f"| {_arm_label(a['arm'], a['target_epsilon'])} | {_rows_text(a['rows']) if a['arm'] != 'zero_shot' else '0'}"
            f" | {eps_text} | {plus_minus(a['val_acc'], 100)} | {a['val_acc']['n']}"
            + (f" (+{a['failed']} failed)" if a["failed"] else "") + " | "
            f"{plus_minus(a['steps'], digits=0)} | {plus_minus(a['noise_multiplier'], digits=3)} | "
            f"{plus_minus(a['step_time_s'], digits=2)} | {plus_minus(a['peak_rss_mb'], digits=0)} |"
        )
    lines += ["", "## The non-private reference's learning rate", ""]
    for sweep in results["summary"]["sweep"]:
        accs = ", ".join(f"lr {lr}: {acc * 100:.1f}%" for lr, acc in sweep["held_out_acc"].items())
        chosen = "–" if sweep["chosen_lr"] is None else f"{sweep['chosen_lr']:g}"
        lines.append(f"* {_rows_text(sweep['rows'])} rows: trained on the first {sweep['train_rows']:,} rows, "
                     f"seed {s['seeds'][0]}, validated on {sweep['held_out_rows']} held-out TRAINING rows (the last "
                     f"rows of train.tsv, never dev): {accs}; chosen {chosen}.")
    if not results["summary"]["sweep"]:
        lines.append("No sweep ran (the non-private arm trains at --lr).")
    lines += [
        "",
        ("Step time: mean wall time of one optimizer step (batch start to batch end, DP clipping, noise and AdamW "
         "included), from a timing callback. Peak RSS: the arm's whole process (model loading, training and "
         "validation), `resource.getrusage`. ε spent: the DPStrategy accountant's `epsilon()` after training. "
         "std: sample standard deviation over seeds. Arms ran in their own processes, several at a time; times are "
         "indicative."),
        "",
        "## Every run",
        "",
        "| run | status | val acc % | ε spent | steps | step time s | train s | val s | process s | CPU s | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | failed: {r.get('message', '')[:120]} | | | | | | | | | |")
            continue

        def num(key: str, digits: int = 1, scale: float = 1.0, r: dict[str, Any] = r) -> str:
            value = r.get(key)
            return "–" if value is None else f"{value * scale:.{digits}f}"

        lines.append(f"| {r['name']} | ok | {num('val_acc', 1, 100)} | {num('epsilon_spent', 3)} | {r['steps']} | "
                     f"{num('step_time_s', 2)} | {num('train_wall_s', 0)} | {num('val_wall_s', 0)} | "
                     f"{num('process_wall_s', 0)} | {num('cpu_s', 0)} | {num('peak_rss_mb', 0)} |")
    lines += ["", "Commands: " + "; ".join(f"`{x['command']}`" for x in results.get("sittings", [])), ""]
    return "\n".join(lines)


def render_chart(results: dict[str, Any], path: Path) -> bool:
    """Untied − tied per seed and its 95% interval, per comparison, scale and ε (the study's answer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')", flush=True)
        return False
    cells = results["summary"]["untied_minus_tied"]
    if not cells:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cells) + 2), 4.5))
    for i, d in enumerate(cells):
        values = [v * 100 for v in d["per_seed"].values()]
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
        if d["ci"] is not None:
            low, high = d["ci"][0] * 100, d["ci"][1] * 100
            ax.errorbar(i, d["mean"] * 100, yerr=[[d["mean"] * 100 - low], [high - d["mean"] * 100]], fmt="o",
                        color=COLORS[PAIRS[0][1] if d["comparison"] == PAIRS[0][0] else PAIRS[1][1]], capsize=5)
    ax.axhline(0, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([d["comparison"].replace(" + ", "+\n") + f"\n{_rows_text(d['rows'])} rows, "
                        f"ε={d['target_epsilon']:g}" for d in cells], fontsize=7)
    ax.set_ylabel("untied − tied, SST-2 dev accuracy points")
    ax.set_title("SmolLM2-135M-Instruct under DP-SGD: untied − tied per seed (dots), mean and paired-t 95% CI",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """Summarise the runs and write results.json, table.md and chart.png into ``out``."""
    results["summary"] = summarize(results["runs"])
    write_json(results, out / "results.json")
    (out / "table.md").write_text(render_table(results))
    render_chart(results, out / "chart.png")


# --------------------------------------------------------------------------------------------------------------------
# The sitting


def new_results(args: argparse.Namespace, argv: list[str], sources: dict[str, Any], key: dict[str, Any],
                kept: list[dict[str, Any]], earlier: dict[str, Any] | None,
                holdout: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study's record: earlier sittings' rows (same settings key) and this sitting's settings."""
    sitting = {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               "command": "python -m bench.tying " + shlex.join(argv), "machine": machine_info(),
               "git": git_info(*GIT_PATHS), "jobs": args.jobs, "threads": args.threads, "wall_s": 0.0, "arms_run": 0}
    sittings = (earlier or {}).get("sittings", []) if kept else []
    return {
        "created": sittings[0]["started"] if sittings else sitting["started"],
        "command": sitting["command"], "machine": sitting["machine"], "git": sitting["git"],
        "settings_key": key,
        "sources": {k: (str(v) if isinstance(v, Path) else v) for k, v in sources.items()},
        "holdout": {"train_rows_total": holdout["train_rows_total"]} if holdout else None,
        "settings": {k: getattr(args, k) for k in (
            "profile", "arms", "epsilons", "seeds", "train_examples", "epochs", "batch_size", "lr", "lora_lr",
            "sweep_lrs", "holdout_rows", "reference_seeds", "noise", "max_length", "eval_batch_size", "eval_examples",
            "max_grad_norm", "physical_batch_size", "accelerator", "precision", "timeout", "threads", "jobs",
            "no_cache", "no_sort_dev")} | {"label_words": sst2.LABEL_WORDS,
                                           "configs": {name: arm.config for name, arm in ARMS.items()}},
        "training_subsets": [sst2.subset_description(args, sources, rows) for rows in args.train_examples],
        "runs": kept,
        "sittings": [*sittings, sitting],
        "wall_s": sum(s["wall_s"] for s in sittings),
        "complete": False,
    }


def plan(args: argparse.Namespace, reference_lr: Callable[[int | None], float | None]) -> Iterator[list[dict[str, Any]]]:
    """Every run in priority order, in chunks: a chunk ends where the next needs its results (a sweep's choice).

    Zero-shot, then per group of :data:`GROUPS` and per scale its DP grid; after full fine-tuning at a scale, its
    learning-rate sweep, then (in the next chunk) the non-private reference at ``reference_lr(scale)``, left out
    while that is ``None``.
    """
    chunk = _named([{"arm": "zero_shot", "epsilon": None, "seed": args.seeds[0], "rows": None}]) \
        if "zero_shot" in args.arms else []
    for index, group in enumerate(GROUPS):
        for rows in args.train_examples:
            chunk += grid_runs(args, group, rows)
            if index == 0 and "non_private" in args.arms:
                chunk += sweep_runs(args, rows)
                yield chunk
                lr = reference_lr(rows)
                if lr is None:
                    print(f"the sweep at {_rows_text(rows)} rows is incomplete: no non-private reference", flush=True)
                chunk = reference_runs(args, rows, lr) if lr is not None else []
    yield chunk


def run_study(args: argparse.Namespace, study: Study, results: dict[str, Any]) -> bool:
    """Run every arm not yet recorded, in priority order; whether the whole grid is recorded at the end."""
    sitting = results["sittings"][-1]
    wall_before = results["wall_s"]

    def write(done: dict[str, Any]) -> None:
        sitting["wall_s"] = done["wall_s"] - wall_before
        sitting["arms_run"] = sum(r.get("sitting") == sitting["started"] for r in done["runs"])
        write_outputs(done, args.out)

    def reference_lr(rows: int | None) -> float | None:
        return chosen_lr(results["runs"], rows, args.sweep_lrs) if args.sweep_lrs else args.lr

    def recorded() -> set[str]:
        return {r["fingerprint"] for r in results["runs"] if r.get("status") == "ok"}

    planned: list[str] = []
    for chunk in plan(args, reference_lr):
        runs = [{**run, "fingerprint": study.fingerprint(run), "sitting": sitting["started"]} for run in chunk]
        planned += [run["fingerprint"] for run in runs]
        todo = [run for run in runs if run["fingerprint"] not in recorded()]
        if len(todo) < len(runs):
            print(f"{len(runs) - len(todo)} of {len(runs)} runs already recorded with the same settings and code: "
                  "skipped", flush=True)
        run_all(todo, results, command=study.command, logs=args.logs, threads=args.threads, timeout=args.timeout,
                write=write, jobs=args.jobs)
    references = "non_private" not in args.arms or all(reference_lr(rows) is not None for rows in args.train_examples)
    return references and set(planned) <= recorded()


def dry_run(args: argparse.Namespace, study: Study) -> None:
    """Print every arm's dplit command (the non-private reference at --lr: the sweep chooses its rate)."""
    print("# (dry run: without the dequantised checkpoint folder and the sorted dev copy a real run prepares)")
    for chunk in plan(args, lambda rows: args.lr):
        for run in chunk:
            print(f"# {run['name']}\ndplit {shlex.join(study.command(run, args.logs / run['name']))}")


def main(argv: list[str] | None = None) -> None:
    """Run one sitting of the study: every planned arm not already recorded with the same fingerprint.

    Earlier rows recorded with other settings or code are dropped (saying how many); ``--dry-run`` only prints the
    plan. The results are written after every arm, then the table is printed.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    install_stop_handlers()
    sources = sst2.prepare(args)
    holdout = sst2.prepare_holdout(args, sources) if "non_private" in args.arms and args.sweep_lrs else None
    code = study_code_version()
    study = Study(args, sources, holdout, code)
    if args.dry_run:
        dry_run(args, study)
        return
    key = settings_key(args, sources, code)
    path = args.out / "results.json"
    earlier = json.loads(path.read_text()) if path.is_file() and not args.fresh else None
    if earlier:
        earlier, migrated = migrate_record(earlier)
        if migrated:
            print(f"{relative(path)}: {migrated} fingerprint(s) of an older format read as format 2", flush=True)
    kept, dropped = recorded_rows(earlier, key) if earlier else ([], 0)
    if dropped:
        print(f"{relative(path)}: {dropped} earlier row(s) dropped (failed, or other settings or code: "
              f"{'same' if earlier and earlier.get('settings_key') == key else 'different'} settings key; this "
              f"code: {code})", flush=True)
    results = new_results(args, argv, sources, key, kept, earlier, holdout)
    print(f"profile {args.profile}; scales {[_rows_text(r) for r in args.train_examples]}; {len(kept)} arms already "
          f"recorded; {args.jobs} at a time; out {relative(args.out)}", flush=True)
    results["complete"] = run_study(args, study, results)
    if git_info(*GIT_PATHS) != results["git"]:
        results["git"]["changed_during_run"] = git_info(*GIT_PATHS)
    write_outputs(results, args.out)
    print((args.out / "table.md").read_text())
    print(f"wrote {relative(args.out / 'results.json')}, table.md, chart.png; this sitting "
          f"{results['sittings'][-1]['wall_s'] / 60:.1f} min; grid {'complete' if results['complete'] else 'NOT complete'}",
          flush=True)


if __name__ == "__main__":
    main()
