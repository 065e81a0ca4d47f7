"""SmolLM2-135M-Instruct on GLUE SST-2, the real model and task the studies train: where each comes from.

Offline the GGUF checkpoint and the GLUE TSVs of the shared data folder (``$DPLIT_DATA_DIR``); ``--hub`` for the
Hugging Face hub. Prepared once per study: a float32 copy of the GGUF (checked to hold the same tensors and token
ids), and a length-sorted copy of dev.tsv (less padding, same accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import child_environment
from bench.study.record import ROOT, relative, version

HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_DIR = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SST2_DIR = "glue/sst2"
DEV_ROWS = 872
TRAIN_ROWS = 67349
"""Rows of GLUE SST-2's train.tsv (``--train-examples 0``: all of them)."""
LABEL_WORDS = {"0": " negative", "1": " positive"}
TEMPLATE = "Review: {sentence}\nSentiment:"  # as configs/smollm2_sst2_*.yaml: an instruct model's natural prompt


def add_study_arguments(parser: argparse.ArgumentParser, *, name: str, train_rows: int, timeout: float) -> None:
    """The flags every CPU SST-2 study shares: rows, batch, ε, lr, lengths, threads, jobs, folders (``name``'s).

    Args:
        parser: the study's parser.
        name: the study's folder name under bench/results and bench/out.
        train_rows: the default number of SST-2 train rows.
        timeout: the default seconds per run.
    """
    add = parser.add_argument
    add("--train-rows", type=int, default=train_rows, help="the first N rows of SST-2 train")
    add("--eval-examples", type=int, default=256, help="the first N dev rows")
    add("--batch-size", type=int, default=8, help="expected rows per Poisson batch")
    add("--epsilon", type=float, default=8.0)
    add("--lr", type=float, default=5e-4)
    add("--max-length", type=int, default=64)
    add("--eval-batch-size", type=int, default=32)
    add("--physical-batch-size", type=int, default=16)
    add("--epochs", type=int, default=1)
    add("--threads", type=int, default=1, help="torch threads per run")
    add("--jobs", type=int, default=2, help="runs at once")
    add("--timeout", type=float, default=timeout, help="seconds per run")
    add("--out", type=Path, default=ROOT / "bench" / "results" / name)
    add("--logs", type=Path, default=ROOT / "bench" / "out" / name, help="logs (git-ignored)")
    add("--dry-run", action="store_true", help="print each run's dplit command and exit")


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags choosing the checkpoint and SST-2 (local GGUF and TSVs by default, or the hub)."""
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


def source_overrides(sources: dict[str, Any]) -> list[str]:
    """The dplit flags that point a SmolLM2 SST-2 config at the resolved checkpoint, tokenizer and TSVs."""
    command = ["--model.pretrained", sources["pretrained"], "--data.tokenizer", sources["pretrained"]]
    if sources["gguf_file"]:
        command += ["--model.gguf_file", sources["gguf_file"], "--data.gguf_file", sources["gguf_file"]]
    command += ["--data.data_dir", str(sources["data_dir"]) if sources["data_dir"] else "null"]
    if sources.get("max_eval_examples") is not None:  # else the sorted dev copy holds exactly the rows to validate on
        command += ["--data.max_eval_examples", str(sources["max_eval_examples"])]
    return command


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve the sources, then (unless ``args.dry_run``) dequantise the GGUF once and sort dev.tsv."""
    sources = resolve_sources(args)
    return sources if args.dry_run else prepare_dev(args, prepare_checkpoint(args, sources))


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
             "transformers": version("transformers"), "max_length": args.max_length}
    stamp_path = cache / "dplit_tying_stamp.json"
    if not (stamp_path.is_file() and json.loads(stamp_path.read_text()).get("source") == stamp):
        print(f"dequantising {gguf.name} once into {relative(cache)} ...", end=" ", flush=True)
        started = time.perf_counter()
        spec = {"folder": sources["pretrained"], "gguf_file": sources["gguf_file"], "cache": str(cache),
                "data_dir": str(sources["data_dir"]) if sources["data_dir"] else None, "stamp": stamp,
                "max_length": args.max_length, "train_examples": 5000}
        done = subprocess.run([sys.executable, "-m", "bench.study.sst2", json.dumps(spec)], cwd=ROOT,
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

    from dplit.backbone.causal_lm import build_causal_lm
    from dplit.backbone.embeddings import is_tied
    from dplit.data import GlueDataModule

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
            "dev_order": f"the {len(rows)} dev rows sorted by sentence length (a copy, {relative(target)})"}


