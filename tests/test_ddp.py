"""DPStrategy on two CPU processes (gloo): the one-process update, identical replicas, noise once, global ε.

One torchrun launch (tests/helpers/ddp_worker.py) runs every two-process scenario; each rank saves what it saw, and
the tests compare the ranks with each other, with one-process runs replaying the union of the ranks'
batches, with the brute-force oracle and with opacus' accountant.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from opacus.accountants import PRVAccountant
from torch.utils.data import DataLoader
from typing_extensions import override

from dplit.audit.canaries import noiseless_scores
from dplit.privacy.accounting import default_delta
from dplit.privacy.ledger import CHECKPOINT_KEY
from dplit.privacy.sampling import PoissonBatchSampler
from dplit.privacy.seeds import derive_seed, seeded_generator
from dplit.strategy import DPStrategy
from tests.helpers import brute_force
from tests.helpers.ddp_worker import BATCH_SIZE, TRAIN_SIZE, IndexedTokenData, build_model, collate
from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY
Q = BATCH_SIZE / TRAIN_SIZE  # the global Poisson rate: data.batch_size is the global expected batch
EXACT = ["exact_untied", "exact_tied", "exact_tied_ghost", "exact_tied_checkpointed"]
"""σ = 0: two processes reach the one-process weights (``checkpointed``: recomputed blocks, against a plain model)."""
NOISY = ["noisy_untied", "noisy_tied_ghost"]
SCENARIOS: list[dict[str, Any]] = [
    {"name": "exact_untied", "policy": "untied", "noise_multiplier": 0.0, "max_steps": 3, "max_physical_batch_size": 2},
    {"name": "exact_tied", "policy": "tied", "noise_multiplier": 0.0, "max_steps": 3},
    {
        "name": "canaries_untied",
        "policy": "untied",
        "noise_multiplier": 0.0,
        "max_steps": 3,
        "max_physical_batch_size": 2,
        "canaries": 40,
    },
    {"name": "exact_tied_ghost", "policy": "tied", "clipping": "ghost", "noise_multiplier": 0.0, "max_steps": 3},
    {
        "name": "exact_tied_checkpointed",
        "policy": "tied",
        "clipping": "ghost",
        "checkpointing": True,
        "noise_multiplier": 0.0,
        "max_steps": 3,
    },
    {
        "name": "noisy_untied",
        "policy": "untied",
        "noise_multiplier": 1.0,
        "max_steps": 4,
        "checkpoints": True,
        "val_batches": 2,
        "val_check_interval": 2,
    },
    {"name": "noisy_tied_ghost", "policy": "tied", "clipping": "ghost", "noise_multiplier": 1.0, "max_steps": 4},
    {"name": "target", "noise_multiplier": None, "target_epsilon": 2.0, "max_steps": 3, "checkpoints": True},
    {"name": "target_resumed", "noise_multiplier": None, "target_epsilon": 2.0, "max_steps": 6, "resume": "target"},
    {"name": "rows_differ", "noise_multiplier": 1.0, "max_steps": 2, "rows_differ_by_rank": True, "expect_error": True},
]
BY_NAME = {scenario["name"]: scenario for scenario in SCENARIOS}

Ranks = list[dict[str, Any]]

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.slow,  # two processes (gloo)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Ranks]:
    """Runs every scenario on two processes once; returns a loader of each scenario's per-rank results."""
    out = tmp_path_factory.mktemp("ddp")
    spec = out / "spec.json"
    spec.write_text(json.dumps(SCENARIOS))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launch = subprocess.Popen(
        [*command, str(ROOT / "tests" / "helpers" / "ddp_worker.py"), str(spec), str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a hung run's ranks can be killed with the launcher
    )
    try:
        output, _ = launch.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        output, _ = launch.communicate()
    if launch.returncode != 0:
        pytest.fail(f"two-process run failed ({launch.returncode}):\n{output[-8000:]}")

    def load(name: str) -> Ranks:
        return [torch.load(out / f"{name}.rank{rank}.pt", weights_only=False) for rank in (0, 1)]

    load.folder = out  # type: ignore[attr-defined]
    return load


class ReplayStrategy(DPStrategy):
    """DPStrategy on one process whose training loader replays given logical batches (q stays batch_size / N)."""

    def __init__(self, batches: list[list[int]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._batches = batches

    @override
    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)
        if not isinstance(loader, DataLoader) or not isinstance(loader.batch_sampler, PoissonBatchSampler):
            return loader
        return DataLoader(loader.dataset, batch_sampler=self._batches, collate_fn=loader.collate_fn)


class TrainStartState(Callback):
    """Keeps the parameters the first step starts from."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}


def fit_one_process(
    tmp_path: Path,
    scenario: dict[str, Any],
    *,
    state: dict[str, torch.Tensor] | None = None,
    batches: list[list[int]] | None = None,
    ckpt_path: Path | None = None,
    max_steps: int | None = None,
    callbacks: list[Callback] | None = None,
    noise_seeds: list[int] | None = None,
) -> tuple[L.Trainer, DPStrategy, torch.nn.Module]:
    """The scenario on one process, from ``state`` (or a checkpoint), optionally replaying ``batches``.

    ``noise_seeds``, when given, receives the seed of every step's noise generator.
    """
    model = build_model(scenario.get("policy", "untied"), seed=0)
    if state is not None:
        model.load_state_dict(state)
    settings = {
        "accelerator": "cpu",
        "max_grad_norm": scenario.get("max_grad_norm", 0.1),
        "noise_multiplier": scenario.get("noise_multiplier"),
        "target_epsilon": scenario.get("target_epsilon"),
        "clipping": scenario.get("clipping", "per_example"),
        "max_physical_batch_size": scenario.get("max_physical_batch_size", 3),
        "seed": 0,
    }
    strategy = ReplayStrategy(batches, **settings) if batches is not None else DPStrategy(**settings)
    if noise_seeds is not None:
        source = strategy.noise_source
        seed_of = source.seed

        def recorded(stream: str, *, steps: int) -> int:
            seed = seed_of(stream, steps=steps)
            if stream == "noise":
                noise_seeds.append(seed)
            return seed

        source.seed = recorded  # type: ignore[method-assign]
    trainer = L.Trainer(
        strategy=strategy,
        devices=1,
        precision="64-true",
        max_steps=max_steps or scenario["max_steps"],
        default_root_dir=tmp_path,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, IndexedTokenData(), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trainer, strategy, model


def union(ranks: Ranks) -> list[list[int]]:
    """Every step's global logical batch: the concatenation of the ranks' batches."""
    return [first + second for first, second in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True)]


def assert_identical(first: Any, second: Any, where: str = "") -> None:
    """Bit-for-bit equality of nested dicts/lists of tensors and numbers."""
    if isinstance(first, dict):
        assert first.keys() == second.keys(), where
        for key in first:
            assert_identical(first[key], second[key], f"{where}/{key}")
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), where
        for index, (a, b) in enumerate(zip(first, second, strict=True)):
            assert_identical(a, b, f"{where}[{index}]")
    elif isinstance(first, torch.Tensor):
        assert first.dtype == second.dtype and torch.equal(first, second), f"{where} differs between ranks"
    else:
        assert first == second, where


def opacus_epsilon(sigma: float, steps: int) -> float:
    reference = PRVAccountant()
    reference.history = [(sigma, Q, steps)]
    return reference.get_epsilon(default_delta(TRAIN_SIZE))


@pytest.mark.parametrize("name", EXACT)
def test_two_processes_reach_the_one_process_parameters(
    runs: Callable[[str], Ranks], tmp_path: Path, name: str
) -> None:
    ranks = runs(name)
    batches = union(ranks)
    assert len(batches) == 3 and all(batches)
    _, _, model = fit_one_process(tmp_path, BY_NAME[name], state=ranks[0]["initial"], batches=batches)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["final"][key], value, rtol=0, atol=1e-9, msg=key)
        assert_identical(ranks[0]["final"][key], ranks[1]["final"][key], key)
    moved = [key for key, value in ranks[0]["initial"].items() if not torch.equal(value, ranks[0]["final"][key])]
    assert len(moved) > 10


def test_initial_parameters_are_rank_0s_on_every_rank(runs: Callable[[str], Ranks]) -> None:
    ranks = runs("exact_untied")
    assert any(not torch.equal(ranks[0]["initial"][k], v) for k, v in ranks[1]["initial"].items())
    for rank in ranks:
        assert_identical(rank["at_train_start"], ranks[0]["initial"])


@pytest.mark.parametrize("name", [scenario["name"] for scenario in SCENARIOS if not scenario.get("expect_error")])
def test_one_all_reduce_per_step_and_no_ddp_wrapper(runs: Callable[[str], Ranks], name: str) -> None:
    for rank in runs(name):
        assert rank["wrapped"] == "GPT2Classifier" and rank["world_size"] == 2
        assert rank["collectives"] == [{"all_reduce": 1}] * len(rank["batches"])
    sizes = [len(batch) for batch in runs("exact_untied")[0]["batches"]]
    assert max(sizes) > 2 * BY_NAME["exact_untied"]["max_physical_batch_size"]  # several micro-batches a step


def test_each_rank_poisson_samples_its_own_shard_at_the_global_rate(runs: Callable[[str], Ranks]) -> None:
    ranks = runs("noisy_untied")
    for index, rank in enumerate(ranks):
        assert rank["sample_rate"] == Q and rank["expected_batch_size"] == BATCH_SIZE
        assert all(i % 2 == index for batch in rank["batches"] for i in batch)
    positions = [[[i // 2 for i in batch] for batch in rank["batches"]] for rank in ranks]
    assert positions[0] != positions[1]  # the ranks draw different streams from the same seed


@pytest.mark.parametrize("name", NOISY)
def test_noisy_replicas_stay_bit_identical(runs: Callable[[str], Ranks], name: str) -> None:
    first, second = runs(name)
    assert first["global_step"] == second["global_step"] == 4
    for key in ("before_step", "final", "grads", "optimizer"):
        assert_identical(first[key], second[key], key)
    assert len(first["optimizer"]["state"]) > 10


def test_noise_std_is_sigma_c_over_the_global_expected_batch(runs: Callable[[str], Ranks]) -> None:
    ranks = runs("noisy_untied")
    model = build_model("untied", seed=0)
    model.load_state_dict(ranks[0]["before_step"][-1])  # the parameters the last step started from
    data = IndexedTokenData().train_set
    batch = collate([data[i] for i in union(ranks)[-1]])
    expected = brute_force.clipped_sum(brute_force.per_example_gradients(model, model.per_example_loss, batch), 0.1)
    noise = torch.cat([(ranks[0]["grads"][-1][n] - expected[n] / BATCH_SIZE).flatten() for n in expected])
    assert noise.numel() > 5000
    assert noise.std().item() == pytest.approx(1.0 * 0.1 / BATCH_SIZE, rel=0.05)  # not /8 (per rank), not ×√2
    assert abs(noise.mean().item()) < 4 * noise.std().item() / noise.numel() ** 0.5


def test_epsilon_is_global_and_the_same_on_every_rank(runs: Callable[[str], Ranks]) -> None:
    ranks = runs("noisy_untied")
    expected = opacus_epsilon(1.0, 4)
    for rank in ranks:
        assert rank["ledger"]["history"] == [(1.0, Q, 4)]
        assert rank["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert rank["metrics"]["privacy/epsilon"] == pytest.approx(expected, rel=1e-6)
    assert [rank["ledger_writes"] for rank in ranks] == [4, 0]  # the ledger file is rank 0's
    ledger = json.loads((Path(ranks[0]["log_dir"]) / "privacy_ledger.json").read_text())
    assert ledger["accountant"]["history"] == [[1.0, Q, 4]] and ledger["epsilon"] == pytest.approx(expected)


def test_validation_metrics_are_synced_over_ranks(runs: Callable[[str], Ranks]) -> None:
    ranks = runs("noisy_untied")
    assert ranks[0]["metrics"]["val/acc"] == ranks[1]["metrics"]["val/acc"]
    assert ranks[0]["metrics"]["val/loss"] == pytest.approx(ranks[1]["metrics"]["val/loss"], rel=1e-12)
    model = build_model("untied", seed=0)
    model.load_state_dict(ranks[0]["final"])
    data = IndexedTokenData().val_set
    batch = collate([data[i] for i in range(len(data))])  # both ranks' halves: the whole validation set
    with torch.no_grad():
        accuracy = (model(batch["input_ids"], batch["attention_mask"]).argmax(-1) == batch["labels"]).double().mean()
    assert ranks[0]["metrics"]["val/acc"] == pytest.approx(accuracy.item(), abs=1e-7)


def test_two_process_checkpoint_resumes_on_one_process_with_the_ledger(
    runs: Callable[[str], Ranks], tmp_path: Path
) -> None:
    ranks = runs("noisy_untied")
    checkpoint = runs.folder / "noisy_untied" / "ckpt" / "last.ckpt"  # type: ignore[attr-defined]
    saved = torch.load(checkpoint, weights_only=False)
    assert saved[CHECKPOINT_KEY]["accountant"]["history"] == [(1.0, Q, 4)]
    start = TrainStartState()
    seeds: list[int] = []
    trainer, strategy, _ = fit_one_process(
        tmp_path, BY_NAME["noisy_untied"], ckpt_path=checkpoint, max_steps=6, callbacks=[start], noise_seeds=seeds
    )
    assert_identical(start.state, ranks[0]["final"])
    assert strategy.dpsgd.expected_batch_size == BATCH_SIZE and strategy.dpsgd.sample_rate == Q
    assert strategy.accountant.steps == trainer.global_step == 6
    assert strategy.accountant.epsilon() == pytest.approx(opacus_epsilon(1.0, 6), rel=1e-9)
    assert seeds == [derive_seed(0, "noise", 4), derive_seed(0, "noise", 5)]  # fresh noise after a resume


def test_target_epsilon_stop_is_taken_by_every_rank(runs: Callable[[str], Ranks]) -> None:
    planned = runs("target")
    assert planned[0]["noise_multiplier"] == planned[1]["noise_multiplier"]
    assert all(rank["ledger"]["history"] == [(planned[0]["noise_multiplier"], Q, 3)] for rank in planned)
    assert 1.9 < planned[0]["epsilon"] <= 2.0
    resumed = runs("target_resumed")  # asks for 6 steps with σ planned for 3: every rank stops before step 4
    for rank in resumed:
        assert rank["noise_multiplier"] == planned[0]["noise_multiplier"]
        assert rank["ledger"] == planned[0]["ledger"] and rank["epsilon"] <= 2.0
        assert rank["batches"] == [] and rank["collectives"] == []  # not one batch drawn, no step refused
    assert_identical(resumed[0]["final"], resumed[1]["final"])
    assert_identical(resumed[0]["final"], planned[0]["final"])


def test_union_of_the_shards_is_a_poisson_sample_at_the_global_rate() -> None:
    size, rate, steps = 40, 0.3, 2000
    samplers = [
        PoissonBatchSampler(dataset_size=size, sample_rate=rate, steps=steps, num_replicas=2, rank=r, seed=5)
        for r in (0, 1)
    ]
    chosen = torch.zeros(steps, size)
    for sampler in samplers:
        for step, batch in enumerate(sampler):
            assert not chosen[step, batch].any()  # shards are disjoint
            chosen[step, batch] = 1
    assert chosen.mean(0).sub(rate).abs().max() < 0.06  # every example at rate q (4.5 standard errors)
    even, odd = chosen[:, 0::2], chosen[:, 1::2]
    correlation = ((even - rate) * (odd - rate)).mean() / (rate * (1 - rate))
    assert abs(correlation.item()) < 0.03  # rank 0's and rank 1's draws are independent


def test_sampler_accepts_any_64_bit_seed() -> None:
    seed = torch.initial_seed() | (1 << 63)  # torch's default seeds are 64-bit
    assert derive_seed(seed, 1).bit_length() > 64  # the whole digest: not cut to what manual_seed took
    batches = list(PoissonBatchSampler(dataset_size=10, sample_rate=0.5, steps=2, num_replicas=2, rank=1, seed=seed))
    assert all(i % 2 == 1 for batch in batches for i in batch)


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """One step's published gradient in the order of the clipping buffer (trainable parameters, by name)."""
    return torch.cat([grad.reshape(-1) for grad in grads.values()])


def test_audit_canaries_are_added_once_and_scored_alike_on_every_rank(runs: Callable[[str], Ranks]) -> None:
    canary_ranks, plain = runs("canaries_untied"), runs("exact_untied")
    canaries = canary_ranks[0]["canaries"]
    coordinates, included = canaries["coordinates"], canaries["included"]
    assert all(torch.equal(rank["canaries"]["scores"], canaries["scores"]) for rank in canary_ranks)
    assert canary_ranks[0]["batches"][0] == plain[0]["batches"][0]  # same seeds, same first Poisson batch
    generator = seeded_generator(derive_seed(0, "canaries", 0), device=torch.device("cpu"))
    sampled = (torch.rand(40, generator=generator, dtype=torch.float64) < Q) & included
    assert 0 < int(sampled.sum()) < int(included.sum())
    for rank in (0, 1):  # step 1: same weights, same batch; the published gradients differ by the canaries only
        added = (flat(canary_ranks[rank]["grads"][0]) - flat(plain[rank]["grads"][0])) * BATCH_SIZE  # × q·N
        expected = torch.zeros_like(added)
        expected[coordinates[sampled]] = 0.1  # C once, not once per rank
        assert torch.allclose(added, expected, atol=1e-12, rtol=0)
    readings = torch.stack([flat(grads)[coordinates] for grads in canary_ranks[0]["grads"]]) * BATCH_SIZE / 0.1  # [T, m]
    expected_scores = noiseless_scores(readings, sample_rate=Q)  # σ = 0 in Poisson batches: the released readings'
    assert torch.allclose(canaries["scores"], expected_scores, rtol=1e-3, atol=1e-3)  # float32 gradients × qN
    assert torch.allclose(canaries["reading_sums"], readings.sum(dim=0), rtol=0, atol=1e-5)  # what the audit read


def test_ranks_whose_training_rows_differ_are_refused_before_any_step(runs: Callable[[str], Ranks]) -> None:
    ranks = runs("rows_differ")
    for rank in ranks:  # an unseeded split: each rank drew other rows; both refuse, neither steps
        assert "the training rows differ between data-parallel ranks" in rank["error"] and rank["steps"] == 0
        assert "\n" not in rank["error"]
