"""DP synthetic data, end to end: from private SST-2 rows to accuracy on the real SST-2 dev set.

Private SST-2 rows → a DP language model → labelled synthetic reviews → a NON-private classifier trained on the
synthetic rows only → accuracy on the real SST-2 dev set.

    python -m bench.synthetic --smoke     # 32 private rows, 1 ε, 64 dev rows: a few minutes (a check)
    python -m bench.synthetic             # default CPU profile (see PROFILES): under an hour on 2 CPU cores
    python -m bench.synthetic --full      # all 67,349 rows, LM batch and lr of configs/smollm2_lm.yaml: a GPU
    python -m bench.synthetic --hub --data-dir DIR   # weights and tokenizer from the hub, SST-2 TSVs from DIR

For each ε and seed the pipeline runs dplit's own commands, each in its own process:

1. ``dplit lm fit --config configs/smollm2_lm.yaml``: SmolLM2-135M-Instruct (tied) fine-tuned with DPStrategy at
   ``target_epsilon`` = ε on the private rows as instructions: prompt = the row's label control prompt
   (:data:`CONTROL_PROMPTS`, public strings), response = the review (the loss is on the response only);
2. ``dplit export``: the checkpoint as a Hugging Face folder with its card (the ε the table shows is the card's);
3. ``dplit lm generate``: ``--synthetic-per-label`` samples per control prompt, so every synthetic row has a label;
4. ``dplit fit --non_private true`` on the synthetic rows only (post-processing: no privacy is spent), with the
   shipped ``configs/smollm2_sst2_tied.yaml`` classifier, validated on the real dev split.

Beside it, with the same rows, ε and seed: the DP classifier trained directly on the private rows (the tying study's
``dp_tied`` arm, :mod:`bench.tying`), the zero-shot classifier, and the control: steps 3-4 from the pretrained
model itself (no private row read), which shows what the DP fine-tuning added. The synthetic set is also described: its
size and label balance, distinct-1/2/3 (distinct n-grams over all n-grams, lower-cased words), and the share of its
8-grams found verbatim in the private training rows, beside the same share for real held-out SST-2 rows (what
unrelated text of the same kind shares by chance), and the share of synthetic rows that repeat a private row whole
(memorisation; the control prompts are not part of any sample). Words are lower-cased and split as SST-2 is
(punctuation and clitics such as "n't" and "'s" apart), so the fine-tuned LM's SST-2-like text and the pretrained
model's ordinary English are counted alike.

Everything reads only the first ``--train-examples`` rows of SST-2's train.tsv (the private set); the next
``--lm-val-examples`` rows are the LM's validation file (a perplexity it logs, never used to choose anything; with the
whole split private, as in ``--full``, its last rows, so then only a training-fit monitor); the dev split is only
the final evaluation. The pipeline reads SST-2 from local TSVs (``$DPLIT_DATA_DIR``, ``--data-root`` or
``--data-dir``); the pretrained control needs a local model folder (it is left out, saying why, otherwise). ``results.json``, ``table.md`` go to ``--out`` (default
``bench/results/synthetic/``), logs, checkpoints, exports and synthetic sets to ``--logs`` (git-ignored).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import tying
from bench.machine import git_info, machine_info
from bench.study import sst2
from bench.study.arm import install_stop_handlers, run_arm, run_process
from bench.study.record import ROOT, machine_line, mean_std, plus_minus, relative, write_json

LM_CONFIG = "configs/smollm2_lm.yaml"
CONTROL_PROMPTS = {"0": "Write a negative movie review:\n", "1": "Write a positive movie review:\n"}
"""The public control string of each SST-2 label: the LM's prompt in training and in generation."""
OVERLAP_N = 8
GIT_PATHS = ("dplit", "configs", "bench/synthetic.py", "bench/tying.py", "bench/study")

