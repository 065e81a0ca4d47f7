"""Activation checkpointing and a 4-bit base (QLoRA) under DP-SGD: step time, peak and step working memory.

Issue 35's rows. Each arm runs in a fresh process of its own (a fork of a forkserver that has only imported the
libraries), so its peak is its own. Every arm trains a label-word
``CausalLMClassifier`` (tied embedding, frozen; dropout 0, eager attention) with rank-8 LoRA (alpha 16) on every
Llama projection, built from one random Llama (seed 0, ``--size``) saved once with ``save_pretrained`` to a
temporary folder (``pretrained=``: the same weights in every arm), on B random sequences of T real tokens:

* ``dp_lora``, ``dp_lora_checkpointed`` (``gradient_checkpointing=True``), ``dp_qlora`` (``quantization``: 4-bit
  NF4 with double quantisation, compute float32 on the CPU, bfloat16 on CUDA), ``dp_qlora_checkpointed``: the
  shipped ``DPSGD`` (ghost clipping, σ = 1, one micro-batch of B: ``clip``, ``release``), then AdamW on the adapters;
* ``non_private_lora``, ``..._checkpointed``, ``non_private_qlora``, ``..._checkpointed``: mean-loss backward, AdamW.

On CUDA every forward (DP: the whole clipping pass) runs under bf16 autocast, as Lightning's bf16-mixed. Per arm:
median step time after ``--warmup`` and CPU time per step; peak memory (CUDA max allocated; on the CPU peak RSS
from ``getrusage``, with ``MALLOC_MMAP_THRESHOLD_=65536`` so RSS follows live tensors); the memory at rest after
the warm-up steps (weights touched, AdamW state and DP buffers allocated), where the peak is reset (CUDA's
statistics; ``/proc/self/clear_refs`` on Linux) so loading the model does not count; the step's working memory
(peak − at rest: activations, gradients, clipping); the model's resident bytes (parameters and buffers as stored,
4-bit weights packed, plus their quantisation state). Ratios from this run against the issue's targets:
(a) checkpointing cuts the DP step's working memory ≥ 50% for ≤ 1.4× step time; (b) the 4-bit base cuts resident
bytes ≥ 3×; (c) DP QLoRA ≤ 1.2× non-private QLoRA step time. Writes ``results.json`` and ``table.md`` to ``--out``
(default bench/results/memory/)::

    python -m bench.memory --size smollm2 --batch-size 2 --threads 1 --out bench/results/memory/smollm2
    python -m bench.memory --size llama0.5b --batch-size 1 --threads 1 --out bench/results/memory/llama0.5b
    python -m bench.memory --size tiny --seq-len 32 --warmup 0 --steps 1 --out /tmp/memory   # the test
    python -m bench.memory --device cuda --size smollm2 --batch-size 8 --warmup 1 --steps 2  # bench/gpu.sh
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench.fresh_process import process_context, run_fresh
from bench.machine import ROOT, git_info, machine_info
from bench.models import LABEL_WORDS, LORA_TARGETS, SMOLLM2_135M
from bench.process_stats import cpu_jiffies, current_rss_mb, others_share, peak_rss_mb
from bench.report import machine_line
from bench.step_methods import non_private_step
from bench.targets import Target, busy_note, ratio_table, ratios

SIZES: dict[str, dict[str, Any]] = {  # Llama configs; every size tied, SmolLM2's 49152-token vocabulary but tiny
    "tiny": {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 688, "vocab_size": 512},  # linear layers dominate: 4-bit storage shows
    "smollm2": {**{k: v for k, v in SMOLLM2_135M.items() if k != "model_type"}, "vocab_size": 49152},
    "llama0.5b": {"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
                  "intermediate_size": 4864, "vocab_size": 49152, "rope_theta": 1e6},  # Qwen2.5-0.5B's dims
}  # fmt: skip
ARMS = tuple(f"{kind}_{base}{ckpt}" for kind in ("dp", "non_private") for base in ("lora", "qlora")
             for ckpt in ("", "_checkpointed"))  # fmt: skip
TARGETS = [
    Target("(a) step working memory dp_lora_checkpointed / dp_lora", "dp_lora_checkpointed", "dp_lora", "step_mem_mb", 0.5),
    Target("(a) step time dp_lora_checkpointed / dp_lora", "dp_lora_checkpointed", "dp_lora", "step_time_s", 1.4),
    Target("(a) CPU time per step dp_lora_checkpointed / dp_lora", "dp_lora_checkpointed", "dp_lora", "step_cpu_s", None),
    Target("(b) model resident bytes dp_lora / dp_qlora", "dp_lora", "dp_qlora", "model_bytes", 3.0, "≥"),
    Target("(b) base bytes (without the adapters) dp_lora / dp_qlora", "dp_lora", "dp_qlora", "base_bytes", None),
    Target("(c) step time dp_qlora / non_private_qlora", "dp_qlora", "non_private_qlora", "step_time_s", 1.2),
    Target("(c) CPU time per step dp_qlora / non_private_qlora", "dp_qlora", "non_private_qlora", "step_cpu_s", None),
    Target("peak memory dp_qlora_checkpointed / dp_lora", "dp_qlora_checkpointed", "dp_lora", "peak_mem_mb", None),
    Target("step time dp_lora / non_private_lora", "dp_lora", "non_private_lora", "step_time_s", None),
]  # fmt: skip
PRELOAD = ["torch", "transformers", "peft", "transformers.models.llama.modeling_llama", "dplit.tasks.classifier",
           "dplit.privacy.dpsgd"]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="smollm2", help="the Llama's shape")
    parser.add_argument("--batch-size", type=int, default=2, help="examples per step (one micro-batch)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=2, help="timed steps; the median is reported")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bf16 autocast, bf16 compute")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--checkpointed-share", type=float, default=1.0,
                        help="model.checkpointed_share of the checkpointed arms (the first ⌈share·L⌉ blocks)")
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--note", default="", help="a sentence for table.md (e.g. what else ran on the machine)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory")
    return parser.parse_args(argv)


def save_llama(args: argparse.Namespace, folder: Path) -> None:
    """The random Llama of ``--size`` (seed 0, tied, float32) saved to ``folder`` for ``pretrained=``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[args.size], tie_word_embeddings=True, max_position_embeddings=max(8192, args.seq_len))
    LlamaForCausalLM(config).save_pretrained(folder)


