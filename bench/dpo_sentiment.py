"""Controlled sentiment (DPO paper §6.1) on SST-2: the preference data build, and the DP-DPO study over it.

``python -m bench.dpo_sentiment build``: prompts are the first ``--prefix-words`` words of SST-2 sentences (train
sentences for the training pairs, dev sentences for the held-out pairs and prompts); two continuations per prompt are
sampled from the reference model; the one the judge (:mod:`bench.sentiment_judge`, trained on SST-2 train rows that
are no part of a prompt's sentence, scored on dev) finds more positive is chosen, and a tie is dropped. Writes
``train.jsonl``, ``val.jsonl``, ``eval_prompts.jsonl``, ``judge.json`` and ``build.json`` (counts, the judge's dev
accuracy, the settings) to ``--out``.

``python -m bench.dpo_sentiment study``: the reference, non-private DPO and DP-DPO at each ``--epsilons`` (all LoRA,
``configs/smollm2_dpo_lora.yaml``), for each seed, each run in its own process; resumable like the other studies
(:mod:`bench.study.resume`). Each run records held-out reward accuracy (``val.jsonl``), the judge's positive rate of
continuations sampled on the held-out prompts, and the KL to the reference of those samples (the mean over samples of
log π(y|x) − log π_ref(y|x), a Monte Carlo estimate of KL(π‖π_ref) per prompt). ``table.md`` gives the mean and the
95% t-interval over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.sentiment_judge import SentimentJudge
from bench.study.arm import install_stop_handlers, run_process
from bench.study.record import ROOT, git_info, machine_description, machine_info, relative, write_json
from bench.study.resume import earlier_sitting, planned_runs, render, study_settings

CONFIG = ROOT / "configs" / "smollm2_dpo_lora.yaml"
NAME = "dpo_sentiment"


def read_sst2(path: Path) -> tuple[list[str], list[int]]:
    """The sentences and labels of a GLUE SST-2 TSV file (quoting off, header: sentence, tab, label)."""
    rows = [line.rstrip("\n").split("\t") for line in path.read_text(encoding="utf-8").splitlines()[1:] if line]
    return [row[0].strip() for row in rows], [int(row[1]) for row in rows]


def prompts_of(sentences: list[str], count: int, prefix_words: int, rng: random.Random) -> tuple[list[str], list[str]]:
    """``count`` prompts (the first ``prefix_words`` words) of distinct sentences at least twice as long, and those."""
    long = sorted({s for s in sentences if len(s.split()) >= 2 * prefix_words})
    chosen = rng.sample(long, min(count, len(long)))
    return [" ".join(s.split()[:prefix_words]) for s in chosen], chosen


def load_model(model: str, gguf_file: str | None) -> tuple[Any, Any]:
    """The reference model (eval mode) and its tokenizer, by dplit's own loaders (a folder, hub name or GGUF)."""
    from dplit.backbone.causal_lm import build_causal_lm
    from dplit.data.tokenizer import load_tokenizer

    backbone = build_causal_lm(pretrained=model, gguf_file=gguf_file, config=None, vocab_size=None, dropout=None,
                               attn_implementation="eager")  # fmt: skip
    return backbone.eval(), load_tokenizer(model, gguf_file)


def sample(backbone: Any, tokenizer: Any, prompt: str, count: int, new_tokens: int) -> list[str]:
    """``count`` continuations of ``prompt`` sampled from ``backbone`` (temperature 1, no top-k or top-p)."""
    import torch

    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                                max_new_tokens=new_tokens, num_return_sequences=count,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)  # fmt: skip
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]


