"""Run the benchmark suite: every configuration in its own process, then results.json, table.md, chart.png.

    python -m bench.run --quick              # tiny model, B=8, T=128: a few minutes on 2 CPU cores
    python -m bench.run                      # GPT-2 and DistilGPT-2 size, B in {8, 16}, T=128 (hours on CPU)
    python -m bench.run --models gpt2 --batch-sizes 16     # the size the targets are stated for
    python -m bench.run --models smollm2 --batch-sizes 16 --seq-len 64   # SmolLM2-135M's shape -> results/smollm2

Configurations (``method:policy``), all on the same random-init label-word CausalLMClassifier, batch and length:
non-private (tied and untied, the baselines of the ratios), dplit ghost (untied, tied), dplit per-example tied
(the materialising baseline libraries fall back to for tied weights), opacus hooks and ghost on the untied model,
opacus ghost on the tied model (refused by opacus: reported as such) and opacus hooks on the tied model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.machine import child_environment, git_info, machine_info
from bench.models import MODELS
from bench.process_stats import cpu_jiffies
from bench.rows import METHOD_NAMES, row_key
from bench.step import PRECISIONS
from bench.targets import BUSY

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = (
    "non_private:untied",
    "non_private:tied",
    "dplit_ghost:untied",
    "dplit_ghost:tied",
    "dplit_per_example:tied",
    "opacus_hooks:untied",
    "opacus_ghost:untied",
    "opacus_ghost:tied",
    "opacus_hooks:tied",
)


LORA_CONFIGS = (
    "non_private:tied",
    "dplit_ghost:tied",
    "non_private_lora:tied",
    "dplit_ghost_lora:tied",
    "dplit_ghost_lora_embedding:tied",
    "opacus_hooks_lora:tied",
    "opacus_ghost_lora:tied",
    "opacus_ghost_lora_embedding:tied",
)
"""``--lora``: LoRA (rank 8 on every projection) against full fine-tuning and opacus, on the tied model."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The suite's arguments: the defaults of ``--quick``, ``--lora`` or the full suite filled in, configs parsed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model (2 layers, 128 wide, full vocabulary), B=8")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=None,
                        help="model sizes (default gpt2 distilgpt2; tiny with --quick); smollm2: SmolLM2-135M's "
                             "shape (Llama, 30 layers, width 576), its targets are stated for --batch-sizes 16 "
                             "--seq-len 64")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--task", choices=("classify", "lm", "dpo"), default="classify",
                        help="lm: the causal-LM step (next-token loss at every position) -> results/lm; dpo: the "
                             "DPO step (B pairs of two rows, the reference pass counted in every method) -> results/dpo")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--configs", nargs="+", default=None, metavar="METHOD:POLICY",
        help="configurations to run (default: all listed above); non_private of a policy is needed for that policy's "
        "ratios; dplit ones run the shipped DP-SGD object (dplit.privacy.dpsgd.DPSGD)",
    )
    parser.add_argument("--lora", action="store_true",
                        help="the LoRA rows (default --configs " + " ".join(LORA_CONFIGS) + ") -> results/lora")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2 quick, 3 full)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps, median reported (default 5 quick, 3 full)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per configuration (default 300 quick, 3600)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda[:i]")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch default)")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true",
                        help="32-true (default) or bf16-mixed (bf16 autocast around forward and loss, as Lightning's "
                             "bf16-mixed and the shipped GPU configs)")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results/quick with --quick, else bench/results)")
    parser.add_argument("--append", action="store_true",
                        help="keep rows of other configurations already in OUT/results.json (same machine)")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                        help="before each configuration wait up to this long for other processes to leave the CPUs "
                             "idle (for shared machines; 0: do not wait)")
    parser.add_argument("--retries", type=int, default=0,
                        help=f"rerun a configuration (up to this many times, after waiting for idle CPUs) when other "
                             f"processes used more than {BUSY * 100:.0f}%% of the CPUs during its timed steps; the least "
                             "disturbed attempt is kept")
    parser.add_argument("--logs", type=Path, default=ROOT / "bench" / "out" / "logs",
                        help="each configuration's stdout/stderr goes here (git-ignored)")
    args = parser.parse_args(argv)
    args.models = args.models or (["tiny"] if args.quick else ["gpt2", "distilgpt2"])
    args.batch_sizes = args.batch_sizes or ([8] if args.quick else [8, 16])
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)  # see README: steady state
    args.steps = args.steps if args.steps is not None else (5 if args.quick else 3)
    args.timeout = args.timeout or (300.0 if args.quick else 3600.0)
    only_smollm2 = set(args.models) <= {"smollm2", "smollm2_tiny"}  # its own folder: the GPT-2 results stay as they are
    folder = "lora" if args.lora else args.task if args.task in ("lm", "dpo") else "quick" if args.quick else "smollm2" if only_smollm2 else ""
    args.configs = args.configs or list(LORA_CONFIGS if args.lora else DEFAULT_CONFIGS)
    args.out = args.out or ROOT / "bench" / "results" / folder
    configs = []
    for config in args.configs:
        method, _, policy = config.partition(":")
        if method not in METHOD_NAMES or policy not in ("tied", "untied"):
            parser.error(f"bad configuration {config!r}: use METHOD:POLICY, e.g. dplit_ghost:tied")
        configs.append((method, policy, STEP_NOISE))
    args.configs = configs
    return args