def build_model(args: argparse.Namespace, arm: str, folder: str, device: Any) -> Any:
    """The arm's classifier on ``folder``: LoRA, and a 4-bit NF4 base (double quantisation) and/or checkpointing."""
    import torch
    from peft import LoraConfig

    from dplit.backbone.embeddings import TiedEmbeddings
    from dplit.tasks.classifier import CausalLMClassifier

    quantization = None
    if "qlora" in arm:
        compute = "bfloat16" if device.type == "cuda" else "float32"
        quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": compute,
                        "bnb_4bit_use_double_quant": True}  # fmt: skip  # QLoRA's and configs/llama8b_sst2_qlora.yaml's
    words = [3, 7] if args.size == "tiny" else LABEL_WORDS["llama"]  # SmolLM2's " terrible", " great"
    torch.manual_seed(1)  # the adapters' initialisation, the same in every arm
    model = CausalLMClassifier(
        pretrained=folder, embeddings=TiedEmbeddings(), label_word_ids=words, dropout=0.0,
        peft=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS["llama"]),
        quantization=quantization, gradient_checkpointing=arm.endswith("_checkpointed"),
        checkpointed_share=args.checkpointed_share if arm.endswith("_checkpointed") else 1.0,
    )  # fmt: skip
    return model.to(device).train()