PROFILES: dict[str, dict[str, Any]] = {
    # 2 shared CPU cores, 1 torch thread per process: 20 DP steps of each DP model per ε, 320 synthetic rows.
    "default": {
        "train_examples": 320, "lm_val_examples": 64, "epsilons": [3.0, 8.0], "seeds": [0],
        "epochs": 1, "batch_size": 16, "lr": 5e-4, "max_grad_norm": 0.1,
        "lm_epochs": 1, "lm_batch_size": 16, "lm_lr": 1e-4, "lm_max_grad_norm": 1.0, "lm_max_length": 96,
        "synthetic_per_label": 160, "max_new_tokens": 48, "temperature": 1.0, "top_p": 0.9, "generate_batch_size": 16,
        "synthetic_epochs": 1, "synthetic_batch_size": 16, "synthetic_lr": 5e-5,
        "max_length": 64, "eval_batch_size": 32, "physical_batch_size": 16, "eval_examples": None,
        "accelerator": "cpu", "precision": "32-true", "timeout": 1800.0, "threads": 1,
    },
    "smoke": {
        "train_examples": 32, "lm_val_examples": 16, "epsilons": [8.0], "seeds": [0],
        "epochs": 1, "batch_size": 8, "lr": 5e-4, "max_grad_norm": 0.1,
        "lm_epochs": 1, "lm_batch_size": 8, "lm_lr": 1e-4, "lm_max_grad_norm": 1.0, "lm_max_length": 96,
        "synthetic_per_label": 8, "max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "generate_batch_size": 8,
        "synthetic_epochs": 1, "synthetic_batch_size": 8, "synthetic_lr": 5e-5,
        "max_length": 64, "eval_batch_size": 32, "physical_batch_size": 8, "eval_examples": 64,
        "accelerator": "cpu", "precision": "32-true", "timeout": 900.0, "threads": 1,
    },
    # The whole train split; the LM with configs/smollm2_lm.yaml's batch and learning rate, 3 epochs. For a GPU.
    "full": {
        "train_examples": None, "lm_val_examples": 64, "epsilons": [3.0, 8.0], "seeds": [0, 1, 2],
        "epochs": 3, "batch_size": 1000, "lr": 5e-4, "max_grad_norm": 0.1,
        "lm_epochs": 3, "lm_batch_size": 256, "lm_lr": 2e-4, "lm_max_grad_norm": 1.0, "lm_max_length": 128,
        "synthetic_per_label": 5000, "max_new_tokens": 64, "temperature": 1.0, "top_p": 0.9,
        "generate_batch_size": 128, "synthetic_epochs": 3, "synthetic_batch_size": 32, "synthetic_lr": 5e-5,
        "max_length": 128, "eval_batch_size": 128, "physical_batch_size": 64, "eval_examples": None,
        "accelerator": "auto", "precision": "bf16-mixed", "timeout": 12 * 3600.0, "threads": 0,
    },
}


