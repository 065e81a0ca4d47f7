"""Paired CPU-time prices of the ghost engine's parts at GPT-2 shapes, measured in ONE process (issue 52).

Each line times the shipped functions on random factors of one GPT-2 weight's shapes (B examples of T positions),
alternating the variants in the same process and reporting the least CPU time (``time.process_time``) of
``--repeats``, so that a busy shared machine inflates every variant alike:

* ``weights``: per transformer weight, the shipped norm (``parameter_squared_norm``: float64 copies of both factors,
  float64 Grams, the rounding slack), the two float32 Grams alone (the norm without its float64 exactness, NOT
  shipped: the price of the bound is the difference) and the clipped sum (``add_weighted_sum_``: one ``addmm_``,
  the product the non-private backward forms as the weight gradient);
* ``tied``: the tied embedding/head norm with its cross term against the two uses normed apart (untied);
* ``chunks``: per transformer weight, the shipped norm with its default float64 chunk (cache-sized on a CPU) against
  one chunk of the whole batch (``chunk_elements=CHUNK_ELEMENTS``, the default before issue 52), alternating;
* ``noise``: ``normal_`` over ``--noise-entries`` entries, 1 and 2 torch threads, in 1M-entry chunks and whole, with
  the main thread's CPU time beside the process's (equal: the draw runs on one thread).

Run::

    python -m bench.norm_price --parts weights chunks tied noise
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from dplit.privacy.clipping.norms.factors import (
    DenseFactor,
    FactoredGradient,
    IndexFactor,
    add_weighted_sum_,
    inner_product,
)
from dplit.privacy.clipping.parameter_norms import CHUNK_ELEMENTS, parameter_squared_norm
from dplit.privacy.clipping.rounding import clipping_arithmetic

GPT2_WEIGHTS = {
    "attn.c_attn": (2304, 768),
    "attn.c_proj": (768, 768),
    "mlp.c_fc": (3072, 768),
    "mlp.c_proj": (768, 3072),
}
"""A GPT-2 block's weights as the engine sees them: (output gradient width, input width)."""


def least_cpu_s(work: Callable[[], object], repeats: int) -> float:
    """The least process CPU time (s) of ``repeats`` calls of ``work``."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        work()
        times.append(time.process_time() - start)
    return min(times)


def dense_use(size: int, positions: int, rows: int, cols: int) -> FactoredGradient:
    """A random factored use: output gradients [B, T, rows], inputs [B, T, cols]."""
    return FactoredGradient(
        DenseFactor(torch.randn(size, positions, rows)), DenseFactor(torch.randn(size, positions, cols))
    )


def price_weights(size: int, positions: int, layers: int, repeats: int) -> None:
    """Print each GPT-2 weight's norm (shipped, float32 Grams) and clipped-sum CPU time, and the sums over layers."""
    totals = [0.0, 0.0, 0.0]
    for name, (rows, cols) in GPT2_WEIGHTS.items():
        use = dense_use(size, positions, rows, cols)
        out, weights = torch.zeros(rows, cols), torch.rand(size)
        prices = (
            least_cpu_s(lambda use=use: parameter_squared_norm([use]), repeats),
            least_cpu_s(lambda use=use: inner_product(use, use), repeats),
            least_cpu_s(lambda use=use, out=out, w=weights: add_weighted_sum_(out, use, w), repeats),
        )
        totals = [total + price for total, price in zip(totals, prices, strict=True)]
        print(
            f"{name} [{rows}x{cols}], B={size} T={positions}: shipped norm {prices[0] * 1e3:.1f} ms, float32 Grams "
            f"alone {prices[1] * 1e3:.1f} ms, clipped sum {prices[2] * 1e3:.1f} ms CPU",
            flush=True,
        )
    print(
        f"x {layers} layers: shipped norms {totals[0] * layers:.2f} s, float32 Grams alone {totals[1] * layers:.2f} s, "
        f"clipped sums {totals[2] * layers:.2f} s CPU"
    )


def price_chunks(size: int, positions: int, layers: int, repeats: int) -> None:
    """Print each GPT-2 weight's shipped norm with the default chunk and with one whole-batch chunk, and the sums."""
    totals = [0.0, 0.0]
    for name, (rows, cols) in GPT2_WEIGHTS.items():
        use = dense_use(size, positions, rows, cols)
        default = least_cpu_s(lambda use=use: parameter_squared_norm([use]), repeats)
        whole = least_cpu_s(lambda use=use: parameter_squared_norm([use], chunk_elements=CHUNK_ELEMENTS), repeats)
        same = bool(
            torch.equal(parameter_squared_norm([use]), parameter_squared_norm([use], chunk_elements=CHUNK_ELEMENTS))
        )
        totals = [totals[0] + default, totals[1] + whole]
        print(
            f"{name} [{rows}x{cols}], B={size} T={positions}: default chunk {default * 1e3:.1f} ms, whole batch "
            f"{whole * 1e3:.1f} ms CPU; bitwise equal norms: {same}",
            flush=True,
        )
    print(f"x {layers} layers: default chunk {totals[0] * layers:.2f} s, whole batch {totals[1] * layers:.2f} s CPU")


def price_tied(size: int, positions: int, vocabulary: int, width: int, repeats: int) -> None:
    """Print the tied embedding/head norm (cross term included) against the two uses normed apart."""
    embedding = FactoredGradient(
        IndexFactor(torch.randint(0, vocabulary, (size, positions)), vocabulary),
        DenseFactor(torch.randn(size, positions, width)),
    )
    head = dense_use(size, 1, vocabulary, width)  # the classifier's head: the last position only
    tied = least_cpu_s(lambda: parameter_squared_norm([embedding, head]), repeats)
    embedding_alone = least_cpu_s(lambda: parameter_squared_norm([embedding]), repeats)
    head_alone = least_cpu_s(lambda: parameter_squared_norm([head]), repeats)
    print(
        f"tied V={vocabulary} d={width}, B={size} T={positions}, head at 1 position: tied norm {tied * 1e3:.1f} ms, "
        f"embedding alone {embedding_alone * 1e3:.1f} ms, head alone {head_alone * 1e3:.1f} ms CPU"
    )


def price_noise(entries: int, repeats: int) -> None:
    """Print normal_'s process and main-thread CPU time over ``entries``, at 1 and 2 threads, chunked and whole."""
    generator = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for label, chunk in (("1M chunks", 1 << 20), ("whole", entries)):
            scratch = torch.empty(min(chunk, entries))
            best = (float("inf"), float("inf"))
            for _ in range(repeats):
                process, thread = time.process_time(), time.thread_time()
                for start in range(0, entries, chunk):
                    scratch[: min(chunk, entries - start)].normal_(0.0, 1.0, generator=generator)
                best = min(best, (time.process_time() - process, time.thread_time() - thread))
            print(f"normal_ {entries} entries, {threads} threads, {label}: process {best[0]:.3f} s, main thread "
                  f"{best[1]:.3f} s CPU")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and print the chosen prices."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", nargs="+", choices=("weights", "chunks", "tied", "noise"), default=["weights", "tied"]
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--noise-entries", type=int, default=13_400_000)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with clipping_arithmetic("cpu"):
        if "weights" in args.parts:
            price_weights(args.batch_size, args.seq_len, args.layers, args.repeats)
        if "chunks" in args.parts:
            price_chunks(args.batch_size, args.seq_len, args.layers, args.repeats)
        if "tied" in args.parts:
            price_tied(args.batch_size, args.seq_len, 50257, 768, args.repeats)
    if "noise" in args.parts:
        price_noise(args.noise_entries, args.repeats)


if __name__ == "__main__":
    main()
