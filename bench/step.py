"""Time and measure ONE benchmark configuration in this process (``bench.run`` starts one process each).

A configuration is (method, embedding policy, model size, batch size B, sequence length T). Every method trains
the same randomly initialised CausalLMClassifier (GPT-2 sizes, or ``smollm2``: a Llama of SmolLM2-135M's
shape; label-word head, dropout 0, eager attention, same seed, so the same weights) on the same batch of B
random token sequences of T real tokens, one full optimizer step per iteration:

* ``non_private``: forward, backward of the mean loss, AdamW step.
* ``dplit_ghost``: the shipped DP-SGD object DPStrategy runs (``dplit.privacy.dpsgd.DPSGD``, ghost clipping,
  ``tied_norm="exact"``) over the whole batch (micro-batch = batch): clip, add N(0, σ²C²), divide by B, account;
  then an AdamW step.
* ``dplit_per_example``: the same with dplit's materialising reference engine (vmap of per-example grads).
* ``opacus_hooks`` / ``opacus_ghost``: opacus ``PrivacyEngine.make_private(grad_sample_mode=...)`` on the same
  module and AdamW; ghost uses the returned loss wrapper (two backward passes inside ``loss.backward()``).
* ``--task dpo``: the same methods on a PreferenceModel (``dplit dpo``'s task): B preference pairs, each two rows
  of T tokens clipped as one unit; every step (private or not) runs the reference's forward pass too (with LoRA:
  the backbone with its adapters off; without: a frozen copy).
* ``<method>_lora``: the same on the model with rank-8 LoRA on every projection (peft; base weights and embeddings
  frozen); ``<method>_lora_embedding``: with the input/output embedding trained beside the adapters.

Reports (as JSON, to ``--out``): the median step time over the timed steps after warm-up, peak memory (CUDA max
allocated on GPU; peak RSS of this process on CPU, from ``resource.getrusage``), the memory once the model and
batch exist (``baseline_mem_mb``, before the method's own setup) and after that setup (``setup_mem_mb``: optimizer,
engine or opacus wrapper built, before the first step), and ``status`` ok / refused / failed.

Run directly for one configuration, e.g.::

    python -m bench.step --method dplit_ghost --policy tied --model tiny --batch-size 8 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.models import MODELS, build_model, make_batch
from bench.process_stats import cpu_jiffies, current_rss_mb, others_share, peak_rss_mb
from bench.step_methods import build_step

BASE_METHODS = ("non_private", "dplit_ghost", "dplit_per_example", "opacus_hooks", "opacus_ghost")
ADAPTER_METHODS = (
    "non_private_lora", "dplit_ghost_lora", "dplit_ghost_lora_embedding", "opacus_hooks_lora", "opacus_ghost_lora",
    "opacus_ghost_lora_embedding",
)  # fmt: skip
"""A base method on the LoRA model (rank 8 on every projection, base frozen); ``_embedding``: the (tied or untied)
input/output embedding trained beside the adapters."""
METHODS = BASE_METHODS + ADAPTER_METHODS
POLICIES = ("untied", "tied")
PRECISIONS = ("32-true", "bf16-mixed")
"""Lightning's names: float32 throughout, or bf16 autocast around forward and loss (weights, grads, AdamW in fp32)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of one configuration: method, embedding policy, model size, batch, sequence length and timing."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--policy", choices=POLICIES, required=True, help="tied or untied input/output embeddings")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--task", choices=("classify", "lm", "dpo"), default="classify",
                        help="classify: label-word head at the last token; lm: next-token loss at every position "
                             "(CausalLanguageModel, full vocabulary, summed per example); dpo: PreferenceModel's DPO "
                             "loss (β = 0.1) on B pairs of two rows each, the reference's forward pass included")
    parser.add_argument("--batch-size", type=int, default=8, help="examples, or preference pairs with --task dpo")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (per row of a pair)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (allocations, AdamW state)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps; the median is reported")
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier σ (speed does not depend on it)")
    parser.add_argument("--max-grad-norm", type=float, default=0.1, help="clipping bound C (Li et al. 2021: 0.1)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:i]")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true",
                        help="32-true (default) or bf16-mixed: forward and loss under torch.autocast(bfloat16), as "
                             "Lightning's bf16-mixed does (DPStrategy autocasts its engine's whole pass the same way)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None, help="also profile one step; write the op table here")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON result")
    return parser.parse_args(argv)