def make_batch(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """B random sequences of T real tokens (no padding) with random labels (seed 1)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len)
    return {"input_ids": torch.randint(0, SIZES[args.size]["vocab_size"], shape, generator=generator).to(device),
            "attention_mask": torch.ones(shape, dtype=torch.long, device=device),
            "labels": torch.randint(0, 2, (args.batch_size,), generator=generator).to(device)}  # fmt: skip


def build_step(args: argparse.Namespace, arm: str, model: Any, batch: dict[str, Any], device: Any) -> Any:
    """One step of the arm: the shipped DPSGD (clip, release) or the mean-loss backward; then AdamW."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dplit.privacy.dpsgd import DPSGD
    from dplit.privacy.history import PrivacyHistory
    from dplit.privacy.settings import DPSGDSettings

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)
    mixed = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")  # noqa: E731
    if arm.startswith("non_private"):
        return non_private_step(model, batch, optimizer, mixed)
    settings = DPSGDSettings(max_grad_norm=args.max_grad_norm, noise_multiplier=1.0, target_delta=1e-5,
                             max_physical_batch_size=args.batch_size, self_check=False)  # fmt: skip
    dpsgd = DPSGD(model, settings, history=PrivacyHistory())
    dpsgd.sample(DataLoader(TensorDataset(torch.arange(100 * args.batch_size)), batch_size=args.batch_size))
    dpsgd.start(planned_steps=args.warmup + args.steps)

    def dp_step() -> None:
        with mixed():  # DPStrategy autocasts the engine's whole pass under bf16-mixed
            dpsgd.clip(model.per_example_loss, batch)
        dpsgd.release()
        optimizer.step()

    return dp_step