def prepare_holdout(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, Any]:
    """Sources whose dev split is the LAST ``args.holdout_rows`` rows of SST-2 train (sorted by length), for sweeps.

    A learning-rate sweep validates on these training rows, never on the dev set. They lie after every row a study
    arm trains on (``--train-examples`` takes the first rows), and :func:`sweep_train_rows` keeps a sweep's training
    rows clear of them.
    """
    original = Path(sources.get("original_data_dir") or sources["data_dir"] or "")
    if sources["data_dir"] is None or not (original / "train.tsv").is_file():
        raise SystemExit("the non-private learning-rate sweep needs SST-2 train.tsv as a local file (its held-out "
                         "slice is written beside it): give --data-dir or --data-root, or leave out the non_private arm")
    lines = (original / "train.tsv").read_text(encoding="utf-8-sig").splitlines(keepends=True)
    header, rows = lines[0], [line for line in lines[1:] if line.strip()]
    if args.holdout_rows < 1 or args.holdout_rows >= len(rows):
        raise SystemExit(f"--holdout-rows {args.holdout_rows} must be between 1 and {len(rows) - 1} "
                         f"({original / 'train.tsv'} has {len(rows)} rows)")
    held_out = sorted(rows[-args.holdout_rows:], key=lambda line: len(line.split("\t")[0]))
    folder = args.logs / "data" / "sst2-holdout"
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / "dev.tsv.tmp"
    temporary.write_text(header + "".join(line if line.endswith("\n") else line + "\n" for line in held_out),
                         encoding="utf-8")
    os.replace(temporary, folder / "dev.tsv")
    link = folder / "train.tsv"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to((original / "train.tsv").resolve())
    return {**sources, "data_dir": str(folder.resolve()), "max_eval_examples": None, "train_rows_total": len(rows),
            "dev_order": f"the last {args.holdout_rows} rows of SST-2 train.tsv (held out), sorted by length"}


def sweep_train_rows(rows: int | None, holdout: dict[str, Any], holdout_rows: int) -> int:
    """A sweep's training rows: the study scale's first ``rows``, stopping before the held-out slice."""
    clear = holdout["train_rows_total"] - holdout_rows
    return clear if rows is None else min(rows, clear)


def subset_description(args: argparse.Namespace, sources: dict[str, Any], rows: int | None) -> dict[str, Any]:
    """Which training rows a scale uses (the first ``rows``; ``None``: all), with their label balance when local."""
    info: dict[str, Any] = {
        "rule": f"the first {rows} rows of SST-2 train" if rows else
                f"the whole SST-2 train split ({TRAIN_ROWS:,} rows)",
        "rows": rows,
        "dev_rows": args.eval_examples or DEV_ROWS,
        "dev_rule": "the whole SST-2 dev split" if not args.eval_examples else f"the first {args.eval_examples} dev rows",
    }
    info["dev_order"] = sources.get("dev_order")
    if sources["data_dir"] is not None:
        path = Path(sources.get("original_data_dir") or sources["data_dir"]) / "train.tsv"
        info["source"] = str(path)
        with path.open(encoding="utf-8-sig") as file:
            next(file)
            labels = [line.rstrip("\n").split("\t")[-1] for line, _ in zip(file, range(rows or 10**9), strict=False)]
        info["rows"] = len(labels)
        info["positive_share"] = sum(label == "1" for label in labels) / max(1, len(labels))
    else:
        info["source"] = "nyu-mll/glue (hub)"
    return info


def input_files(sources: dict[str, Any]) -> dict[str, Path]:
    """The local files an arm reads, by role: SST-2's train.tsv and dev.tsv as the arm sees them, and the GGUF file.

    The GGUF is the one a dequantised copy was made from, else the one the arms load; hub sources name no file.
    """
    files = {name: Path(sources["data_dir"]) / name for name in ("train.tsv", "dev.tsv")} if sources["data_dir"] else {}
    if sources.get("gguf_source"):
        files["gguf"] = Path(sources["gguf_source"])
    elif sources.get("gguf_file"):
        files["gguf"] = Path(sources["pretrained"]) / sources["gguf_file"]
    return files


def model_line(sources: dict[str, Any]) -> str:
    """The checkpoint every arm trained, in a sentence for a table."""
    if sources.get("gguf_source"):
        return (f"`{Path(sources['gguf_source']).name}` (SmolLM2-135M-Instruct, tied), dequantised once to float32 "
                f"through dplit's loaders and loaded by every arm from `{relative(Path(sources['pretrained']))}` "
                "(same tensors and token ids, checked)")
    name = sources["pretrained"] + (f" / {sources['gguf_file']}" if sources.get("gguf_file") else "")
    return f"`{name}` ({sources['kind']})"


if __name__ == "__main__":
    convert_main(sys.argv[1])