def classify_error(error: BaseException) -> str:
    """``refused`` for a library declining the configuration (e.g. opacus ghost on tied weights), else ``failed``."""
    text = str(error).lower()
    if isinstance(error, NotImplementedError) or "not supported" in text or "refuse" in text:
        return "refused"
    return "failed"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time and measure one configuration: the result row (step times, memory, ``status`` and its message).

    A method that raises is recorded as refused or failed (its message kept, cut at 500 characters), not raised.
    """
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    cuda = device.type == "cuda"
    result: dict[str, Any] = {
        "method": args.method,
        "policy": args.policy,
        "model": args.model,
        "batch": args.batch_size,
        "task": args.task,
        "seq_len": args.seq_len,
        "device": str(device),
        "memory_kind": "cuda_max_allocated" if cuda else "peak_rss",
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "privatize": "strategy" if args.method.startswith("dplit") else None,  # the shipped DPSGD object
        "warmup": args.warmup,
        "steps": args.steps,
        "sigma": args.sigma,
        "max_grad_norm": args.max_grad_norm,
        "status": "ok",
        "message": "",
    }
    rss_at_start = current_rss_mb()
    torch.manual_seed(args.seed)
    if cuda:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args, device)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    batch = make_batch(args, device)
    # after model creation, before the method's own setup (optimizer, engine, opacus wrapping, validation forward)
    result["baseline_mem_mb"] = torch.cuda.memory_allocated(device) / 2**20 if cuda else current_rss_mb()
    times: list[float] = []
    cpu_times: list[float] = []
    shares: list[float] = []  # per step: the share of the machine's CPUs other processes used meanwhile
    try:
        step = build_step(args, model, batch, device)
        result["privatize_impl"] = "dplit.privacy.dpsgd.DPSGD" if args.method.startswith("dplit") else None
        result["setup_mem_mb"] = torch.cuda.memory_allocated(device) / 2**20 if cuda else current_rss_mb()
        for index in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize(device)
            jiffies, start, cpu_start = cpu_jiffies(), time.perf_counter(), time.process_time()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            shares.append(others_share(jiffies, cpu_jiffies(), cpu_times[-1], times[-1]))
            print(f"step {index}: {times[-1]:.3f} s wall, {cpu_times[-1]:.3f} s CPU, other processes "
                  f"{shares[-1]:.0%} of the CPUs", file=sys.stderr, flush=True)
        if args.profile is not None:
            profile_one_step(step, args.profile, cuda)
    except Exception as error:  # noqa: BLE001  (recorded in the result, the run goes on)
        result["status"] = classify_error(error)
        result["message"] = f"{type(error).__name__}: {error}".strip()[:500]
        traceback.print_exc()
        if cuda and isinstance(error, torch.cuda.OutOfMemoryError):
            result["message"] = "CUDA out of memory: " + result["message"]
    timed, ok = times[args.warmup :], result["status"] == "ok"
    result["step_times_s"] = times
    result["step_time_s"] = statistics.median(timed) if timed and ok else None
    result["others_share_per_step"] = shares
    result["others_share"] = statistics.mean(shares[args.warmup :]) if timed and ok else None
    result["step_time_min_s"] = min(timed) if timed and ok else None
    result["step_cpu_s"] = statistics.median(cpu_times[args.warmup :]) if timed and ok else None  # all threads
    result["peak_rss_mb"] = peak_rss_mb()
    result["rss_at_start_mb"] = rss_at_start
    if cuda:
        result["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        result["peak_mem_mb"] = result["peak_rss_mb"]
    if result["status"] != "ok":
        result["peak_mem_mb"] = None  # a refused/failed run's memory says nothing about the method
    return result


def profile_one_step(step: Callable[[], None], path: Path, cuda: bool) -> None:
    """Profile one more step with torch.profiler; write op tables (self and total time) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True, with_stack=False) as prof:
        step()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    grouped = prof.key_averages(group_by_input_shape=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "## by op\n"
        + averages.table(sort_by=sort, row_limit=40)
        + "\n## by op and input shape\n"
        + grouped.table(sort_by=sort, row_limit=60)
    )


def main(argv: list[str] | None = None) -> None:
    """Measure the configuration ``argv`` names, write its result to ``--out``, print a summary as one JSON line."""
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("method", "policy", "status", "step_time_s", "peak_mem_mb")}))


if __name__ == "__main__":
    main()
