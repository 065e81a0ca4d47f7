"""One arm of a study: ``dplit`` with a shipped config and overrides, in its own process, measured.

The parent calls :func:`run_arm`; the child (``python -m bench.study.arm SPEC``) runs dplit's own CLI
(``dplit.cli.lightning_cli.run_cli``), validates once after training, and writes what it measured (validation accuracy, ε spent,
steps, σ, step times from :class:`~bench.study.step_timer.StepTimer`, peak memory, trainable parameters by kind) as
JSON. This module imports no Lightning: the parent (a study, ``bench.audit``) plans, launches and tabulates only.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.machine import child_environment
from bench.study.record import ROOT, relative


def __getattr__(name: str) -> Any:
    """``bench.study.arm.StepTimer``: the commands recorded before it moved to :mod:`bench.study.step_timer` still run.

    Imported on first use only, in an arm's process: the parents of the arms (the studies, ``bench.audit``) import this
    module and never Lightning (seconds per process).
    """
    if name == "StepTimer":
        from bench.study.step_timer import StepTimer

        return StepTimer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def child_main(spec_json: str) -> None:
    """Run one arm (``spec``: {"args": dplit argv, "result": path, "threads": n}) and write its measurements as JSON."""
    spec = json.loads(spec_json)
    import resource

    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from dplit.backbone.adapters import trainable_counts
    from dplit.backbone.embeddings import is_tied
    from dplit.callbacks import peak_memory_mb
    from dplit.cli.lightning_cli import run_cli
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
        "trainable": vars(trainable_counts(model, model.backbone)),  # adapter / embedding / other / frozen
        "steps": int(trainer.global_step) if fit else 0,
        "epsilon_spent": (accountant.epsilon() if accountant is not None else (0.0 if not fit else None)),
        "delta": accountant.delta if accountant is not None else None,
        "accountant_steps": accountant.steps if accountant is not None else None,
        "noise_multiplier": strategy.noise_multiplier if private else None,
        "sample_rate": strategy.dpsgd.sample_rate if private and fit else None,
        "ledger_epsilon": ledger.get("epsilon") if ledger else None,
        "noise": ledger.get("noise") if ledger else None,
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


_RUNNING: list[subprocess.Popen] = []
"""The arm processes now running (each in its own session, so a timeout can kill it with everything it started)."""


_STOPPING = threading.Event()
"""Set by a stop signal: no arm starts after it, and the arms it killed are not recorded (a rerun runs them)."""


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT/SIGHUP of the study: kill the running arms too (each in its own session), then exit."""
    _STOPPING.set()
    for process in _RUNNING[:]:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(f"stopped by signal {signal.Signals(signum).name}; results so far are in results.json")


def install_stop_handlers() -> None:
    """SIGTERM, SIGINT and SIGHUP of the study also kill the arm then running."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop)


def run_process(command: list[str], log_path: Path, *, header: str, threads: int, timeout: float) -> str | None:
    """Run ``command`` in its own session, its output to ``log_path``; ``None`` when it exits 0, else why it failed.

    Args:
        command: the program and its arguments.
        log_path: the file its standard output and error go to (``header`` is its first line).
        header: the command as a reader would type it.
        threads: torch threads (0: torch's default), through :func:`child_environment`.
        timeout: seconds before it is killed, with everything it started.
    """
    problem = None
    with open(log_path, "w") as log:
        log.write(header + "\n")
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env=child_environment(threads), start_new_session=True)
        _RUNNING.append(process)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code, problem = None, f"timed out after {timeout:.0f} s (--timeout)"
        finally:
            _RUNNING.remove(process)
    if code == 0:
        return None
    if problem is None:
        problem = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return problem + "; " + (errors or lines or [""])[-1][:300]


def run_arm(name: str, argv: list[str], arm_dir: Path, *, threads: int, timeout: float) -> dict[str, Any]:
    """Run ``dplit <argv>`` as one arm in its own process; its measurements (or why it failed) as a row.

    Args:
        name: the arm's name in the row.
        argv: the dplit command line after ``dplit`` (``fit`` or ``validate``, a shipped config, overrides).
        arm_dir: where its log, result and Lightning logs go (the command's ``--trainer.default_root_dir``).
        threads: torch threads of the arm (0: torch's default).
        timeout: seconds before the arm is killed and reported as failed.
    """
    arm_dir.mkdir(parents=True, exist_ok=True)
    result_path = arm_dir / "result.json"
    result_path.unlink(missing_ok=True)
    spec = json.dumps({"args": argv, "result": str(result_path), "threads": threads})
    command = [sys.executable, "-m", "bench.study.arm", spec]
    log_path = arm_dir / "output.log"
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    problem = run_process(command, log_path, header="dplit " + shlex.join(argv), threads=threads, timeout=timeout)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"name": name, "dplit_command": "dplit " + shlex.join(argv)}
    if problem is None and result_path.is_file():
        row.update(json.loads(result_path.read_text()))
    else:
        row.update({"status": "failed", "message": problem or "wrote no result.json"})
    row["process_wall_s"] = wall
    row["load_avg_before"] = load_before
    row["load_avg_after"] = os.getloadavg()[0]
    row["log"] = relative(log_path)
    return row


def run_all(
    runs: list[dict[str, Any]],
    results: dict[str, Any],
    *,
    command: Callable[[dict[str, Any], Path], list[str]],
    logs: Path,
    threads: int,
    timeout: float,
    write: Callable[[dict[str, Any]], None],
    jobs: int = 1,
) -> None:
    """Run every arm, ``jobs`` at a time in the given order, appending its row to ``results["runs"]``.

    The results are written as each arm ends (an interrupted study keeps what it measured).

    Args:
        runs: the arms to run, each a dict with its ``name`` (and whatever the study keys it by).
        results: the study's record; ``runs`` and ``wall_s`` are filled in here (``wall_s`` accumulates).
        command: an arm's dplit command line, given the arm and its log folder.
        logs: the folder of every arm's log folder.
        threads: torch threads per arm.
        timeout: seconds per arm.
        write: writes ``results``.
        jobs: arms running at once (each in its own process, with ``threads`` threads).
    """
    start = time.perf_counter()
    wall_before = results.get("wall_s", 0.0)
    lock = threading.Lock()

    def one(index: int, run: dict[str, Any]) -> None:
        if _STOPPING.is_set():
            return
        folder = logs / run["name"]
        row = {**run, **run_arm(run["name"], command(run, folder), folder, threads=threads, timeout=timeout)}
        with lock:
            if _STOPPING.is_set():
                return
            results["runs"].append(row)
            results["wall_s"] = wall_before + time.perf_counter() - start
            write(results)
            print(f"[{time.perf_counter() - start:6.0f} s] {index}/{len(runs)} {run['name']}: {_outcome(row)}",
                  flush=True)

    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for future in [pool.submit(one, index, run) for index, run in enumerate(runs, 1)]:
            future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    results["wall_s"] = wall_before + time.perf_counter() - start


def _outcome(row: dict[str, Any]) -> str:
    """One line on how an arm ended, for the study's progress output."""
    if row["status"] != "ok":
        return f"FAILED: {row['message']} (log: {row['log']})"
    eps = row.get("epsilon_spent")
    return (f"acc {row['val_acc'] * 100:.1f}%  ε {'∞' if eps is None else f'{eps:.3f}'}  steps {row['steps']}  "
            f"step {row['step_time_s'] or 0:.2f} s  peak {row['peak_rss_mb']:.0f} MB  ({row['process_wall_s']:.0f} s)")


if __name__ == "__main__":
    child_main(sys.argv[1])