def machine_busy(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPUs busy over the next ``seconds`` (0..1)."""
    busy0, total0 = cpu_jiffies()
    time.sleep(seconds)
    busy1, total1 = cpu_jiffies()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_for_idle(max_wait: float, threshold: float = 0.15) -> float:
    """Wait (at most ``max_wait`` s) until other processes use under ``threshold`` of the CPUs; return the last share."""
    deadline = time.monotonic() + max_wait
    busy = machine_busy()
    while busy >= threshold and time.monotonic() < deadline:
        time.sleep(4.0)
        busy = machine_busy()
    return busy


STEP_NOISE = "strategy"
"""What results rows record as ``privatize`` for dplit methods: the shipped DP-SGD object (older rows also name the
ablations ``flat`` and ``per_parameter`` of a copy, retired in issue 33)."""


def run_one(
    args: argparse.Namespace, method: str, policy: str, privatize: str, model: str, batch: int
) -> dict[str, Any]:
    """Run one configuration in a fresh process; a crash, kill or timeout becomes a ``failed`` row."""
    dplit = method.startswith("dplit")
    name = f"{model}-B{batch}-T{args.seq_len}-{method}-{policy}" + (f"-{privatize}" if dplit else "")
    args.logs.mkdir(parents=True, exist_ok=True)
    log_path = args.logs / f"{name}.log"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable, "-m", "bench.step", "--method", method, "--policy", policy, "--model", model,
            "--batch-size", str(batch), "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--task", args.task,
            "--steps", str(args.steps), "--sigma", str(args.sigma), "--max-grad-norm", str(args.max_grad_norm),
            "--device", args.device, "--threads", str(args.threads),
            "--precision", args.precision, "--out", str(out),
        ]
        busy_before = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else None
        start = time.perf_counter()
        with open(log_path, "w") as log:
            log.write(shlex.join(command) + "\n")
            log.flush()
            try:
                done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                      env=child_environment())
                code, problem = done.returncode, None
            except subprocess.TimeoutExpired:
                code, problem = None, f"timed out after {args.timeout:.0f} s (--timeout)"
        wall = time.perf_counter() - start
        if out.exists():
            row = json.loads(out.read_text())
        else:
            if problem is None:
                if code is not None and code < 0:
                    problem = f"killed by signal {signal.Signals(-code).name}" + (
                        " (out of memory?)" if code == -signal.SIGKILL else "")
                else:
                    problem = f"exited with code {code}"
            lines = log_path.read_text().strip().splitlines() if log_path.exists() else []
            tail = [line.strip() for line in lines[1:] if line.strip() and "warn" not in line.lower()][-1:]
            row = {"method": method, "policy": policy, "privatize": privatize if dplit else None, "model": model,
                   "batch": batch, "seq_len": args.seq_len,
                   "status": "failed", "message": problem + (f"; last log line: {tail[0][:200]}" if tail else ""),
                   "step_time_s": None, "peak_mem_mb": None}
    row["process_wall_s"] = wall
    row["machine_busy_before"] = busy_before
    row["log"] = str(log_path.relative_to(ROOT)) if log_path.is_relative_to(ROOT) else str(log_path)
    return row


def assemble(
    args: argparse.Namespace,
    header: dict[str, Any],
    previous: list[dict[str, Any]],
    earlier_runs: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    suite_wall_s: float,
) -> dict[str, Any]:
    """The results document: this run's rows after the kept rows of earlier runs (``--append``), settings, runs."""
    fresh = {row_key(r) for r in rows}
    kept = [r for r in previous if row_key(r) not in fresh]
    results = {
        **header,
        "settings": {"seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps, "sigma": args.sigma,
                     "max_grad_norm": args.max_grad_norm, "privatize": STEP_NOISE, "device": args.device,
                     "precision": args.precision, "timeout_s": args.timeout, "suite_wall_s": suite_wall_s},
        "rows": kept + rows,
    }
    this_run = {"created": header["created"], "command": header["command"], "git": header["git"]}
    results["runs"] = (earlier_runs if kept else []) + [this_run]  # every run whose rows are in this file
    return results


def write_partial(results: dict[str, Any], out: Path) -> None:
    """results.json so far (``complete: false``), replaced atomically: a killed suite keeps its measured rows."""
    out.mkdir(parents=True, exist_ok=True)
    temporary = out / "results.json.tmp"
    temporary.write_text(json.dumps({**results, "complete": False}, indent=2) + "\n")
    os.replace(temporary, out / "results.json")


def main(argv: list[str] | None = None) -> None:
    """Run every configuration of the suite, each in its own process, and write results.json, table.md and chart.png.

    Rows are written as each configuration ends (``--append`` keeps an earlier suite's); a configuration measured while
    other processes kept the CPUs busy is retried up to ``--retries`` times, keeping the quieter measurement.
    """
    args = parse_args(argv)
    command = "python -m bench.run " + shlex.join(argv if argv is not None else sys.argv[1:])
    machine = machine_info(threads=args.threads, device=args.device)
    git_at_start = git_info("dplit")  # the dplit that the configurations import (re-checked at the end)
    print(f"machine: {report.machine_line(machine)}", flush=True)
    previous: list[dict[str, Any]] = []
    earlier_runs: list[dict[str, Any]] = []
    results_path = args.out / "results.json"
    if args.append and results_path.exists():
        earlier = json.loads(results_path.read_text())
        previous = earlier["rows"]
        earlier_runs = earlier.get("runs") or [{key: earlier.get(key) for key in ("created", "command", "git")}]
    header = {"created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command,
              "machine": machine, "git": git_at_start}
    rows: list[dict[str, Any]] = []
    configs = sorted(args.configs, key=lambda c: c[0] != "non_private")  # baselines first
    suite_start = time.perf_counter()
    for model in args.models:
        for batch in args.batch_sizes:
            for method, policy, privatize in configs:
                label = f"{method}:{policy}" + (f":{privatize}" if method.startswith("dplit") else "")
                print(f"[{time.perf_counter() - suite_start:7.0f} s] {model} B={batch} T={args.seq_len} {label} ...",
                      end=" ", flush=True)
                row = run_one(args, method, policy, privatize, model, batch)
                for attempt in range(args.retries):
                    if row["status"] != "ok" or (row.get("others_share") or 0.0) <= BUSY:
                        break
                    print(f"(other processes used {row['others_share']:.0%} of the CPUs: retry {attempt + 1})",
                          end=" ", flush=True)
                    wait_for_idle(max(args.wait_idle, 180.0))
                    again = run_one(args, method, policy, privatize, model, batch)
                    if again["status"] == "ok" and again["others_share"] < row["others_share"]:
                        row = again
                rows.append(row)
                write_partial(assemble(args, header, previous, earlier_runs, rows, time.perf_counter() - suite_start),
                              args.out)
                timing = f"{row['step_time_s']:.3f} s/step" if row.get("step_time_s") else ""
                memory = f"{row['peak_mem_mb']:.0f} MB peak" if row.get("peak_mem_mb") else ""
                print(f"{row['status']} {timing} {memory} {row.get('message', '')[:120]}", flush=True)
    results = {**assemble(args, header, previous, earlier_runs, rows, time.perf_counter() - suite_start),
               "complete": True}
    git_at_end = git_info("dplit")
    if git_at_end != git_at_start:
        git_at_start["changed_during_run"] = git_at_end["describe"]  # the same dict as this run's entry in "runs"
        print(f"warning: dplit changed during the run ({git_at_start['describe']} -> "
              f"{results['git']['changed_during_run']}); rerun for clean numbers", flush=True)
    print(report.write(results, args.out))
    print(f"wrote {args.out / 'results.json'}, table.md" + (", chart.png" if report.can_chart() else ""), flush=True)


if __name__ == "__main__":
    main()
