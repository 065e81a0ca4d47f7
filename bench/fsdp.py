"""Sharded DP-SGD (FSDP2) against whole replicas and non-private FSDP: step time, per-rank memory and state.

Three arms, each in ``--world-size`` fresh processes of its own (gloo on the CPU, NCCL on CUDA), on bench.step's
random-init label-word CausalLMClassifier (``--size``, default ``smollm2``: SmolLM2-135M's shape, tied), each rank
with its own batch of B random sequences of T tokens; every step ends with AdamW:

* ``dp_fsdp``: ``shard_task`` (FSDP2) and the shipped ``DPSGD`` with ``world=ShardedProcessGroup`` (ghost clipping).
* ``dp_ddp``: the same DPSGD on whole replicas, ``world=ProcessGroup`` (one all-reduce of the clipped sum).
* ``non_private_fsdp``: ``shard_task``, backward of the mean loss (FSDP2's own reduce-scatter).

Per arm: the median step time after ``--warmup`` (wall clock between barriers: the slowest rank's), the busiest
rank's CPU time per timed step (steadier where other processes share the CPUs), the per-rank peak memory (peak RSS
from ``getrusage``: the imported libraries, the whole model as built, the steps' buffers; on CUDA max
allocated) and state bytes (parameters, gradients or the clipped-sum buffer, AdamW state, from the tensors' local
sizes after the last step), max over ranks; the ratios dp_fsdp / non_private_fsdp step time (target ≤ 1.15) and
CPU time, dp_fsdp / dp_ddp state (≤ 0.55) and peak memory. Writes ``results.json`` and ``table.md`` to ``--out``
(default bench/results/fsdp/)::

    python -m bench.fsdp --batch-size 8 --seq-len 32 --warmup 1 --steps 6   # SmolLM2 size, 2 CPU processes
    python -m bench.fsdp --size tiny --steps 1 --out /tmp/fsdp                # tests/bench/test_fsdp.py
    python -m bench.fsdp --device cuda --world-size 1                         # bench/gpu.sh's fsdp_smoke

A rank is a fork of a forkserver that has imported :data:`PRELOAD` (:mod:`bench.fresh_process`) and nothing else: no
tensor, no CUDA, no process group (each rank initialises its own device and group), so the ranks do not pay the
imports (seconds each). A rank's peak RSS starts from the server's resident pages; bench/README.md compares it with
the spawned ranks of older tables (about 80–90 MiB higher per rank at the tiny size, alike in every arm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.fresh_process import process_context, run_ranks
from bench.machine import ROOT, free_port, git_info, machine_info
from bench.models import MODELS, build_model, family, make_batch
from bench.process_stats import cpu_jiffies, current_rss_mb, others_share, peak_rss_mb
from bench.report import machine_line
from bench.targets import Target, busy_note, ratio_table, ratios

ARMS = ("dp_fsdp", "dp_ddp", "non_private_fsdp")
RATIOS = [
    Target("step_time dp_fsdp / non_private_fsdp", "dp_fsdp", "non_private_fsdp", "step_time_s", 1.15),
    Target("CPU time per step dp_fsdp / non_private_fsdp", "dp_fsdp", "non_private_fsdp", "step_cpu_s", None),
    Target("state per rank dp_fsdp / dp_ddp", "dp_fsdp", "dp_ddp", "state_bytes", 0.55),
    Target("peak memory per rank dp_fsdp / dp_ddp", "dp_fsdp", "dp_ddp", "peak_mem_mb", None),
]
Arm = tuple[Callable[[], None], Any, Any]  # an arm's step closure, its AdamW and its DPSGD (None: non-private)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.device_mesh", "transformers", "dplit.tasks.classifier", "dplit.privacy.dpsgd",
           "dplit.privacy.settings", "dplit.backbone.sharding", "dplit.privacy.sharded_world",
           "dplit.privacy.world"]  # fmt: skip
"""What every rank imports (besides its model family's transformers module), imported once by the forkserver."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, with ``--threads`` 0 resolved to the cores per rank on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(MODELS), default="smollm2", help="bench.step's model sizes")
    parser.add_argument("--policy", choices=("tied", "untied"), default="tied", help="input/output embeddings")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per rank and step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps; the median is reported")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo; cuda: NCCL, rank r on GPU r")
    parser.add_argument("--world-size", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: CPUs ÷ ranks on the CPU)")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a sentence for table.md (e.g. what else ran on the machine)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fsdp")
    args = parser.parse_args(argv)
    args.threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.world_size)
    return args


def step_args(args: argparse.Namespace, rank: int = 0) -> argparse.Namespace:
    """What bench.step's ``build_model`` and ``make_batch`` read: rank r's batch is seeded by seed + r."""
    return argparse.Namespace(method="dplit_ghost", policy=args.policy, model=args.size, task="classify",
                              seq_len=args.seq_len, lr=args.lr, batch_size=args.batch_size, seed=args.seed + rank)  # fmt: skip


