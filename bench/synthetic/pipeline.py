"""One pipeline (DP LM → export → generate → classifier on the synthetic rows) and the classifiers beside it."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from bench.study.arm import run_arm, run_process
from bench.synthetic.commands import classifier_args, dplit_command, generate_args, generation_device, lm_fit_args
from bench.synthetic.files import write_synthetic_tsv
from bench.synthetic.statistics import describe_synthetic


def run_pipeline(args: argparse.Namespace, sources: dict[str, Any], files: dict[str, Path], epsilon: float | None,
                 seed: int) -> dict[str, Any]:
    """DP LM → export → generate → non-private classifier on the synthetic rows: one row of the table.

    ``epsilon=None`` is the control: the same generation from the pretrained model itself (no private row is read),
    which shows what the DP fine-tuning adds to the instruct model's own reviews.
    """
    arm = "synthetic" if epsilon is not None else "synthetic_pretrained"
    name = f"synthetic-eps{epsilon:g}-seed{seed}" if epsilon is not None else f"synthetic-pretrained-seed{seed}"
    folder = args.logs / name
    row: dict[str, Any] = {"arm": arm, "epsilon": epsilon, "seed": seed, "name": name}
    started = time.perf_counter()
    lm_folder, export, samples = folder / "lm", folder / "export", folder / "synthetic.jsonl"
    shutil.rmtree(lm_folder, ignore_errors=True)  # an earlier study's checkpoint is never the one exported
    lm_folder.mkdir(parents=True)
    model = export if epsilon is not None else Path(sources["pretrained"])
    stages = [("generate", lambda: generate_args(args, model, files["prompts"], samples, seed))]
    if epsilon is not None:
        stages[:0] = [
            ("lm_fit", lambda: lm_fit_args(args, sources, files, epsilon, seed, lm_folder)),
            ("export", lambda: ["export", "--ckpt_path", str(_last_checkpoint(lm_folder)), "--output_dir",
                                str(export), "--overwrite"]),
        ]
    for stage, argv in stages:
        stage_started = time.perf_counter()
        problem = _run_dplit(args, argv(), folder / f"{stage}.log")
        row[f"{stage}_wall_s"] = time.perf_counter() - stage_started
        if problem:
            return {**row, "status": "failed", "message": f"{stage}: {problem}"}
    if epsilon is not None:
        card = json.loads((export / "dp_guarantee.json").read_text())
        if not card.get("differentially_private") or card.get("epsilon") is None:
            return {**row, "status": "failed", "message": f"export: the LM is not DP ({card.get('reason')})"}
        row["lm"] = {key: card.get(key) for key in ("differentially_private", "epsilon", "delta", "noise_multiplier",
                                                    "max_grad_norm", "expected_batch_size", "sample_rate", "steps",
                                                    "dataset_size", "clipping", "tied_norm")}
    generated = [json.loads(line) for line in samples.read_text().splitlines()]
    row["generation_device"] = generation_device(args)
    row["synthetic"] = write_synthetic_tsv(generated, folder / "data", Path(sources["data_dir"]) / "dev.tsv")
    kept = [" ".join(sample["text"].split()) for sample in generated if sample["text"].strip()]
    row["synthetic"].update(describe_synthetic(kept, files["private_texts"], files["held_out_texts"]))
    classifier = run_arm(name, classifier_args(args, sources, "non_private", None, seed, folder / "classifier",
                                               synthetic=folder / "data"),
                         folder / "classifier", threads=args.threads, timeout=args.timeout)
    row["classifier"] = {key: classifier.get(key) for key in ("status", "message", "val_acc", "val_loss", "steps",
                                                             "train_examples", "step_time_s", "process_wall_s", "log")}
    row["pipeline_wall_s"] = time.perf_counter() - started
    if classifier.get("status") != "ok":
        return {**row, "status": "failed", "message": f"classifier: {classifier.get('message')}"}
    spent = row["lm"]["epsilon"] if epsilon is not None else 0.0
    return {**row, "status": "ok", "val_acc": classifier["val_acc"], "epsilon_spent": spent}


def _run_dplit(args: argparse.Namespace, argv: list[str], log: Path) -> str | None:
    return run_process(dplit_command(argv), log, header="dplit " + shlex.join(argv), threads=args.threads,
                       timeout=args.timeout)


def _last_checkpoint(folder: Path) -> Path:
    """The newest ``last.ckpt`` the LM run wrote (a path that does not exist when there is none: export refuses it)."""
    found = sorted(folder.glob("**/checkpoints/last.ckpt"), key=lambda path: path.stat().st_mtime)
    return found[-1] if found else folder / "checkpoints" / "last.ckpt"


def run_classifier(args: argparse.Namespace, sources: dict[str, Any], arm: str, epsilon: float | None,
                   seed: int) -> dict[str, Any]:
    """The zero-shot or the directly trained DP classifier, as in the tying study."""
    name = "zero_shot" if arm == "zero_shot" else f"dp_classifier-eps{epsilon:g}-seed{seed}"
    folder = args.logs / name
    row = run_arm(name, classifier_args(args, sources, arm, epsilon, seed, folder), folder, threads=args.threads,
                  timeout=args.timeout)
    return {**row, "arm": "zero_shot" if arm == "zero_shot" else "dp_classifier", "epsilon": epsilon, "seed": seed,
            "name": name}
