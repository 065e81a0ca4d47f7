"""DPSGD on FSDP2-sharded weights (two gloo processes): the same update as one process, noise once per coordinate."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from dplit.privacy.settings import DPSGDSettings
from dplit.privacy.sharded_world import check_sharded_settings
from tests.helpers.sharded_worker import CASES, CLIP, NOISE_STEPS, run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_every_rank_released(ranks: list[dict[str, Any]], key: str, reference: dict[str, torch.Tensor]) -> None:
    """Every rank's released gradients under ``key`` equal ``reference``'s to 1e-10, parameter by parameter."""
    for rank in ranks:
        released = rank[key]
        assert released.keys() == reference.keys()
        for name, grad in released.items():
            torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-10, msg=name)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the two ranks computed (one spawn for every check of this module)."""
    out = tmp_path_factory.mktemp("sharded")
    mp.start_processes(run, args=(2, str(out), _free_port()), nprocs=2, start_method="spawn")
    return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "policy"), CASES)
def test_the_sharded_update_is_the_one_process_update_of_the_union_batch(
    ranks: list[dict[str, Any]], family: str, policy: str
) -> None:
    """σ = 0, float64: each rank clipped its own examples (padding, variable lengths, micro-batches) on its shards."""
    assert_every_rank_released(ranks, f"{family}-{policy}", ranks[0][f"{family}-{policy}-reference"])


@pytest.mark.slow
@pytest.mark.parametrize(("family", "policy"), CASES)
def test_the_sharded_update_is_the_brute_force_clipped_mean(
    ranks: list[dict[str, Any]], family: str, policy: str
) -> None:
    """One backward pass per example on whole weights, clipped to C and divided by B = qN: the same update."""
    assert_every_rank_released(ranks, f"{family}-{policy}", ranks[0][f"{family}-{policy}-brute-force"])


@pytest.mark.slow
def test_the_weights_digest_of_sharded_weights_is_that_of_the_whole_weights(ranks: list[dict[str, Any]]) -> None:
    sharded, whole = ranks[0]["digests"]
    assert sharded == whole and ranks[1]["digests"] == (sharded, whole)


@pytest.mark.slow
def test_each_rank_holds_about_half_the_state_of_a_whole_replica(ranks: list[dict[str, Any]]) -> None:
    """Parameters, gradients (the clipped-sum buffer) and AdamW state, from the tensors' local sizes after a step."""
    whole = ranks[0]["state-bytes-whole"]
    for rank in ranks:
        assert rank["state-bytes"] / whole <= 0.55


@pytest.mark.slow
@pytest.mark.parametrize(("family", "policy"), CASES)
def test_a_rank_without_examples_runs_placeholders_that_add_nothing(
    ranks: list[dict[str, Any]], family: str, policy: str
) -> None:
    reference = ranks[0][f"{family}-{policy}-reference-rank0-only"]
    assert_every_rank_released(ranks, f"{family}-{policy}-empty-rank", reference)


@pytest.mark.slow
def test_every_coordinate_is_noised_once_with_std_sigma_c_over_b(ranks: list[dict[str, Any]]) -> None:
    """Zero gradients, σ = 1: each coordinate's update has std σC/B; rank 0's and rank 1's rows alike."""
    steps = ranks[0]["noise"]
    assert len(steps) == NOISE_STEPS
    expected = 1.0 * CLIP / 4  # σ C / B with B = qN = 4
    for name, first in steps[0].items():
        values = torch.stack([step[name] for step in steps])  # [steps, *shape]
        torch.testing.assert_close(values, torch.stack([step[name] for step in ranks[1]["noise"]]))  # one release
        half = -(-first.shape[0] // 2)
        for rows in (values[:, :half], values[:, half:]):  # rank 0's shard, rank 1's shard
            if rows.numel() >= 200:
                assert abs(float(rows.std()) / expected - 1) < 0.15, name


@pytest.mark.slow
def test_the_ranks_noise_streams_are_independent(ranks: list[dict[str, Any]]) -> None:
    steps = ranks[0]["noise"]
    weight = torch.stack([step["backbone.transformer.wte.weight"] for step in steps])  # [steps, 40, 16]
    first, second = weight[:, :20].flatten(), weight[:, 20:].flatten()
    correlation = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    assert abs(correlation) < 0.1
    assert not torch.equal(weight[0], weight[1])  # a fresh generator every step


@pytest.mark.slow
def test_two_runs_of_one_setup_draw_different_noise(ranks: list[dict[str, Any]]) -> None:
    """Without a seed each run's streams come from OS entropy: its first step differs in every shard."""
    first, again = ranks[0]["noise"][0], ranks[0]["noise-again"]
    for name, noise in first.items():
        half = -(-noise.shape[0] // 2)
        assert not torch.equal(noise[:half], again[name][:half]) and not torch.equal(noise[half:], again[name][half:])


@pytest.mark.parametrize(
    ("setting", "message"),
    [({"clipping": "per_example"}, "clipping='per_example'"), ({"self_check": True}, "self_check=true")],
)
def test_what_a_sharded_step_cannot_do_is_refused_in_one_line(setting: dict[str, Any], message: str) -> None:
    settings = DPSGDSettings(**{"max_grad_norm": 1.0, "noise_multiplier": 1.0, "self_check": False, **setting})
    with pytest.raises(ValueError, match=message) as refused:
        check_sharded_settings(settings)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"max_grad_norm": -1.0}, r"^ShardedDPStrategy\.max_grad_norm must be a finite number > 0, got -1\.0$"),
        ({"clip_mode": "x"}, r"^ShardedDPStrategy\.clip_mode must be 'fixed' or 'quantile' or 'automatic', got 'x'$"),
        ({"noise_multiplier": None}, r"^set exactly one of ShardedDPStrategy\.noise_multiplier and ShardedDPStrategy"),
    ],
)
def test_a_shared_setting_refused_under_the_sharded_strategy_names_the_sharded_strategy(
    setting: dict[str, Any], message: str
) -> None:
    from dplit.strategy import ShardedDPStrategy

    with pytest.raises(ValueError, match=message):
        ShardedDPStrategy(**{"max_grad_norm": 1.0, "noise_multiplier": 1.0, **setting})


def test_a_refusal_raised_deep_in_the_privacy_code_names_the_strategy_in_use() -> None:
    """The accountant's checks do not know the strategy: each Lightning strategy names its own knob."""
    from dplit.privacy.accounting import check_accountable
    from dplit.strategy import DPStrategy, ShardedDPStrategy

    plan = {"mechanism": "prv", "sample_rate": 0.1, "steps": 10, "noise_multiplier": 1.0, "target_epsilon": None}
    for strategy, name in [(DPStrategy(max_grad_norm=1.0, noise_multiplier=1.0), "DPStrategy"),
                           (ShardedDPStrategy(max_grad_norm=1.0, noise_multiplier=1.0), "ShardedDPStrategy")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{name}\.target_delta=1e-30 is below") as refused:
            with strategy.naming_refusals():
                check_accountable(delta=1e-30, **plan)
        assert "{owner}" not in str(refused.value) and "DPStrategy" not in str(refused.value).replace(name, "")