# --------------------------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The pipeline's arguments, with the profile's values (``--smoke``, default, ``--full``) where none is given."""
    parser = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--smoke", action="store_true", help="quick check: 32 private rows, ε=8, 64 dev rows")
    profile.add_argument("--full", action="store_true", help="the whole train split, for a GPU")
    parser.add_argument("--epsilons", nargs="+", type=float, help="target ε of the DP LM and DP classifier")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (training and sampling)")
    parser.add_argument("--train-examples", type=int, help="the private set: first N rows of SST-2 train (0: all)")
    parser.add_argument("--lm-val-examples", type=int, help="rows after the private set: the LM's validation file")
    group = parser.add_argument_group("the DP classifier trained on the private rows (the tying study's dp_tied arm)")
    group.add_argument("--epochs", type=int)
    group.add_argument("--batch-size", type=int, help="expected logical batch")
    group.add_argument("--lr", type=float)
    group.add_argument("--max-grad-norm", type=float, help="C")
    group = parser.add_argument_group("the DP language model (dplit lm fit, configs/smollm2_lm.yaml)")
    group.add_argument("--lm-epochs", type=int)
    group.add_argument("--lm-batch-size", type=int, help="expected logical batch")
    group.add_argument("--lm-lr", type=float)
    group.add_argument("--lm-max-grad-norm", type=float, help="C (the example's summed token loss)")
    group.add_argument("--lm-max-length", type=int, help="prompt + review tokens (longer rows are cut at the end)")
    group = parser.add_argument_group("generation (dplit lm generate)")
    group.add_argument("--synthetic-per-label", type=int, help="samples per control prompt")
    group.add_argument("--max-new-tokens", type=int)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--generate-batch-size", type=int)
    group = parser.add_argument_group("the non-private classifier trained on the synthetic rows")
    group.add_argument("--synthetic-epochs", type=int)
    group.add_argument("--synthetic-batch-size", type=int)
    group.add_argument("--synthetic-lr", type=float)
    group = parser.add_argument_group("shared")
    group.add_argument("--max-length", type=int, help="classifier prompt length in tokens")
    group.add_argument("--eval-batch-size", type=int)
    group.add_argument("--eval-examples", type=int, help="first N dev rows (default: all 872)")
    group.add_argument("--physical-batch-size", type=int, help="DPStrategy.max_physical_batch_size")
    group.add_argument("--accelerator")
    group.add_argument("--precision")
    group.add_argument("--timeout", type=float, help="seconds per process before it is killed")
    group.add_argument("--threads", type=int, help="torch threads per process (0: torch's default)")
    sst2.add_source_arguments(parser)
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/synthetic[/full])")
    parser.add_argument("--logs", type=Path, help="logs folder (default bench/out/synthetic/<profile>)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (arm, ε, seed) and exit")
    args = parser.parse_args(argv)
    args.profile = "smoke" if args.smoke else "full" if args.full else "default"
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.train_examples == 0:
        args.train_examples = None
    args.logs = args.logs or ROOT / "bench" / "out" / "synthetic" / args.profile
    args.out = args.out or {"default": ROOT / "bench" / "results" / "synthetic",
                            "full": ROOT / "bench" / "results" / "synthetic" / "full",
                            "smoke": args.logs / "results"}[args.profile]
    for key in ("epochs", "batch_size", "lm_epochs", "lm_batch_size", "lm_max_length", "synthetic_per_label",
                "max_new_tokens", "generate_batch_size", "synthetic_epochs", "synthetic_batch_size", "max_length",
                "eval_batch_size", "physical_batch_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be ≥ 1")
    return args


# --------------------------------------------------------------------------------------------------------------------
# The private rows and the synthetic set


def read_sst2_rows(path: Path, start: int, count: int | None) -> list[tuple[str, str]]:
    """Rows ``start``..``start + count`` of an SST-2 TSV as (sentence, label), read with quoting off as dplit does."""
    rows = []
    with path.open(encoding="utf-8-sig") as file:
        next(file)  # header: sentence, label
        for index, line in enumerate(file):
            if index < start or not line.strip():
                continue
            if count is not None and len(rows) >= count:
                break
            sentence, label = line.rstrip("\n").rsplit("\t", 1)
            rows.append((sentence, label))
    return rows


def write_instructions(rows: Iterable[tuple[str, str]], path: Path) -> Path:
    """SST-2 rows as ``dplit lm`` instructions: the label's control prompt, and the review as the response."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": CONTROL_PROMPTS[label], "response": sentence}) for sentence, label in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_prompts(path: Path) -> Path:
    """The generation prompts file: each label's control prompt with its label."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "label": label}) + "\n" for label, p in CONTROL_PROMPTS.items()))
    return path


