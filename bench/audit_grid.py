"""The audit benchmark's grid: which ``dplit audit`` runs make tables 1 to 3 (see :mod:`bench.audit`)."""

from __future__ import annotations

import json
from typing import Any

EPSILONS = (1.0, 2.0, 4.0, 8.0)
MODES = ("white_box", "black_box")
TINY_LLAMA = json.dumps(
    {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
)  # fmt: skip
FULL_BATCH = ["--trainer.max_epochs", "20", "--trainer.strategy.init_args.target_delta", "1e-7"]
SETUPS: dict[str, tuple[str, list[str]]] = {
    "quickstart GPT-2, Poisson batches (2,000 rows, q = 0.05, 60 steps, δ = 1e-7)": (
        "audit",
        ["--config", "configs/quickstart.yaml", "--data.synthetic_train_size", "2000", "--data.batch_size", "100",
         "--trainer.strategy.init_args.target_delta", "1e-7"],
    ),
    "quickstart GPT-2, full batches (64 rows, q = 1, 20 steps, δ = 1e-7)": (
        "audit", ["--config", "configs/quickstart.yaml", "--data.synthetic_train_size", "64",
                  "--data.batch_size", "64", *FULL_BATCH],
    ),
    "tiny Llama LM (2×64), full batches (64 rows, q = 1, 20 steps, δ = 1e-7)": (
        "lm audit", ["--config", "configs/lm_quickstart.yaml", "--model.config", TINY_LLAMA,
                     "--data.builtin_train_size", "64", "--data.batch_size", "64", *FULL_BATCH],
    ),
}  # fmt: skip
BUG_SETUP = "quickstart GPT-2, full batches (64 rows, q = 1, 20 steps, δ = 1e-7)"
BUG_CANARIES = 10_000
REPEATS = {("correct", 1.0): 10, ("correct", 4.0): 10, ("correct", 8.0): 5, ("noise std × 0.5", 1.0): 5,
           ("noise std × 0.5", 4.0): 5}  # fmt: skip
"""Table 3: (mechanism, claimed ε) → independent runs at m = 10,000 (the first also fills table 2's cell)."""
MECHANISMS = {
    "correct": None,
    "noise std × 0.5": "HalfNoise",
    "÷ realised batch size": "RealisedBatchDivisor",
    "a canary's clipping skipped (10·C)": "UnclippedCanaries",
    "no clipping (canaries at 100·C)": "NoClipping",
}



SMOKE_EPOCHS = 2
"""Steps of each ``--smoke`` run (the setup's own 20 would check nothing more about the pipeline)."""


def plan(smoke: bool) -> list[dict[str, Any]]:
    """Every run: its table, setup, mode, claimed ε, mechanism and canaries."""
    if smoke:
        return [{"table": 1, "setup": BUG_SETUP, "mode": mode, "claimed": 4.0, "mechanism": "correct", "canaries": 100,
                 "epochs": SMOKE_EPOCHS} for mode in MODES]  # fmt: skip
    runs = [
        {"table": 3, "setup": BUG_SETUP, "mode": "white_box", "claimed": claimed, "mechanism": name,
         "canaries": BUG_CANARIES, "repeat": repeat}
        for repeat in range(max(REPEATS.values())) for (name, claimed), count in REPEATS.items() if repeat < count
    ]  # fmt: skip
    runs += [
        {"table": 2, "setup": BUG_SETUP, "mode": "white_box", "claimed": claimed, "mechanism": name,
         "canaries": BUG_CANARIES}
        for claimed in (1.0, 4.0) for name in MECHANISMS if (name, claimed) not in REPEATS
    ]  # fmt: skip
    runs += [
        {"table": 1, "setup": setup, "mode": mode, "claimed": claimed, "mechanism": "correct", "canaries": 1000}
        for setup in SETUPS for claimed in (*EPSILONS, None) for mode in MODES
    ]  # fmt: skip
    return runs
