"""Tied vs untied embeddings under DP-SGD on a real pretrained LM and task: SmolLM2-135M-Instruct on GLUE SST-2.

    python -m benchmarks.tying --smoke        # tiny subset, 1 seed, 1 ε, 64 dev rows: a few minutes (a check)
    python -m benchmarks.tying                # default CPU profile (see PROFILES): about 40 min on 2 CPU cores
    python -m benchmarks.tying --full         # the paper's recipe (all 67,349 rows, B=1000, 3 epochs): for a GPU
    python -m benchmarks.tying --hub          # weights, tokenizer and GLUE from the Hugging Face hub

Arms, all with the same hyperparameters (lr, expected batch, epochs, max_length, label words, seeds) and, for the
DP arms, the same privacy budget:

* ``zero_shot``: the pretrained model, no training, validation only (``dplit validate``).
* ``non_private``: the same module trained without ``DPStrategy`` (``--trainer.strategy auto --non_private true``).
* ``dp_tied`` / ``dp_untied``: ``DPStrategy`` with ghost clipping and ``target_epsilon`` = ε, from
  ``configs/smollm2_sst2_tied.yaml`` (``TiedEmbeddings``, SmolLM2's own tying) and
  ``configs/smollm2_sst2_untied.yaml`` (``UntiedEmbeddings(init="copy")``), for every ε and seed.

Every arm runs ``dplit``'s own CLI (``dplit.cli.run_cli``: the shipped YAML plus command-line overrides) in its own
process (``python -m benchmarks.tying --child SPEC``), so peak memory is per arm. The child fits, then validates on
the whole GLUE dev split (872 rows unless ``--eval-examples``), and reports validation accuracy, the ε the strategy's
accountant has spent, the steps taken, the mean optimizer-step time (a timing callback) and peak memory (process
peak RSS on CPU, CUDA max allocated on GPU). The parent writes ``results.json`` (every run, the summary, the command,
machine, git commit), ``table.md`` and ``chart.png`` to ``--out`` (default ``benchmarks/results/tying/``); Lightning
logs and each arm's output go to ``--logs`` (default ``benchmarks/out/tying/``, git-ignored).

The training subset is the FIRST ``--train-examples`` rows of SST-2's train.tsv (``data.max_train_examples``).

Default CPU profile (measured on 2 shared cores, see PROFILES): 160 rows, expected batch 8, 1 epoch (20 optimizer
steps), lr 5e-4, max_length 64 (no dev prompt is longer than 61 tokens), 3 seeds, ε ∈ {3, 8}: about 40 minutes, most
of it validating 872 rows 16 times. At this scale DP-SGD cannot be expected to move the model far from its
starting point (the privacy noise scales with 1/(N·ε)); ``--full`` is the paper-sized study, for a GPU.

Speed measures that change nothing in the maths: each arm runs with 1 torch thread (OMP_NUM_THREADS too, as Lightning's
DDP-based DPStrategy would otherwise reset it to 2 on 2 cores, which stalls badly when another process shares them);
the GGUF checkpoint is dequantised once into a float32 folder (``--no-cache`` to load the GGUF in every arm); dev.tsv is
validated from a length-sorted copy (``--no-sort-dev`` for the file's order), which halves padding.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make this checkout's `benchmarks` win over opacus' top-level one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run import cpu_model_and_memory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_DIR = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SST2_DIR = "glue/sst2"
DEV_ROWS = 872
LABEL_WORDS = {"0": " negative", "1": " positive"}
TEMPLATE = "Review: {sentence}\nSentiment:"  # as configs/smollm2_sst2_*.yaml: an instruct model's natural prompt
CONFIGS = {"tied": "configs/smollm2_sst2_tied.yaml", "untied": "configs/smollm2_sst2_untied.yaml"}
ARMS = ("zero_shot", "non_private", "dp_tied", "dp_untied")
ARM_NAMES = {"zero_shot": "zero-shot", "non_private": "non-private", "dp_tied": "DP tied", "dp_untied": "DP untied"}

PROFILES: dict[str, dict[str, Any]] = {
    # 2 shared CPU cores, 1 torch thread, measured per arm: ~10 s start-up, ~1 s to load the dequantised checkpoint,
    # ~72 s to validate the 872 dev rows (sorted by length, batches of 32), ~3.3 s per DP step at B = 8 (~2.8 s
    # non-private; the first DP step adds ~10 s for DPStrategy's ghost-clipping self-check). 16 arms: ~40 min.
    "default": {
        "train_examples": 160, "epochs": 1, "batch_size": 8, "lr": 5e-4, "max_length": 64, "eval_batch_size": 32,
        "max_grad_norm": 0.1, "physical_batch_size": 16, "epsilons": [3.0, 8.0], "seeds": [0, 1, 2],
        "eval_examples": None, "accelerator": "cpu", "precision": "32-true", "timeout": 1200.0, "threads": 1,
    },
    "smoke": {
        "train_examples": 32, "epochs": 1, "batch_size": 8, "lr": 5e-4, "max_length": 64, "eval_batch_size": 32,
        "max_grad_norm": 0.1, "physical_batch_size": 8, "epsilons": [8.0], "seeds": [0],
        "eval_examples": 64, "accelerator": "cpu", "precision": "32-true", "timeout": 600.0, "threads": 1,
    },
    # Li et al. 2021's SST-2 recipe (the shipped configs' values): meant for a GPU.
    "full": {
        "train_examples": None, "epochs": 3, "batch_size": 1000, "lr": 5e-4, "max_length": 128, "eval_batch_size": 128,
        "max_grad_norm": 0.1, "physical_batch_size": 64, "epsilons": [3.0, 8.0], "seeds": [0, 1, 2],
        "eval_examples": None, "accelerator": "auto", "precision": "bf16-mixed", "timeout": 6 * 3600.0, "threads": 0,
    },
}


# --------------------------------------------------------------------------------------------------------------------
# Arguments and sources


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tying", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--smoke", action="store_true", help="quick check: 32 train rows, 1 seed, ε=8, 64 dev rows")
    profile.add_argument("--full", action="store_true",
                         help="the paper's recipe: whole train set, B=1000, 3 epochs, lr 5e-4, C=0.1, max_length 128, "
                              "bf16-mixed on the best accelerator (a GPU)")
    parser.add_argument("--epsilons", nargs="+", type=float, help="target ε of the DP arms (default 3 8)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (seed_everything; default 0 1 2)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="arms to run (default: all)")
    parser.add_argument("--train-examples", type=int, help="first N rows of SST-2 train (0: all 67,349)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="expected logical batch (Poisson rate q = B/N under DP)")
    parser.add_argument("--lr", type=float, help="AdamW peak learning rate (linear decay to 0)")
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
    parser.add_argument("--no-cache", action="store_true",
                        help="load the GGUF in every arm (default: dequantise it once, through dplit's loaders, to a "
                             "float32 folder under --logs, checked to hold the same tensors and token ids)")
    parser.add_argument("--no-sort-dev", action="store_true",
                        help="validate in dev.tsv's own order (default: a copy of dev.tsv sorted by length, so "
                             "batches carry little padding; accuracy does not depend on the order)")
    source = parser.add_argument_group("model and data sources")
    source.add_argument("--hub", action="store_true",
                        help=f"load {HUB_MODEL} (or --pretrained) and its tokenizer from the Hugging Face hub, "
                             "and GLUE SST-2 from the hub unless --data-dir is given")
    source.add_argument("--pretrained", default=None,
                        help=f"hub name or local folder of the checkpoint (default: the GGUF in the data folder, "
                             f"or {HUB_MODEL} with --hub)")
    source.add_argument("--gguf-file", default=None, help=f"GGUF file inside --pretrained (default {GGUF_FILE} "
                                                          "when the GGUF folder is used; '' for none)")
    source.add_argument("--data-root", type=Path, default=None,
                        help="shared data folder (default $DPLIT_DATA_DIR, else /work/shared/data)")
    source.add_argument("--data-dir", type=Path, default=None, help="folder with SST-2 train.tsv and dev.tsv")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default benchmarks/results/tying, .../tying/full with --full, "
                             "benchmarks/out/tying/smoke/results with --smoke)")
    parser.add_argument("--logs", type=Path, default=None, help="logs folder (default benchmarks/out/tying, ignored)")
    parser.add_argument("--dry-run", action="store_true", help="print each arm's dplit command and exit")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--convert", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None or args.convert is not None:
        return args
    name = "smoke" if args.smoke else "full" if args.full else "default"
    args.profile = name
    for key, value in PROFILES[name].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.train_examples == 0:
        args.train_examples = None
    args.logs = args.logs or ROOT / "benchmarks" / "out" / "tying" / name  # git-ignored
    default_out = {"default": ROOT / "benchmarks" / "results" / "tying", "full": ROOT / "benchmarks" / "results" / "tying" /
                   "full", "smoke": args.logs / "results"}[name]  # a smoke check's results stay out of git
    args.out = args.out or default_out
    for key in ("epochs", "batch_size", "max_length", "eval_batch_size", "physical_batch_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be ≥ 1")
    if args.train_examples is not None and args.batch_size > args.train_examples:
        parser.error(f"--batch-size {args.batch_size} exceeds --train-examples {args.train_examples}")
    return args


def resolve_sources(args: argparse.Namespace) -> dict[str, Any]:
    """Where the weights, tokenizer and SST-2 come from: the local GGUF and TSVs by default, else the hub."""
    root = args.data_root or Path(os.environ.get("DPLIT_DATA_DIR") or "/work/shared/data")
    data_dir = args.data_dir or (root / SST2_DIR if (root / SST2_DIR / "dev.tsv").is_file() else None)
    if args.hub or (args.pretrained is not None and not Path(args.pretrained).exists()):
        pretrained = args.pretrained or HUB_MODEL
        gguf = args.gguf_file or None
        data_dir = args.data_dir  # --hub: GLUE from the hub unless a folder is given
        _check_hub(pretrained, data_dir is None)
        return {"pretrained": pretrained, "gguf_file": gguf, "data_dir": data_dir, "kind": "hub"}
    if args.pretrained is not None:  # a local folder
        gguf = args.gguf_file or None
        if data_dir is None:
            _check_hub(None, True)
        return {"pretrained": str(Path(args.pretrained).resolve()), "gguf_file": gguf, "data_dir": data_dir,
                "kind": "local folder"}
    gguf = args.gguf_file if args.gguf_file is not None else GGUF_FILE
    folder = root / GGUF_DIR
    if gguf and (folder / gguf).is_file():
        if data_dir is None:
            _check_hub(None, True)
        return {"pretrained": str(folder.resolve()), "gguf_file": gguf, "data_dir": data_dir, "kind": "gguf"}
    try:
        _check_hub(HUB_MODEL, data_dir is None)
    except SystemExit as error:
        raise SystemExit(
            f"no local checkpoint: {folder / (gguf or GGUF_FILE)} does not exist (set $DPLIT_DATA_DIR or --data-root "
            f"to the shared data folder, or --pretrained to a model folder), and the Hugging Face hub is not usable "
            f"either: {error}"
        ) from None
    return {"pretrained": HUB_MODEL, "gguf_file": None, "data_dir": data_dir, "kind": "hub"}


def _check_hub(model: str | None, needs_glue: bool) -> None:
    """Exit with a clear message when the hub is needed but offline or unreachable."""
    need = " and ".join(x for x in (model and f"the model {model}", needs_glue and "GLUE SST-2") if x)
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "0") not in (
            "", "0"):
        raise SystemExit(f"{need} would come from the Hugging Face hub, but HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set; "
                         f"point --data-root / --pretrained / --data-dir at local files")
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        if model:
            api.model_info(model, timeout=15)
        if needs_glue:
            api.dataset_info("nyu-mll/glue", timeout=15)
    except Exception as error:  # noqa: BLE001 - any failure means "not usable"
        raise SystemExit(f"{need} would come from the Hugging Face hub, which is not reachable "
                         f"({type(error).__name__}: {str(error)[:200]})") from None


# --------------------------------------------------------------------------------------------------------------------
# Shared inputs prepared once: a float32 copy of the GGUF checkpoint, a length-sorted copy of dev.tsv


def prepare_checkpoint(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, Any]:
    """Dequantise the GGUF once (through dplit's own loaders) into a folder every arm loads in a second or two.

    Loading the GGUF costs each arm ~25 s of CPU (dequantisation) plus ~5 s (its tokenizer); the folder holds the very
    same float32 tensors and a tokenizer checked to give the same token ids, so the arms train the same model.
    """
    if sources["kind"] != "gguf" or args.no_cache:
        return sources
    gguf = Path(sources["pretrained"]) / sources["gguf_file"]
    cache = args.logs.parent / "cache" / (Path(sources["gguf_file"]).stem + "-float32")
    stat = gguf.stat()
    stamp = {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime": stat.st_mtime,
             "transformers": _version("transformers"), "max_length": args.max_length}
    stamp_path = cache / "dplit_tying_stamp.json"
    if not (stamp_path.is_file() and json.loads(stamp_path.read_text()).get("source") == stamp):
        print(f"dequantising {gguf.name} once into {_relative(cache)} ...", end=" ", flush=True)
        started = time.perf_counter()
        spec = {"folder": sources["pretrained"], "gguf_file": sources["gguf_file"], "cache": str(cache),
                "data_dir": str(sources["data_dir"]) if sources["data_dir"] else None, "stamp": stamp,
                "max_length": args.max_length, "train_examples": 5000}
        done = subprocess.run([sys.executable, "-m", "benchmarks.tying", "--convert", json.dumps(spec)], cwd=ROOT,
                              env=child_environment(args.threads), capture_output=True, text=True, check=False)
        if done.returncode != 0 or not stamp_path.is_file():
            tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-5:]
            raise SystemExit("could not convert the GGUF checkpoint (rerun with --no-cache to load it in every arm):\n"
                             + "\n".join(tail))
        print(f"{time.perf_counter() - started:.0f} s", flush=True)
    checked = json.loads(stamp_path.read_text())
    return {**sources, "pretrained": str(cache.resolve()), "gguf_file": None, "kind": "gguf, dequantised once",
            "gguf_source": str(gguf.resolve()), "cache_check": checked["check"]}


def convert_main(spec_json: str) -> None:
    """The ``--convert`` child: GGUF → float32 folder, then prove it loads back identically through dplit."""
    spec = json.loads(spec_json)
    import shutil

    import torch

    from dplit.backbone import build_causal_lm
    from dplit.data import GlueDataModule
    from dplit.embeddings import is_tied

    cache = Path(spec["cache"])
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    settings = {"config": None, "vocab_size": None, "dropout": None, "attn_implementation": "eager"}
    source = build_causal_lm(pretrained=spec["folder"], gguf_file=spec["gguf_file"], **settings)
    source.hf_quantizer = None  # transformers refuses to save a GGUF-loaded model; the tensors are plain float32
    if hasattr(source.config, "quantization_config"):
        del source.config.quantization_config
    source.save_pretrained(cache)
    data = {"task": "sst2", "data_dir": spec["data_dir"], "max_length": spec["max_length"],
            "max_train_examples": spec["train_examples"], "label_words": LABEL_WORDS, "template": TEMPLATE}
    gguf_data = GlueDataModule(tokenizer=spec["folder"], gguf_file=spec["gguf_file"], **data)
    gguf_data.tokenizer.save_pretrained(cache)
    for name in ("vocab.json", "merges.txt"):  # keep dplit on AutoTokenizer (tokenizer.json), not GPT2TokenizerFast
        (cache / name).unlink(missing_ok=True)
    copy = build_causal_lm(pretrained=str(cache), gguf_file=None, **settings)
    copy_data = GlueDataModule(tokenizer=str(cache), **data)
    ours, theirs = source.state_dict(), copy.state_dict()
    problems = []
    if set(ours) != set(theirs) or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        problems.append("weights differ")
    if is_tied(source) != is_tied(copy):
        problems.append("tying differs")
    config_a, config_b = source.config.to_diff_dict(), copy.config.to_diff_dict()
    if {k: v for k, v in config_a.items() if k != "quantization_config"} != config_b:
        problems.append("configs differ")
    rows = {}
    for split in ("train", "dev"):
        a, b = gguf_data.dataset(split), copy_data.dataset(split)
        rows[split] = len(a)
        if [a[i]["input_ids"] for i in range(len(a))] != [b[i]["input_ids"] for i in range(len(b))]:
            problems.append(f"token ids differ on {split}")
    if gguf_data.label_word_ids != copy_data.label_word_ids or (
            gguf_data.tokenizer.pad_token_id != copy_data.tokenizer.pad_token_id):
        problems.append("label word or pad ids differ")
    if problems:
        raise SystemExit("the dequantised copy does not match the GGUF: " + ", ".join(problems))
    check = {"tensors_identical": len(ours), "tied": is_tied(copy), "token_ids_identical_rows": rows,
             "label_word_ids": copy_data.label_word_ids}
    (cache / "dplit_tying_stamp.json").write_text(json.dumps({"source": spec["stamp"], "check": check}, indent=1))


def prepare_dev(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, Any]:
    """A copy of dev.tsv (its first ``--eval-examples`` rows) sorted by length, beside a link to train.tsv.

    dplit batches the dev split in file order and pads each batch to its longest prompt: sorted, the 872 rows carry
    ~1.05x their real tokens instead of ~1.8x, which nearly halves the validation time of every arm.
    """
    if sources["data_dir"] is None or args.no_sort_dev:
        if args.eval_examples is not None:
            sources = {**sources, "max_eval_examples": args.eval_examples}
        return {**sources, "dev_order": "dev.tsv's own order"}
    original = Path(sources["data_dir"])
    folder = args.logs / "data" / "sst2"
    folder.mkdir(parents=True, exist_ok=True)
    lines = (original / "dev.tsv").read_text(encoding="utf-8-sig").splitlines(keepends=True)
    header, rows = lines[0], [line for line in lines[1:] if line.strip()]
    rows = rows[: args.eval_examples] if args.eval_examples else rows
    ordered = sorted(rows, key=lambda line: len(line.split("\t")[0]))  # stable: ties keep the file's order
    target = folder / "dev.tsv"
    temporary = folder / "dev.tsv.tmp"
    temporary.write_text(header + "".join(line if line.endswith("\n") else line + "\n" for line in ordered),
                         encoding="utf-8")
    os.replace(temporary, target)
    link = folder / "train.tsv"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to((original / "train.tsv").resolve())
    return {**sources, "data_dir": str(folder.resolve()), "original_data_dir": str(original.resolve()),
            "dev_order": f"the {len(rows)} dev rows sorted by sentence length (a copy, {_relative(target)})"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------------------------------
# One arm = one dplit command


def arm_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (arm, ε, seed) to run, zero-shot first (it does not depend on the seed: run once)."""
    runs: list[dict[str, Any]] = []
    if "zero_shot" in args.arms:
        runs.append({"arm": "zero_shot", "epsilon": None, "seed": args.seeds[0]})
    for seed in args.seeds:
        if "non_private" in args.arms:
            runs.append({"arm": "non_private", "epsilon": None, "seed": seed})
        for epsilon in args.epsilons:
            for arm in ("dp_tied", "dp_untied"):
                if arm in args.arms:
                    runs.append({"arm": arm, "epsilon": epsilon, "seed": seed})
    return runs


def run_name(run: dict[str, Any]) -> str:
    eps = f"-eps{run['epsilon']:g}" if run["epsilon"] is not None else ""
    return f"{run['arm']}{eps}-seed{run['seed']}" if run["arm"] != "zero_shot" else "zero_shot"


def dplit_args(args: argparse.Namespace, sources: dict[str, Any], run: dict[str, Any], log_dir: Path) -> list[str]:
    """The ``dplit`` command line of one arm: the shipped SmolLM2 SST-2 config plus overrides."""
    arm = run["arm"]
    config = CONFIGS["untied" if arm == "dp_untied" else "tied"]  # zero-shot / non-private: SmolLM2's own tied head
    command = ["validate" if arm == "zero_shot" else "fit", "--config", config]
    command += ["--model.pretrained", sources["pretrained"], "--data.tokenizer", sources["pretrained"]]
    if sources["gguf_file"]:
        command += ["--model.gguf_file", sources["gguf_file"], "--data.gguf_file", sources["gguf_file"]]
    command += ["--data.data_dir", str(sources["data_dir"]) if sources["data_dir"] else "null"]
    callbacks = [{"class_path": "dplit.callbacks.ResourceMonitor"}, {"class_path": "benchmarks.tying.StepTimer"}]
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
        "--model.lr", repr(args.lr),
        "--data.batch_size", str(args.batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
        "--data.max_length", str(args.max_length), "--data.label_words", json.dumps(LABEL_WORDS),
        "--data.template", TEMPLATE,
    ]
    if args.train_examples is not None:
        command += ["--data.max_train_examples", str(args.train_examples)]
    if sources.get("max_eval_examples") is not None:  # else the sorted dev copy holds exactly the rows to validate on
        command += ["--data.max_eval_examples", str(sources["max_eval_examples"])]
    if arm in ("zero_shot", "non_private"):
        command += ["--trainer.strategy", "auto", "--non_private", "true"]
    else:
        prefix = "--trainer.strategy.init_args."
        command += [prefix + "target_epsilon", repr(float(run["epsilon"])), prefix + "max_grad_norm",
                    repr(args.max_grad_norm), prefix + "clipping", "ghost",
                    prefix + "max_physical_batch_size", str(args.physical_batch_size)]
    return command


# --------------------------------------------------------------------------------------------------------------------
# The child: one arm in this process


try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # the parent only needs the standard library
    _Callback = object  # type: ignore[assignment,misc]


class StepTimer(_Callback):  # type: ignore[misc,valid-type]
    """Wall time and logical-batch size of every optimizer step (batch start to batch end, optimizer step included),
    and the wall time of the whole training loop and of each validation run."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.train_wall = 0.0
        self.val_walls: list[float] = []
        self._started = self._train_started = self._val_started = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._train_started = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.train_wall = time.perf_counter() - self._train_started

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.val_walls.append(time.perf_counter() - self._val_started)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        self.times.append(time.perf_counter() - self._started)
        self.sizes.append(int(batch["labels"].shape[0]) if isinstance(batch, dict) and "labels" in batch else 0)


def child_main(spec_json: str) -> None:
    """Run one arm (``spec``: {"args": dplit argv, "result": path}) and write its measurements as JSON."""
    spec = json.loads(spec_json)
    import resource

    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from dplit.callbacks import peak_memory_mb
    from dplit.cli import run_cli
    from dplit.embeddings import is_tied
    from dplit.strategy import DPStrategy

    started = time.perf_counter()
    fit = spec["args"][0] == "fit"
    cli = run_cli(spec["args"])  # fit: trains (no validation during fit); validate: the zero-shot evaluation
    cli_wall = time.perf_counter() - started
    fit_cpu = _cpu_seconds()
    trainer, model = cli.trainer, cli.model
    train_peak = peak_memory_mb(model.device)
    timer = next((c for c in trainer.callbacks if type(c).__name__ == "StepTimer"), None)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if fit:
        validated = trainer.validate(model, datamodule=cli.datamodule, verbose=False)[0]
    else:
        validated = metrics
    strategy = trainer.strategy
    private = isinstance(strategy, DPStrategy)
    accountant = strategy.accountant if private else None
    ledger = None
    if private and trainer.log_dir and (Path(trainer.log_dir) / "privacy_ledger.json").is_file():
        ledger = json.loads((Path(trainer.log_dir) / "privacy_ledger.json").read_text())
    times = timer.times if timer else []
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    datamodule = cli.datamodule
    result = {
        "status": "ok",
        "val_acc": float(validated["val/acc"]),
        "val_loss": float(validated["val/loss"]),
        "val_examples": len(datamodule.dataset("dev")),
        "train_examples": len(datamodule.dataset("train")) if fit else 0,
        "train_label_share_1": (sum(int(x["label"]) for x in datamodule.dataset("train"))
                                / len(datamodule.dataset("train"))) if fit else None,
        "label_words": datamodule.label_words,
        "label_word_ids": list(datamodule.label_word_ids),
        "tied": is_tied(model.backbone),
        "embedding_policy": repr(model.embeddings),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "steps": int(trainer.global_step) if fit else 0,
        "epsilon_spent": (accountant.epsilon() if accountant is not None else (0.0 if not fit else None)),
        "delta": accountant.delta if accountant is not None else None,
        "accountant_steps": accountant.steps if accountant is not None else None,
        "noise_multiplier": strategy.noise_multiplier if private else None,
        "sample_rate": strategy.sample_rate if private else None,
        "ledger_epsilon": ledger.get("epsilon") if ledger else None,
        "step_time_s": statistics.fmean(times) if times else None,
        "step_time_after_first_s": statistics.fmean(times[1:]) if len(times) > 1 else None,
        "step_time_median_s": statistics.median(times) if times else None,
        "step_times_s": times,
        "step_batch_sizes": timer.sizes if timer else [],
        "cli_wall_s": cli_wall,
        "train_wall_s": timer.train_wall if fit and timer else None,
        "train_wall_per_step_s": timer.train_wall / trainer.global_step if fit and timer and trainer.global_step
        else None,
        "val_wall_s": timer.val_walls[-1] if timer and timer.val_walls else None,
        "cpu_s_until_validation": fit_cpu if fit else None,
        "cpu_s": _cpu_seconds(),
        "train_peak_mb": train_peak if fit else None,
        "monitor_peak_mb": metrics.get("memory/peak_mb"),
        "peak_rss_mb": rss_kib / 1024 if sys.platform != "darwin" else rss_kib / 2**20,
        "peak_mem_mb": peak_memory_mb(model.device),
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "log_dir": trainer.log_dir,
    }
    Path(spec["result"]).write_text(json.dumps(result, indent=1))


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------------------------------------------
# The parent


def child_environment(threads: int = 0) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (opacus 1.6 installs a top-level ``benchmarks``).

    With ``threads`` > 0 also OMP_NUM_THREADS: Lightning's DDP-based strategies (DPStrategy is one) otherwise reset
    torch's thread count to cpu_count // processes on CPU, whatever ``torch.set_num_threads`` said before.
    """
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
    if threads > 0:
        environment["OMP_NUM_THREADS"] = str(threads)
    return environment


_RUNNING: list[subprocess.Popen] = []
"""The arm process now running (in its own session, so a timeout can kill it with everything it started)."""


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT/SIGHUP of the study: kill the running arm too (it lives in its own session), then exit."""
    for process in _RUNNING[:]:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(f"stopped by signal {signal.Signals(signum).name}; results so far are in results.json")


def run_arm(args: argparse.Namespace, sources: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    name = run_name(run)
    arm_dir = args.logs / name
    arm_dir.mkdir(parents=True, exist_ok=True)
    result_path = arm_dir / "result.json"
    result_path.unlink(missing_ok=True)
    argv = dplit_args(args, sources, run, arm_dir)
    spec = json.dumps({"args": argv, "result": str(result_path), "threads": args.threads})
    command = [sys.executable, "-m", "benchmarks.tying", "--child", spec]
    log_path = arm_dir / "output.log"
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    problem = None
    with open(log_path, "w") as log:
        log.write("dplit " + shlex.join(argv) + "\n")
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env=child_environment(args.threads), start_new_session=True)
        _RUNNING.append(process)
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code, problem = None, f"timed out after {args.timeout:.0f} s (--timeout)"
        finally:
            _RUNNING.remove(process)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {**run, "name": name, "dplit_command": "dplit " + shlex.join(argv)}
    if code == 0 and result_path.is_file():
        row.update(json.loads(result_path.read_text()))
    else:
        if problem is None:
            problem = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                       else f"exited with code {code}")
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        row.update({"status": "failed", "message": problem + "; " + (errors or lines or [""])[-1][:300]})
    row["process_wall_s"] = wall
    row["load_avg_before"] = load_before
    row["load_avg_after"] = os.getloadavg()[0]
    row["log"] = _relative(log_path)
    return row


def _relative(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def machine_info() -> dict[str, Any]:
    cpu_model, total_kib = cpu_model_and_memory()
    versions = {}
    for package in ("torch", "transformers", "lightning", "opacus", "gguf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    gpu = None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=False)
        gpu = done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu_model": cpu_model, "logical_cpus": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "memory_gib": round(total_kib / 2**20, 1), "gpu": gpu, "platform": platform.platform(),
            "python": platform.python_version(), **versions}


def git_info() -> dict[str, Any]:
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", "dplit", "configs", "benchmarks/tying.py")
    return {"commit": head, "uncommitted_changes": dirty.splitlines() if dirty else []}


def subset_description(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, Any]:
    """Which training rows are used, with their label balance when the TSV is local."""
    info: dict[str, Any] = {
        "rule": f"the first {args.train_examples} rows of SST-2 train" if args.train_examples
        else "the whole SST-2 train split (67,349 rows)",
        "rows": args.train_examples,
        "dev_rows": args.eval_examples or DEV_ROWS,
        "dev_rule": "the whole SST-2 dev split" if not args.eval_examples else f"the first {args.eval_examples} dev rows",
    }
    info["dev_order"] = sources.get("dev_order")
    if sources["data_dir"] is not None:
        path = Path(sources.get("original_data_dir") or sources["data_dir"]) / "train.tsv"
        info["source"] = str(path)
        with path.open(encoding="utf-8-sig") as file:
            next(file)
            labels = [line.rstrip("\n").split("\t")[-1] for line, _ in zip(file, range(args.train_examples or 10**9))]
        info["rows"] = len(labels)
        info["positive_share"] = sum(label == "1" for label in labels) / max(1, len(labels))
    else:
        info["source"] = "nyu-mll/glue (hub)"
    return info


def _mean_std(values: list[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values), "values": values}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (arm, ε): accuracy mean ± std over seeds, ε spent, memory, step time; untied − tied paired by seed."""
    ok = [r for r in rows if r.get("status") == "ok"]
    arms: list[dict[str, Any]] = []
    keys = []
    for r in rows:
        key = (r["arm"], r["epsilon"])
        if key not in keys:
            keys.append(key)
    for arm, epsilon in keys:
        group = [r for r in ok if r["arm"] == arm and r["epsilon"] == epsilon]
        failed = [r for r in rows if r["arm"] == arm and r["epsilon"] == epsilon and r.get("status") != "ok"]
        arms.append({
            "arm": arm, "target_epsilon": epsilon, "seeds": [r["seed"] for r in group], "failed": len(failed),
            "val_acc": _mean_std([r["val_acc"] for r in group]),
            "epsilon_spent": _mean_std([r.get("epsilon_spent") for r in group]),
            "steps": _mean_std([r.get("steps") for r in group]),
            "peak_rss_mb": _mean_std([r.get("peak_rss_mb") for r in group]),
            "train_peak_mb": _mean_std([r.get("train_peak_mb") for r in group]),
            "step_time_s": _mean_std([r.get("step_time_s") for r in group]),
            "noise_multiplier": _mean_std([r.get("noise_multiplier") for r in group]),
        })
    differences = []
    epsilons = sorted({r["epsilon"] for r in ok if r["arm"] in ("dp_tied", "dp_untied")})
    for epsilon in epsilons:
        tied = {r["seed"]: r for r in ok if r["arm"] == "dp_tied" and r["epsilon"] == epsilon}
        untied = {r["seed"]: r for r in ok if r["arm"] == "dp_untied" and r["epsilon"] == epsilon}
        seeds = sorted(set(tied) & set(untied))
        diffs = [untied[s]["val_acc"] - tied[s]["val_acc"] for s in seeds]
        differences.append({"target_epsilon": epsilon, "seeds": seeds, "untied_minus_tied": _mean_std(diffs),
                            "per_seed": dict(zip(map(str, seeds), diffs))})
    return {"arms": arms, "untied_minus_tied": differences}


# --------------------------------------------------------------------------------------------------------------------
# Table and chart


def _pm(stats: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    if stats.get("mean") is None:
        return "–"
    text = f"{stats['mean'] * scale:.{digits}f}"
    if stats.get("std") is not None:
        text += f" ± {stats['std'] * scale:.{digits}f}"
    return text


def _arm_label(arm: str, epsilon: float | None) -> str:
    return ARM_NAMES[arm] + (f", ε = {epsilon:g}" if epsilon is not None else "")


def render_table(results: dict[str, Any]) -> str:
    s, m, subset = results["settings"], results["machine"], results["training_subset"]
    lines = [
        "# Tied vs untied embeddings under DP-SGD: SmolLM2-135M-Instruct on SST-2",
        "",
        (f"Profile `{s['profile']}`: {subset['rule']} (positive share {subset.get('positive_share', float('nan')):.2f}), "
        f"validation on {subset['dev_rule']} ({subset['dev_rows']} rows); expected batch {s['batch_size']}, "
        f"{s['epochs']} epoch(s), AdamW lr {s['lr']:g} with linear decay, max_length {s['max_length']}, "
        f"label words {json.dumps(list(LABEL_WORDS.values()))}, seeds {s['seeds']}; DP: ghost clipping, "
        f"C = {s['max_grad_norm']:g}, σ calibrated by `target_epsilon` over the planned steps, δ = N^-1.1, PRV "
        f"accountant; {s['precision']} on {s['accelerator']}, {s['threads'] or 'default'} torch thread(s) per arm. "
        f"Model: {_model_line(results['sources'])}. Validation order: {subset.get('dev_order')}."),
        "",
        f"Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU")
        + f"; torch {m['torch']}, transformers {m['transformers']}, lightning {m['lightning']}, opacus {m['opacus']}. "
        f"dplit commit `{results['git']['commit'][:12]}`"
        + (" (+ uncommitted changes)" if results["git"]["uncommitted_changes"] else "")
        + f". Wall time of the whole study: {results['wall_s'] / 60:.1f} min.",
        "",
        "| arm | ε spent | val acc % (mean ± std) | seeds | steps | σ | step time s | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in results["summary"]["arms"]:
        eps = a["epsilon_spent"]
        if a["arm"] == "non_private":
            eps_text = "∞"
        elif a["arm"] == "zero_shot":
            eps_text = "0 (no training)"
        else:
            eps_text = _pm(eps, digits=2)
        lines.append(
            f"| {_arm_label(a['arm'], a['target_epsilon'])} | {eps_text} | {_pm(a['val_acc'], 100)} | "
            f"{a['val_acc']['n']}" + (f" (+{a['failed']} failed)" if a["failed"] else "") + " | "
            f"{_pm(a['steps'], digits=0)} | {_pm(a['noise_multiplier'], digits=3)} | {_pm(a['step_time_s'], digits=2)} | "
            f"{_pm(a['peak_rss_mb'], digits=0)} |"
        )
    lines += ["", "Untied − tied validation accuracy, paired by seed (percentage points):", "",
              "| target ε | untied − tied (mean ± std) | per seed |", "|---:|---:|---|"]
    for d in results["summary"]["untied_minus_tied"]:
        per_seed = ", ".join(f"seed {k}: {v * 100:+.1f}" for k, v in d["per_seed"].items())
        lines.append(f"| {d['target_epsilon']:g} | {_pm(d['untied_minus_tied'], 100)} (n = "
                     f"{d['untied_minus_tied']['n']}) | {per_seed} |")
    lines += [
        "",
        ("Step time: mean wall time of one optimizer step (batch start to batch end, DP clipping, noise and AdamW "
        "included), from a timing callback. Peak RSS: the arm's whole process (model loading, training and "
        "validation), `resource.getrusage`. ε spent: the DPStrategy accountant's `epsilon()` after training. "
        "std: sample standard deviation over seeds. Each arm ran in its own process; the machine may have been "
        "shared with other work (see `load_avg_*` in results.json), so times are indicative."),
        "",
        "Every run:",
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
    lines += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def _model_line(sources: dict[str, Any]) -> str:
    if sources.get("gguf_source"):
        return (f"`{Path(sources['gguf_source']).name}` (SmolLM2-135M-Instruct, tied), dequantised once to float32 "
                f"through dplit's loaders and loaded by every arm from `{_relative(Path(sources['pretrained']))}` "
                "(same tensors and token ids, checked)")
    name = sources["pretrained"] + (f" / {sources['gguf_file']}" if sources.get("gguf_file") else "")
    return f"`{name}` ({sources['kind']})"


def render_chart(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')", flush=True)
        return False
    arms = [a for a in results["summary"]["arms"] if a["val_acc"]["mean"] is not None]
    colors = {"zero_shot": "#999999", "non_private": "#4c72b0", "dp_tied": "#dd8452", "dp_untied": "#55a868"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(arms) + 2), 4.5))
    for i, a in enumerate(arms):
        stats = a["val_acc"]
        ax.bar(i, stats["mean"] * 100, yerr=(stats["std"] or 0) * 100, capsize=4, color=colors[a["arm"]],
               edgecolor="black", linewidth=0.5)
        ax.scatter([i] * len(stats["values"]), [v * 100 for v in stats["values"]], color="black", s=10, zorder=3)
        ax.text(i, stats["mean"] * 100 + (stats["std"] or 0) * 100 + 0.8, f"{stats['mean'] * 100:.1f}",
                ha="center", fontsize=8)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels([_arm_label(a["arm"], a["target_epsilon"]).replace(", ", "\n") for a in arms], fontsize=8)
    ax.axhline(50, color="grey", linestyle=":", linewidth=0.8)
    values = [v * 100 for a in arms for v in a["val_acc"]["values"]]
    ax.set_ylim(max(0, min(values + [50]) - 10), min(100, max(values) + 8))
    s = results["settings"]
    subset = results["training_subset"]
    ax.set_ylabel(f"SST-2 dev accuracy % ({subset['dev_rows']} rows)")
    ax.set_title(f"SmolLM2-135M-Instruct, SST-2: {subset['rows'] or 'all'} train rows, B={s['batch_size']}, "
                 f"{s['epochs']} ep, lr {s['lr']:g}\nmean ± std over seeds {s['seeds']} (dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["summary"] = summarize(results["runs"])
    temporary = out / "results.json.tmp"
    temporary.write_text(json.dumps(results, indent=1))
    os.replace(temporary, out / "results.json")
    (out / "table.md").write_text(render_table(results))
    render_chart(results, out / "chart.png")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child is not None:
        child_main(args.child)
        return
    if args.convert is not None:
        convert_main(args.convert)
        return
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop)
    sources = resolve_sources(args)
    runs = arm_runs(args)
    if not args.dry_run:
        sources = prepare_dev(args, prepare_checkpoint(args, sources))
    else:
        print("# (dry run: without the dequantised checkpoint folder and the sorted dev copy a real run prepares)")
    if args.dry_run:
        for run in runs:
            print(f"# {run_name(run)}\ndplit {shlex.join(dplit_args(args, sources, run, args.logs / run_name(run)))}")
        return
    results: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.tying " + shlex.join(argv),
        "machine": machine_info(),
        "git": git_info(),
        "sources": {k: (str(v) if isinstance(v, Path) else v) for k, v in sources.items()},
        "settings": {k: getattr(args, k) for k in (
            "profile", "arms", "epsilons", "seeds", "train_examples", "epochs", "batch_size", "lr", "max_length",
            "eval_batch_size", "eval_examples", "max_grad_norm", "physical_batch_size", "accelerator", "precision",
            "timeout", "threads", "no_cache", "no_sort_dev")} | {"label_words": LABEL_WORDS, "configs": CONFIGS},
        "training_subset": subset_description(args, sources),
        "runs": [],
        "wall_s": 0.0,
        "complete": False,
    }
    print(f"{len(runs)} runs; profile {args.profile}; {results['training_subset']['rule']}; out {_relative(args.out)}",
          flush=True)
    start = time.perf_counter()
    for index, run in enumerate(runs, 1):
        print(f"[{time.perf_counter() - start:6.0f} s] {index}/{len(runs)} {run_name(run)} ...", end=" ", flush=True)
        row = run_arm(args, sources, run)
        results["runs"].append(row)
        results["wall_s"] = time.perf_counter() - start
        write_outputs(results, args.out)  # after every arm: an interrupted study keeps what it measured
        if row["status"] == "ok":
            eps = row.get("epsilon_spent")
            print(f"acc {row['val_acc'] * 100:.1f}%  ε {'∞' if eps is None else f'{eps:.3f}'}  steps {row['steps']}  "
                  f"step {row['step_time_s'] or 0:.2f} s  peak {row['peak_rss_mb']:.0f} MB  "
                  f"({row['process_wall_s']:.0f} s)", flush=True)
        else:
            print(f"FAILED: {row['message']} (log: {row['log']})", flush=True)
    results["complete"] = True
    results["wall_s"] = time.perf_counter() - start
    if git_info() != results["git"]:
        results["git"]["changed_during_run"] = git_info()
    write_outputs(results, args.out)
    print((args.out / "table.md").read_text())
    print(f"wrote {_relative(args.out / 'results.json')}, table.md, chart.png in {results['wall_s'] / 60:.1f} min",
          flush=True)


if __name__ == "__main__":
    main()