def write_synthetic_tsv(samples: list[dict[str, Any]], folder: Path, dev: Path) -> dict[str, int]:
    """The generated samples as an SST-2 ``train.tsv`` (one line each; empty ones dropped) beside a link to ``dev``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, dropped = [], 0
    for sample in samples:
        text = " ".join(sample["text"].replace("\t", " ").split())
        if not text:
            dropped += 1
            continue
        lines.append(f"{text}\t{sample['label']}\n")
    (folder / "train.tsv").write_text("sentence\tlabel\n" + "".join(lines), encoding="utf-8")
    link = folder / "dev.tsv"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(dev.resolve())
    return {"rows": len(lines), "dropped_empty": dropped,
            "positive": sum(line.endswith("\t1\n") for line in lines)}


def words(text: str) -> list[str]:
    """Lower-cased words split as SST-2 is: punctuation and the clitics ``n't``, ``'s``, ``'re``, ... apart."""
    text = re.sub(r"(\w)n't\b", r"\1 n't", text.lower())
    return re.findall(r"n't|'\w+|\w+|[^\w\s]", text)


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The word ``n``-grams of ``text``, in order."""
    tokens = words(text)
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: list[str], n: int) -> float | None:
    """Distinct ``n``-grams over all ``n``-grams of ``texts`` (``None`` when there are none)."""
    grams = [gram for text in texts for gram in ngrams(text, n)]
    return len(set(grams)) / len(grams) if grams else None


def overlap_share(texts: list[str], private: list[str], n: int = OVERLAP_N) -> float | None:
    """The share of the ``n``-grams of ``texts`` found verbatim in ``private`` (``None`` when there are none)."""
    seen = {gram for text in private for gram in ngrams(text, n)}
    grams = [gram for text in texts for gram in ngrams(text, n)]
    return sum(gram in seen for gram in grams) / len(grams) if grams else None


def describe_synthetic(texts: list[str], private: list[str], held_out: list[str] | None) -> dict[str, Any]:
    """Diversity and memorisation of a synthetic set, measured against the private rows.

    Args:
        texts: the synthetic rows (as written to the classifier's train.tsv).
        private: the private training rows.
        held_out: real rows outside the private set, for the chance level of the overlap (``None``: none).
    """
    known = {tuple(words(text)) for text in private}
    return {"distinct_1": distinct_n(texts, 1), "distinct_2": distinct_n(texts, 2), "distinct_3": distinct_n(texts, 3),
            f"overlap_{OVERLAP_N}gram": overlap_share(texts, private),
            f"held_out_overlap_{OVERLAP_N}gram": overlap_share(held_out, private) if held_out else None,
            "copied_rows": sum(tuple(words(text)) in known for text in texts) / len(texts) if texts else None,
            f"{OVERLAP_N}grams": sum(len(ngrams(text, OVERLAP_N)) for text in texts),
            "mean_words": sum(len(words(text)) for text in texts) / len(texts) if texts else None}


# --------------------------------------------------------------------------------------------------------------------
# Commands


def lm_fit_args(args: argparse.Namespace, sources: dict[str, Any], files: dict[str, Path], epsilon: float, seed: int,
                folder: Path) -> list[str]:
    """``dplit lm fit`` of the DP language model on the private instructions."""
    model = ["--model.pretrained", sources["pretrained"], "--data.tokenizer", sources["pretrained"]]
    if sources["gguf_file"]:
        model += ["--model.gguf_file", sources["gguf_file"], "--data.gguf_file", sources["gguf_file"]]
    callbacks = [{"class_path": "dplit.callbacks.ResourceMonitor"},
                 {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}]
    prefix = "--trainer.strategy.init_args."
    return [
        "lm", "fit", "--config", LM_CONFIG, *model,
        "--data.train_file", str(files["train"]), "--data.val_file", str(files["val"]),
        "--data.prompt_column", "prompt", "--data.response_column", "response",
        "--data.batch_size", str(args.lm_batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
        "--data.max_length", str(args.lm_max_length),
        "--seed_everything", str(seed), "--model.lr", repr(args.lm_lr), "--model.sample_prompts", "[]",
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.precision", args.precision,
        "--trainer.max_epochs", str(args.lm_epochs), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(folder),
        "--trainer.callbacks", json.dumps(callbacks),
        prefix + "target_epsilon", repr(float(epsilon)), prefix + "max_grad_norm", repr(args.lm_max_grad_norm),
        prefix + "clipping", "ghost", prefix + "max_physical_batch_size", str(args.physical_batch_size),
    ]


def generate_args(args: argparse.Namespace, model: Path, prompts: Path, output: Path, seed: int) -> list[str]:
    """``dplit lm generate``: ``--synthetic-per-label`` samples of each control prompt."""
    return ["lm", "generate", "--model", str(model), "--prompts_file", str(prompts),
            "--num_samples", str(args.synthetic_per_label), "--output_file", str(output), "--overwrite",
            "--temperature", repr(args.temperature), "--top_p", repr(args.top_p),
            "--max_new_tokens", str(args.max_new_tokens), "--seed", str(seed),
            "--batch_size", str(args.generate_batch_size), "--device", generation_device(args), "--no_progress"]


def generation_device(args: argparse.Namespace) -> str:
    """Where ``dplit lm generate`` samples: the CPU when the study trains there, else CUDA when there is one."""
    if args.accelerator == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def classifier_args(args: argparse.Namespace, sources: dict[str, Any], arm: str, epsilon: float | None, seed: int,
                    folder: Path, *, synthetic: Path | None = None) -> list[str]:
    """A classifier arm as the tying study runs it; ``synthetic``: trained without DP on that folder's train.tsv."""
    if synthetic is None:
        run = {"arm": arm, "epsilon": epsilon, "seed": seed, "rows": args.train_examples}  # noise from OS entropy
        return tying.dplit_args(args, sources, run, folder)
    on_synthetic = copy.copy(args)
    on_synthetic.train_examples, on_synthetic.epochs = None, args.synthetic_epochs
    on_synthetic.batch_size, on_synthetic.lr = args.synthetic_batch_size, args.synthetic_lr
    rows = {**sources, "data_dir": str(synthetic)}
    return tying.dplit_args(on_synthetic, rows, {"arm": "non_private", "epsilon": None, "seed": seed, "rows": None},
                            folder)


def dplit_command(argv: list[str]) -> list[str]:
    """The dplit executable of this interpreter (``python -m dplit``) with ``argv``."""
    return [sys.executable, "-m", "dplit", *argv]


# --------------------------------------------------------------------------------------------------------------------
# One pipeline


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


# --------------------------------------------------------------------------------------------------------------------
# Table


ARM_LABELS = {"zero_shot": "zero-shot (no training)", "dp_classifier": "DP classifier on the private rows",
              "synthetic_pretrained": "classifier on synthetic rows of the pretrained LM (no private data)",
              "synthetic": "classifier on DP synthetic rows (DP LM)"}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (arm, ε): dev accuracy and ε spent (mean ± std over seeds), and the synthetic sets' statistics."""
    keys: list[tuple[str, float | None]] = []
    for row in rows:
        if (row["arm"], row["epsilon"]) not in keys:
            keys.append((row["arm"], row["epsilon"]))
    summary = []
    for arm, epsilon in keys:
        group = [r for r in rows if r["arm"] == arm and r["epsilon"] == epsilon and r.get("status") == "ok"]
        synthetic = [r["synthetic"] for r in group if "synthetic" in r]
        entry = {"arm": arm, "target_epsilon": epsilon, "seeds": [r["seed"] for r in group],
                 "failed": sum(1 for r in rows if r["arm"] == arm and r["epsilon"] == epsilon
                               and r.get("status") != "ok"),
                 "val_acc": mean_std([r.get("val_acc") for r in group]),
                 "epsilon_spent": mean_std([r.get("epsilon_spent") for r in group])}
        for key in ("rows", "distinct_1", "distinct_2", "distinct_3", f"overlap_{OVERLAP_N}gram",
                    f"held_out_overlap_{OVERLAP_N}gram", "copied_rows", "mean_words"):
            entry[key] = mean_std([s.get(key) for s in synthetic]) if synthetic else None
        summary.append(entry)
    return summary


def render_table(results: dict[str, Any]) -> str:
    """``table.md``: the settings in words, the machine, one row per arm and ε (accuracy, synthetic set), every run."""
    s, subset = results["settings"], results["training_subset"]
    lines = [
        "# DP synthetic data: SmolLM2-135M-Instruct on SST-2",
        "",
        (f"Profile `{s['profile']}`. Private set: {subset['rule']} (positive share "
         f"{subset.get('positive_share', float('nan')):.2f}); evaluation on {subset['dev_rule']} ({subset['dev_rows']} "
         f"rows). DP LM: `dplit lm fit --config {LM_CONFIG}`, prompt = the label's control prompt "
         f"{json.dumps(list(CONTROL_PROMPTS.values()))}, response = the review (loss on the response only), expected "
         f"batch {s['lm_batch_size']}, {s['lm_epochs']} epoch(s), AdamW lr {s['lm_lr']:g}, C = {s['lm_max_grad_norm']:g} "
         f"(summed token loss), max length {s['lm_max_length']}. Generation: {s['synthetic_per_label']} samples per "
         f"label, temperature {s['temperature']:g}, top-p {s['top_p']:g}, at most {s['max_new_tokens']} new tokens. "
         f"Classifier on the synthetic rows: no DP (post-processing), {s['synthetic_epochs']} epoch(s), batch "
         f"{s['synthetic_batch_size']}, AdamW lr {s['synthetic_lr']:g}, fixed in advance (not tuned on dev). DP "
         f"classifier on the private rows: the tying study's `dp_tied` arm, expected batch {s['batch_size']}, "
         f"{s['epochs']} epoch(s), lr {s['lr']:g}, C = {s['max_grad_norm']:g}. All DP runs: ghost clipping, σ "
         f"calibrated by `target_epsilon`, δ = N^-1.1, PRV accountant, tied embeddings (SmolLM2's own). Model: "
         f"{sst2.model_line(results['sources'])}. {s['precision']} on {s['accelerator']}, "
         f"{s['threads'] or 'default'} torch thread(s) per process, seeds {s['seeds']}."),
        "",
        machine_line(results) + f". Wall time: {results['wall_s'] / 60:.1f} min.",
        "",
        "| arm | ε | dev acc % | synthetic rows | words per row | distinct-1 / -2 / -3 | 8-grams found in the private "
        "rows % | rows copied whole % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in results["summary"]:
        eps = {"zero_shot": "0 (no training)", "synthetic_pretrained": "0 (no private data)"}.get(
            a["arm"], plus_minus(a["epsilon_spent"], digits=2))
        acc = plus_minus(a["val_acc"], 100) + (f" ({a['failed']} failed)" if a["failed"] else "")
        if a.get("rows"):
            distinct = " / ".join(plus_minus(a[f"distinct_{n}"], digits=2) for n in (1, 2, 3))
            extra = (f"{plus_minus(a['rows'], digits=0)} | {plus_minus(a['mean_words'], digits=1)} | {distinct} | "
                     f"{plus_minus(a[f'overlap_{OVERLAP_N}gram'], 100, digits=2)} | "
                     f"{plus_minus(a['copied_rows'], 100, digits=2)}")
        else:
            extra = "– | – | – | – | –"
        lines.append(f"| {ARM_LABELS[a['arm']]} | {eps} | {acc} | {extra} |")
    lines += [
        "",
        ("ε: the accountant's ε after training (for the DP synthetic rows, the LM's, from its exported card; the "
         "synthetic rows and the classifier trained on them inherit it). The pretrained LM's rows are the control: "
         "the same prompts and sampling without any fine-tuning. mean ± std over seeds. distinct-n: distinct "
         "word n-grams over all n-grams of the synthetic set (lower-cased words, punctuation and clitics apart, as "
         f"SST-2 is written). {OVERLAP_N}-grams found: the share of the synthetic set's word {OVERLAP_N}-grams that "
         f"occur verbatim in the private training rows{_chance(results)}. Rows copied whole: synthetic rows equal to a "
         "private row (same words). These two columns and the private set's positive share are computed from the "
         "private rows WITHOUT noise: they are diagnostics for this public data set, not covered by ε."),
        "",
        "Every run:",
        "",
        "| run | status | dev acc % | ε | LM steps | LM σ | synthetic rows (positive) | stage times s |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | failed: {str(r.get('message', ''))[:160]} | | | | | | |")
            continue
        eps = r.get("epsilon_spent")
        lm, syn = r.get("lm") or {}, r.get("synthetic")
        stages = [f"{stage} {r[f'{stage}_wall_s']:.0f}" for stage in ("lm_fit", "export", "generate")
                  if f"{stage}_wall_s" in r]
        stages.append(f"classifier {r['classifier']['process_wall_s']:.0f}" if "classifier" in r
                      else f"process {r['process_wall_s']:.0f}")
        rows = f"{syn['rows']} ({syn['positive']})" if syn else "–"
        lines.append(f"| {r['name']} | ok | {r['val_acc'] * 100:.1f} | {_number(eps, 3)} | {lm.get('steps', '–')} | "
                     f"{_number(lm.get('noise_multiplier'), 3)} | {rows} | {', '.join(stages)} |")
    lines += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def _chance(results: dict[str, Any]) -> str:
    """The overlap that real held-out SST-2 rows have with the private rows, for the table's note."""
    shares = [r["synthetic"].get(f"held_out_overlap_{OVERLAP_N}gram") for r in results["runs"] if r.get("synthetic")]
    shares = [share for share in shares if share is not None]
    if not shares:
        return ""
    return (f" (for scale: {shares[0] * 100:.2f}% of the {OVERLAP_N}-grams of {results['settings']['lm_val_examples']} "
            "real SST-2 train rows outside the private set are found there too)")


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """Summarise the runs and write results.json and table.md into ``out``."""
    results["summary"] = summarize(results["runs"])
    write_json(results, out / "results.json")
    (out / "table.md").write_text(render_table(results))


# --------------------------------------------------------------------------------------------------------------------
# Main


def prepare_files(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, Any]:
    """The private instructions, the LM's validation rows and the prompts file, from the local SST-2 train.tsv."""
    if sources["data_dir"] is None:
        raise SystemExit("the synthetic-data pipeline reads SST-2's train.tsv: give --data-dir or --data-root")
    train = Path(sources.get("original_data_dir") or sources["data_dir"]) / "train.tsv"
    private = read_sst2_rows(train, 0, args.train_examples)
    held_out = read_sst2_rows(train, len(private), args.lm_val_examples)
    monitor = held_out or private[-args.lm_val_examples :]  # the whole split is private: a training-fit monitor
    folder = args.logs / "data"
    return {"train": write_instructions(private, folder / "private.jsonl"),
            "val": write_instructions(monitor, folder / "lm_val.jsonl"),
            "prompts": write_prompts(folder / "prompts.jsonl"), "private_texts": [text for text, _ in private],
            "held_out_texts": [text for text, _ in held_out] or None}


def plan(args: argparse.Namespace, *, control: bool = True) -> list[tuple[str, float | None, int]]:
    """(arm, ε, seed) in running order.

    Zero-shot once; per seed the pretrained control (``control``), then per ε the DP classifier and the pipeline.
    """
    runs: list[tuple[str, float | None, int]] = [("zero_shot", None, args.seeds[0])]
    for seed in args.seeds:
        if control:
            runs.append(("synthetic", None, seed))  # synthetic rows of the pretrained model itself
        for epsilon in args.epsilons:
            runs += [("dp_tied", epsilon, seed), ("synthetic", epsilon, seed)]
    return runs


def main(argv: list[str] | None = None) -> None:
    """Run the planned arms one by one, writing the results after each, then print the table.

    ``--dry-run`` only prints the plan.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    install_stop_handlers()
    sources = sst2.prepare(args)
    folder = Path(sources["pretrained"])
    control = (folder / "config.json").is_file() and not sources["gguf_file"]
    if not control:
        print(f"no pretrained control: `dplit lm generate` needs a local model folder, and {folder} is not one "
              "(the hub, or a GGUF with --no-cache)", flush=True)
    runs = plan(args, control=control)
    if args.dry_run:
        for arm, epsilon, seed in runs:
            print(f"# {arm} ε={epsilon} seed={seed}")
        return
    files = prepare_files(args, sources)
    results: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.synthetic", *map(shlex.quote, argv)]),
        "machine": machine_info(), "git": git_info(*GIT_PATHS),
        "sources": {k: (str(v) if isinstance(v, Path) else v) for k, v in sources.items()},
        "settings": {k: getattr(args, k) for k in PROFILES["default"]} | {"profile": args.profile,
                                                                        "control_prompts": CONTROL_PROMPTS},
        "training_subset": sst2.subset_description(args, sources, args.train_examples),
        "runs": [], "wall_s": 0.0, "complete": False,
    }
    print(f"{len(runs)} runs; profile {args.profile}; {results['training_subset']['rule']}; out {relative(args.out)}",
          flush=True)
    start = time.perf_counter()
    for index, (arm, epsilon, seed) in enumerate(runs, 1):
        print(f"[{time.perf_counter() - start:6.0f} s] {index}/{len(runs)} {arm} ε={epsilon} seed={seed} ...", end=" ",
              flush=True)
        if arm == "synthetic":
            row = run_pipeline(args, sources, files, epsilon, seed)
        else:
            row = run_classifier(args, sources, arm, epsilon, seed)
        results["runs"].append(row)
        results["wall_s"] = time.perf_counter() - start
        write_outputs(results, args.out)
        print(f"acc {row['val_acc'] * 100:.1f}%" if row.get("status") == "ok" else f"FAILED: {row.get('message')}",
              flush=True)
    results["complete"] = True
    if git_info(*GIT_PATHS) != results["git"]:
        results["git"]["changed_during_run"] = git_info(*GIT_PATHS)
    write_outputs(results, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