def model_bytes(model: Any) -> dict[str, int]:
    """Bytes the model holds: parameters and buffers as stored (4-bit weights packed) and their quantisation state."""
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors if t is not None)  # noqa: E731
    states = [getattr(p, "quant_state", None) for p in model.parameters()]
    nested = [getattr(q, "state2", None) for q in states if q is not None]
    state = size(t for q in [*states, *nested] if q is not None for t in (q.absmax, getattr(q, "code", None)))
    stored = size({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    adapters = size(p for p in model.parameters() if p.requires_grad)
    return {"stored": stored, "quant_state": state, "total": stored + state, "base": stored + state - adapters}


def measure(args: argparse.Namespace, arm: str, folder: str) -> dict[str, Any]:
    """Build the arm, run the warm-up steps, take the memory at rest, reset the peak, time the steps: its record."""
    import torch

    warnings.simplefilter("ignore")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    memory = (lambda: torch.cuda.memory_allocated(device) / 2**20) if cuda else current_rss_mb
    model = build_model(args, arm, folder, device)
    batch = make_batch(args, device)
    step = build_step(args, arm, model, batch, device)
    load_peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else peak_rss_mb()
    times, cpu, jiffies, setup = [], [], cpu_jiffies(), 0.0
    for index in range(args.warmup + args.steps):
        if index == args.warmup:  # at rest between steps: weights touched, AdamW state and DP buffers exist
            gc.collect()
            jiffies, setup = cpu_jiffies(), memory()
            # the peak so far is forgotten: CUDA statistics, or (Linux) the RSS high-water mark getrusage reads
            torch.cuda.reset_peak_memory_stats(device) if cuda else Path("/proc/self/clear_refs").write_text("5")
        torch.cuda.synchronize(device) if cuda else None
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        torch.cuda.synchronize(device) if cuda else None
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        print(f"{arm} step {index}: {times[-1]:.2f} s wall, {cpu[-1]:.2f} s CPU", file=sys.stderr, flush=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else peak_rss_mb()
    timed = times[args.warmup :]
    return {"arm": arm, "status": "ok", "step_time_s": statistics.median(timed), "step_times_s": times,
            "step_cpu_s": statistics.median(cpu[args.warmup :]), "others_share": others_share(
                jiffies, cpu_jiffies(), sum(cpu[args.warmup :]), sum(timed)),
            "peak_mem_mb": peak, "setup_mem_mb": setup, "step_mem_mb": peak - setup, "load_peak_mb": load_peak,
            "model_bytes": model_bytes(model)["total"], "base_bytes": model_bytes(model)["base"],
            "model_bytes_detail": model_bytes(model),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "threads": torch.get_num_threads(), "memory_kind": "cuda_max_allocated" if cuda else "peak_rss",
            "cuda_device": torch.cuda.get_device_name(device) if cuda else None}  # fmt: skip


def arm_row(arm: dict[str, Any]) -> str:
    """One arm's row: step and CPU time, others' CPU share, peak, after setup, step working memory, model bytes."""
    if arm["status"] != "ok":
        return f"| {arm['arm']} | {arm['status']}: {arm['message'][:120]} | | | | | | | |"
    return (f"| {arm['arm']} | ok | {arm['step_time_s']:.2f} | {arm['step_cpu_s']:.2f} | {arm['others_share']:.0%} | "
            f"{arm['peak_mem_mb']:.0f} | {arm['setup_mem_mb']:.0f} | {arm['step_mem_mb']:.0f} | "
            f"{arm['model_bytes'] / 2**20:.1f} |")  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """The markdown page: machine, command, settings, one row per arm, the ratios against the issue's targets."""
    s, arms = results["settings"], results["arms"].values()
    noisy = busy_note(list(arms))
    memory = ("CUDA max allocated" if s["device"] == "cuda" else "peak RSS (getrusage, MALLOC_MMAP_THRESHOLD_=65536, "
              "reset after the warm-up)")  # fmt: skip
    return "\n".join([
        f"# Checkpointing and QLoRA under DP-SGD: {s['size']}, {s['device']}", "",
        f"Machine: {machine_line(results['machine'])}. Run {results['created']}, dplit at "
        f"{results['git']['describe']}. Command: `{results['command']}`.", "",
        f"B = {s['batch_size']}, T = {s['seq_len']}, rank-8 LoRA on every projection, tied embedding (frozen), "
        f"{s['steps']} timed steps after {s['warmup']} warm-up, each arm in a fresh process; checkpointed arms "
        f"recompute {_share_text(s.get('checkpointed_share', 1.0))}; DP: σ = 1, "
        f"C = {s['max_grad_norm']}, ghost clipping, one micro-batch; "
        f"{'bf16 autocast, 4-bit compute bf16' if s['device'] == 'cuda' else 'float32, 4-bit compute float32'}"
        f"{', 4-bit NF4 with double quantisation' if s.get('double_quant') else ''}. "
        f"Peak: {memory}; at rest: after the warm-up steps; step = peak − at rest (the step's working memory).", "",
        *([noisy + s["note"], ""] if noisy or s["note"] else []),
        "| arm | status | step s (median) | CPU s / step | others | peak MiB | at rest MiB | step MiB | "
        "model MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|", *map(arm_row, arms), "",
        *ratio_table(results["ratios"]), "",
    ])  # fmt: skip


def _share_text(share: float) -> str:
    """Which blocks the checkpointed arms recompute, for the table's settings line."""
    return "every block" if share == 1.0 else f"the first ⌈{share:g} · L⌉ blocks (model.checkpointed_share)"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Save the Llama once, run the arms each in a fresh process, print and write ``results.json`` and ``table.md``."""
    args = parse_args(argv)
    results: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m bench.memory " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(threads=args.threads, device=args.device), "git": git_info("dplit", "bench"),
        "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "double_quant": True},
        "arms": {},
    }  # fmt: skip
    context = process_context(args.device, PRELOAD)
    with tempfile.TemporaryDirectory() as folder:
        save_llama(args, Path(folder))
        for arm in args.arms:
            started = time.perf_counter()
            results["arms"][arm] = run_fresh(context, measure, args, arm, folder, name=arm)
            print(f"{arm}: {results['arms'][arm].get('step_time_s')} s/step, "
                  f"{results['arms'][arm].get('step_mem_mb')} MiB step ({time.perf_counter() - started:.0f} s)",
                  flush=True)  # fmt: skip
    results["ratios"] = ratios(results["arms"], TARGETS)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "table.md").write_text(table(results))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