def dp_step(args: argparse.Namespace, model: Any, batch: dict[str, Any], world: Any) -> Arm:
    """One step of the shipped DPSGD on ``world`` then AdamW (q = 0.01 of 100·B·W placeholder rows)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dplit.privacy.dpsgd import DPSGD
    from dplit.privacy.settings import DPSGDSettings

    settings = DPSGDSettings(max_grad_norm=args.max_grad_norm, noise_multiplier=args.sigma, clipping="ghost",
                             max_physical_batch_size=args.batch_size, self_check=False)  # fmt: skip
    dpsgd = DPSGD(model, settings, history=model.privacy_history, world=world)
    logical = args.batch_size * args.world_size
    dpsgd.sample(DataLoader(TensorDataset(torch.arange(100 * logical)), batch_size=logical))
    dpsgd.start(planned_steps=args.warmup + args.steps)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def step() -> None:
        dpsgd.clip(model.per_example_loss, batch)
        dpsgd.release()
        optimizer.step()

    return step, optimizer, dpsgd


def plain_step(args: argparse.Namespace, model: Any, batch: dict[str, Any]) -> Arm:
    """One non-private step: backward of the mean loss (FSDP2 reduce-scatters the gradients), AdamW."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model.per_example_loss(batch).mean().backward()
        optimizer.step()

    return step, optimizer, None