def pairs_for(prompts: list[str], judge: SentimentJudge, backbone: Any, tokenizer: Any, new_tokens: int) -> list[dict]:
    """A pair per prompt whose two sampled continuations the judge tells apart (the more positive one chosen)."""
    pairs = []
    for prompt in prompts:
        first, second = sample(backbone, tokenizer, prompt, 2, new_tokens)
        a, b = judge.score(first), judge.score(second)
        if a != b and first.strip() and second.strip() and first.strip() != second.strip():
            chosen, rejected = (first, second) if a > b else (second, first)
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Write the preference data, the held-out prompts and the judge to ``args.out`` (see the module's docstring)."""
    import torch

    sst2 = Path(args.data_dir) / "glue" / "sst2"
    train, train_labels = read_sst2(sst2 / "train.tsv")
    dev, dev_labels = read_sst2(sst2 / "dev.tsv")
    rng = random.Random(args.seed)
    train_prompts, sources = prompts_of(train, args.train_prompts, args.prefix_words, rng)
    eval_prompts, _ = prompts_of(dev, args.eval_prompts, args.prefix_words, rng)
    used = "\n".join(sources)  # a train row that is part of a prompt's sentence does not train the judge
    kept = [i for i, text in enumerate(train) if text not in used]
    judge = SentimentJudge.fit([train[i] for i in kept], [train_labels[i] for i in kept])
    torch.manual_seed(args.seed)
    backbone, tokenizer = load_model(args.model, args.gguf_file)
    train_pairs = pairs_for(train_prompts, judge, backbone, tokenizer, args.new_tokens)
    val_pairs = pairs_for(eval_prompts, judge, backbone, tokenizer, args.new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (
        ("train", train_pairs),
        ("val", val_pairs),
        ("eval_prompts", [{"prompt": p} for p in eval_prompts]),
    ):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "judge.json").write_text(json.dumps(judge.to_json()))
    facts = {"command": "python -m bench.dpo_sentiment " + " ".join(args.argv),
             "settings": {k: str(v) for k, v in vars(args).items() if k not in ("func", "argv")},
             "judge_train_rows": len(kept), "judge_dev_accuracy": judge.accuracy(dev, dev_labels),
             "train_prompts": len(train_prompts), "train_pairs": len(train_pairs),
             "eval_prompts": len(eval_prompts), "val_pairs": len(val_pairs)}  # fmt: skip
    write_json(facts, out / "build.json")
    print(json.dumps(facts, indent=1))
    return facts


# --- one run (its own process) ------------------------------------------------------------------------------------


def child_main(spec: dict[str, Any]) -> None:
    """Train (or, for the reference, only build) one arm with ``dplit dpo``, then measure it; write the row as JSON."""
    import torch

    from dplit.cli.lightning_cli import run_dpo_cli

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cli = run_dpo_cli(spec["args"])
    trainer, model = cli.trainer, cli.model
    validated = trainer.validate(model, datamodule=cli.datamodule, verbose=False)[0]
    accountant = getattr(trainer.strategy, "accountant", None)
    data = Path(spec["data"])
    judge = SentimentJudge(**json.loads((data / "judge.json").read_text()))
    prompts = [json.loads(line)["prompt"] for line in (data / "eval_prompts.jsonl").read_text().splitlines()]
    samples = judged_samples(model, cli.datamodule.tokenizer, prompts, judge, spec)
    row = {"status": "ok", "reward_accuracy": float(validated["val/reward_accuracy"]),
           "val_loss": float(validated["val/loss"]), "steps": int(trainer.global_step),
           "epsilon_spent": accountant.epsilon() if accountant is not None and trainer.global_step else None,
           "delta": accountant.delta if accountant is not None else None,
           **samples}  # fmt: skip
    Path(spec["result"]).write_text(json.dumps(row, indent=1))


def judged_samples(model: Any, tokenizer: Any, prompts: list[str], judge: SentimentJudge, spec: dict) -> dict:
    """The judge's positive rate of continuations sampled from the policy, and their log-ratio to the reference."""
    import torch

    torch.manual_seed(spec["seed"])
    model.eval()
    positive, ratios = [], []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)], device=model.device)
        with torch.no_grad():
            out = model.backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                          top_p=1.0, max_new_tokens=spec["new_tokens"],
                                          pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)  # fmt: skip
            mask = torch.ones_like(out)
            answer = torch.zeros_like(out)
            answer[:, ids.shape[1] :] = 1
            ratios.append(
                float(
                    _log_prob(model(out, mask), out, answer) - _log_prob(model.reference_logits(out, mask), out, answer)
                )
            )
        positive.append(judge.positive(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    return {"positive_rate": statistics.fmean(positive), "kl_to_reference": statistics.fmean(ratios),
            "eval_prompts": len(prompts)}  # fmt: skip


def _log_prob(logits: Any, ids: Any, answer: Any) -> Any:
    """The log-probability of the ``answer`` tokens of row 0 under next-token ``logits``."""
    import torch.nn.functional as F  # noqa: N812

    token = -F.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="none")
    return (token * answer[0, 1:]).sum()


# --- the study ------------------------------------------------------------------------------------------------------


def arms(epsilons: list[float]) -> dict[str, dict[str, Any]]:
    """The reference (no training), non-private DPO and DP-DPO at each ε."""
    fields: dict[str, dict[str, Any]] = {"reference": {"epsilon": None, "trained": False},
                                         "non_private": {"epsilon": None, "trained": True}}  # fmt: skip
    for epsilon in epsilons:
        fields[f"dp_eps{epsilon:g}"] = {"epsilon": epsilon, "trained": True}
    return fields


def dplit_args(args: argparse.Namespace, run: dict[str, Any], folder: Path) -> list[str]:
    """The ``dplit dpo`` command line of one run (``validate`` for the reference)."""
    data = Path(args.data)
    model = ["--model.pretrained", args.model, "--data.tokenizer", args.model]
    if args.gguf_file:
        model += ["--model.gguf_file", args.gguf_file, "--data.gguf_file", args.gguf_file]
    argv = ["fit" if run["trained"] else "validate", "--config", str(CONFIG), *model,
            "--seed_everything", str(run["seed"]), "--trainer.default_root_dir", str(folder),
            "--trainer.accelerator", args.accelerator, "--trainer.precision", args.precision,
            "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", str(args.epochs),
            "--data.train_file", str(data / "train.jsonl"), "--data.val_file", str(data / "val.jsonl"),
            "--data.batch_size", str(args.batch_size), "--data.eval_batch_size", str(args.eval_batch_size),
            "--data.max_length", str(args.max_length), "--model.lr", str(args.lr)]  # fmt: skip
    if args.max_steps:
        argv += ["--trainer.max_steps", str(args.max_steps), "--trainer.val_check_interval", str(args.max_steps)]
    if run["trained"] and run["epsilon"] is None:
        argv += ["--trainer.strategy", "auto", "--non_private", "true"]
    elif run["epsilon"] is not None:
        argv += ["--trainer.strategy.init_args.target_epsilon", str(run["epsilon"]),
                 "--trainer.strategy.init_args.max_physical_batch_size", str(args.physical_batch_size)]  # fmt: skip
    return argv + list(args.dplit_args or [])


def run_one(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """Run one (arm, seed) in its own process; its row (or why it failed)."""
    folder = Path(args.logs) / run["name"]
    folder.mkdir(parents=True, exist_ok=True)
    result = folder / "result.json"
    result.unlink(missing_ok=True)
    argv = dplit_args(args, run, folder)
    spec = {"args": argv, "result": str(result), "threads": args.threads, "data": str(Path(args.data).resolve()),
            "seed": run["seed"], "new_tokens": args.new_tokens}  # fmt: skip
    command = [sys.executable, "-m", "bench.dpo_sentiment", "child", json.dumps(spec)]
    problem = run_process(command, folder / "output.log", header="dplit dpo " + " ".join(argv),
                          threads=args.threads, timeout=args.timeout)  # fmt: skip
    row = {**run, "dplit_command": "dplit dpo " + " ".join(argv), "log": relative(folder / "output.log")}
    if problem is None and result.is_file():
        return {**row, **json.loads(result.read_text())}
    return {**row, "status": "failed", "message": problem or "wrote no result.json"}


def interval(values: list[float]) -> str:
    """``mean [low, high]``: the mean and its 95% t-interval over seeds (the mean alone for one seed)."""
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.3f} (1 seed)"
    from scipy.stats import t

    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def table(results: dict[str, Any]) -> str:
    """The study's markdown table: per arm, the seeds finished and each measure's mean and 95% interval."""
    lines = ["| arm | ε spent | seeds | held-out reward accuracy | judge's positive rate | KL to the reference |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms(results["epsilons"]):
        rows = [r for r in results["runs"] if r["arm"] == arm and r.get("status") == "ok"]
        spent = [r["epsilon_spent"] for r in rows if r.get("epsilon_spent") is not None]
        lines.append(f"| {arm} | {max(spent):.2f} |" if spent else f"| {arm} | – |")
        lines[-1] += f" {len(rows)} | " + " | ".join(interval([r[k] for r in rows]) for k in
                                                    ("reward_accuracy", "positive_rate", "kl_to_reference")) + " |"  # fmt: skip
    failed = [r["name"] for r in results["runs"] if r.get("status") != "ok"]
    data = results["build"]
    lines += ["", f"Data: {data['train_pairs']} training pairs, {data['val_pairs']} held-out pairs, "
              f"{data['eval_prompts']} held-out prompts; judge accuracy on SST-2 dev {data['judge_dev_accuracy']:.3f}. "
              f"Machine: {machine_description(results['machine'])}; dplit {results['git']['describe']}."]  # fmt: skip
    return "\n".join(lines + ([f"Failed runs (rerun to retry): {', '.join(failed)}"] if failed else [])) + "\n"


def study(args: argparse.Namespace) -> dict[str, Any]:
    """Run every planned (arm, seed) not yet recorded in ``--out``/results.json; write results.json and table.md."""
    out = Path(args.out)
    if args.render:
        return render(out, table)
    settings = {k: v for k, v in study_settings(args).items() if k not in ("func", "argv")}
    previous, kept = earlier_sitting(out, settings)
    built = Path(args.data) / "build.json"
    if not built.is_file():
        raise SystemExit(f"{built}: no such file; run `python -m bench.dpo_sentiment build` first (or set --data)")
    build_facts = json.loads(built.read_text())
    git, machine = git_info("dplit", "configs", "bench"), machine_info(args.threads)
    runs = planned_runs(args.seeds, arms(args.epsilons), {r["name"] for r in kept}, {"git": git["describe"]})
    if args.dry_run:
        for run in runs:
            print("dplit dpo " + " ".join(dplit_args(args, run, Path(args.logs) / run["name"])))
        return {}
    install_stop_handlers()
    results = {"command": "python -m bench.dpo_sentiment " + " ".join(args.argv), "settings": settings, "machine": machine,
               "git": git, "epsilons": args.epsilons, "build": build_facts, "runs": kept}  # fmt: skip
    for run in runs:
        row = run_one(args, run)
        results["runs"].append(row)
        write_json(results, out / "results.json")
        print(f"{row['name']}: {row['status']}" + (f" ({row['message']})" if row["status"] != "ok" else ""), flush=True)
    write_json(results, out / "results.json")
    (out / "table.md").write_text(table(results))
    print(table(results))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``build`` (the data) or ``study`` (the runs)."""
    parser = argparse.ArgumentParser(prog="python -m bench.dpo_sentiment", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(required=True)
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--model", default=None, help="the reference: a folder or hub name (default: the GGUF SmolLM2)")
    shared.add_argument("--gguf-file", default=None)
    shared.add_argument("--new-tokens", type=int, default=16, help="tokens per sampled continuation")
    shared.add_argument("--seed", type=int, default=0)
    data_dir = Path(os.environ.get("DPLIT_DATA_DIR") or ROOT.parent / "shared" / "data")
    one = commands.add_parser("build", parents=[shared], help="build the preference data (one command)")
    one.add_argument("--data-dir", default=str(data_dir), help="holds glue/sst2/{train,dev}.tsv ($DPLIT_DATA_DIR)")
    one.add_argument("--train-prompts", type=int, default=4000)
    one.add_argument("--eval-prompts", type=int, default=400)
    one.add_argument("--prefix-words", type=int, default=4)
    one.add_argument("--out", default=str(ROOT / "bench" / "out" / NAME / "data"))
    one.set_defaults(func=build)
    two = commands.add_parser("study", parents=[shared], help="run the study (resumable)")
    two.add_argument("--data", default=str(ROOT / "bench" / "out" / NAME / "data"), help="what build wrote")
    two.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    two.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    two.add_argument("--epochs", type=int, default=3)
    two.add_argument("--max-steps", type=int, default=0, help="stop each run after N steps (0: the epochs)")
    two.add_argument("--batch-size", type=int, default=64, help="expected pairs per Poisson batch")
    two.add_argument("--eval-batch-size", type=int, default=32)
    two.add_argument("--physical-batch-size", type=int, default=16)
    two.add_argument("--max-length", type=int, default=48)
    two.add_argument("--lr", type=float, default=1e-3)
    two.add_argument("--accelerator", default="auto")
    two.add_argument("--precision", default="32-true")
    two.add_argument("--threads", type=int, default=0)
    two.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per run")
    two.add_argument("--out", default=str(ROOT / "bench" / "results" / NAME))
    two.add_argument("--logs", default=str(ROOT / "bench" / "out" / NAME / "runs"))
    two.add_argument("--dry-run", action="store_true")
    two.add_argument("--render", action="store_true", help="only re-render table.md from --out's results.json")
    two.add_argument("--dplit-args", nargs=argparse.REMAINDER, help="more dplit overrides, last")
    two.set_defaults(func=study)
    args = parser.parse_args(argv)
    if args.model is None:
        args.model, args.gguf_file = str(data_dir / "smollm2-135m-instruct"), "SmolLM2-135M-Instruct.Q4_1.gguf"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m bench.dpo_sentiment build|study ...``."""
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child_main(json.loads(sys.argv[2]))
    else:
        main()