def state_bytes(model: Any, optimizer: Any, buffer: Any | None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (the buffer, plus grads outside it) and AdamW state (local shards)."""
    from torch.distributed.tensor import DTensor

    def local(tensor: Any) -> Any:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def size(tensors: list[Any]) -> int:
        return sum(local(t).numel() * t.element_size() for t in tensors)

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if buffer is not None:
        storage = buffer.untyped_storage().data_ptr()
        grads = [buffer] + [g for g in grads if local(g).untyped_storage().data_ptr() != storage]
    adam = [v for state in optimizer.state.values() for v in state.values() if hasattr(v, "dim") and v.dim() > 0]
    counts = {"parameters": size(list(model.parameters())), "gradients": size(grads), "optimizer": size(adam)}
    return {**counts, "total": sum(counts.values())}


def build_arm(rank: int, args: argparse.Namespace, arm: str, device: Any) -> tuple[Any, Arm]:
    """This rank's model (sharded by ``shard_task`` unless ``dp_ddp``) and the arm's step on its own batch."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from dplit.backbone.sharding import shard_task
    from dplit.privacy.sharded_world import ShardedProcessGroup
    from dplit.privacy.world import ProcessGroup

    torch.manual_seed(args.seed)  # the same weights on every rank (shard_task broadcasts rank 0's anyway)
    model = build_model(step_args(args), device)
    if arm != "dp_ddp":
        shard_task(model, init_device_mesh(device.type, (args.world_size,)))
    batch = make_batch(step_args(args, rank), device)
    if arm == "non_private_fsdp":
        return model, plain_step(args, model, batch)
    world = (ShardedProcessGroup if arm == "dp_fsdp" else ProcessGroup)(device=device)
    return model, dp_step(args, model, batch, world)


def time_steps(step: Callable[[], None], args: argparse.Namespace, sync: Callable[[], None]) -> dict[str, Any]:
    """Warm-up then timed steps, each between barriers; the machine's CPU ticks and this rank's CPU time timed."""
    import torch.distributed as dist

    times, cpu, jiffies = [], 0.0, cpu_jiffies()
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            jiffies, cpu = cpu_jiffies(), time.process_time()
        sync()
        dist.barrier()
        start = time.perf_counter()
        step()
        sync()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return {"step_times_s": times, "timed_cpu_s": time.process_time() - cpu, "jiffies": [jiffies, cpu_jiffies()]}


def measure(rank: int, args: argparse.Namespace, arm: str, device: Any) -> dict[str, Any]:
    """Build and time the arm on this rank; its memory, and its state bytes after the last step."""
    import torch

    cuda = device.type == "cuda"
    model, (step, optimizer, dpsgd) = build_arm(rank, args, arm, device)
    setup_rss = current_rss_mb()
    timing = time_steps(step, args, torch.cuda.synchronize if cuda else (lambda: None))
    buffer = dpsgd.gradient_buffer.flat if dpsgd is not None else None  # the clipped-sum buffer the grads view
    return {"rank": rank, **timing, "setup_rss_mb": setup_rss, "peak_rss_mb": peak_rss_mb(),
            "end_rss_mb": current_rss_mb(), "threads": torch.get_num_threads(),
            "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
            "cuda_device": torch.cuda.get_device_name(device) if cuda else None,
            "cuda_version": torch.version.cuda if cuda else None,
            "parameters": sum(p.numel() for p in model.parameters()), "state": state_bytes(model, optimizer, buffer)}  # fmt: skip


def rank_main(rank: int, args: argparse.Namespace, arm: str, folder: str, port: int) -> None:
    """One rank of one arm (a fresh process): join the group, measure, write ``folder/rank<r>.json``."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.world_size)
    try:
        record = measure(rank, args, arm, device)
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(record))


def rank_context(args: argparse.Namespace) -> Any:
    """The forkserver every rank is forked from: :data:`PRELOAD` and the model family's module imported.

    Without ``MALLOC_MMAP_THRESHOLD_`` (glibc's defaults, as the spawned ranks of the committed tables had). Nothing
    here or in the server touches CUDA (on CUDA, should anything ask ``is_available()``, torch asks NVML, not the
    driver): each rank initialises it after the fork, in ``rank_main``.
    """
    model = family(args.size)
    return process_context(args.device, [*PRELOAD, f"transformers.models.{model}.modeling_{model}"],
                           follow_tensors=False)  # fmt: skip


def run_arm(args: argparse.Namespace, arm: str, context: Any) -> dict[str, Any]:
    """Run the arm's ranks (forks of ``context``); combine them: the slowest rank per step, largest memory, state."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            run_ranks(context, rank_main, args.world_size, args, arm, folder, free_port())
        except Exception as error:  # noqa: BLE001  (a failed arm is a row, the others still run)
            return {"arm": arm, "status": "failed", "message": f"{type(error).__name__}: {error}"[:500]}
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    steps = [max(times) for times in zip(*(r["step_times_s"] for r in ranks), strict=True)]
    timed_wall = sum(steps[args.warmup :])
    others = others_share(*ranks[0]["jiffies"], sum(r["timed_cpu_s"] for r in ranks), timed_wall)
    peak = [r["cuda_peak_mb"] if r["cuda_peak_mb"] is not None else r["peak_rss_mb"] for r in ranks]
    return {"arm": arm, "status": "ok", "step_time_s": statistics.median(steps[args.warmup :]), "step_times_s": steps,
            "step_cpu_s": max(r["timed_cpu_s"] for r in ranks) / max(1, args.steps),
            "peak_mem_mb": max(peak), "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "state_bytes": max(r["state"]["total"] for r in ranks), "others_share": others, "ranks": ranks}  # fmt: skip


def targets(world_size: int) -> list[Target]:
    """:data:`RATIOS`; at world size 1 nothing is sharded, so only the step time keeps its target."""
    return [t if world_size > 1 or t.field == "step_time_s" else replace(t, target=None) for t in RATIOS]


def arm_row(arm: dict[str, Any]) -> str:
    """One arm's row: step time, the busiest rank's CPU time per step, others' CPU share, peak memory, state (MiB)."""
    if arm["status"] != "ok":
        return f"| {arm['arm']} | {arm['status']}: {arm['message'][:120]} | | | | | |"
    state = max((r["state"] for r in arm["ranks"]), key=lambda st: st["total"])
    parts = " + ".join(f"{state[k] / 2**20:.0f}" for k in ("parameters", "gradients", "optimizer"))
    return (f"| {arm['arm']} | ok | {arm['step_time_s']:.3f} | {arm['step_cpu_s']:.3f} | {arm['others_share']:.0%} | "
            f"{arm['peak_mem_mb']:.0f} | {state['total'] / 2**20:.0f} ({parts}) |")  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """The markdown page: machine, command, settings, one row per arm, the ratios against their targets."""
    s, arms = results["settings"], results["arms"].values()
    noisy = busy_note(list(arms))
    code = f"`` {results['command']} ``" if "`" in results["command"] else f"`{results['command']}`"
    memory = "CUDA max allocated" if s["device"] == "cuda" else "peak RSS (getrusage; the whole model exists at build)"
    return "\n".join([
        f"# Sharded DP-SGD (FSDP2) vs whole replicas: {s['size']}, {s['world_size']} × {s['device']}", "",
        f"Machine: {machine_line(results['machine'])}. Run {results['created']}, dplit at "
        f"{results['git']['describe']}. Command: {code}.", "",
        f"B = {s['batch_size']} per rank, T = {s['seq_len']}, {s['policy']} embedding, {s['steps']} timed steps after "
        f"{s['warmup']} warm-up, {s['threads']} torch thread(s) per rank; σ = {s['sigma']}, C = {s['max_grad_norm']}, "
        f"ghost clipping; each arm in fresh processes (forks). Peak memory: {memory}, the largest rank's.", "",
        *([noisy + s["note"], ""] if noisy or s["note"] else []),
        "| arm | status | step s (median) | CPU s / step | others | peak mem MiB / rank | state MiB / rank (params + "
        "grads + AdamW) |", "|---|---|---:|---:|---:|---:|---|", *map(arm_row, arms), "",
        *ratio_table(results["ratios"]), "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three arms, print and write ``results.json`` and ``table.md``; return the results."""
    args = parse_args(argv)
    results: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m bench.fsdp " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(), "git": git_info("dplit"),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "arms": {},
    }  # fmt: skip
    context = rank_context(args)
    for arm in ARMS:
        started = time.perf_counter()
        results["arms"][arm] = run_arm(args, arm, context)
        print(f"{arm}: {results['arms'][arm].get('step_time_s')} s/step ({time.perf_counter() - started:.0f} s)",
              flush=True)  # fmt: skip
    results["ratios"] = ratios(results["arms"], targets(args.world_size))
    seen = next((a["ranks"][0] for a in results["arms"].values() if a["status"] == "ok"), {})
    results["machine"].update({k: seen.get(k) for k in ("cuda_device", "cuda_version")}, torch_threads=args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "table.md").write_text(table(results))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
