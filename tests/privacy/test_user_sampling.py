"""Sampling users (user-level DP): inclusion at rate q per user, at most k rows, no user split across ranks."""

from __future__ import annotations

import math

import pytest
import torch

from dplit.privacy.user_sampling import UserPoissonBatchSampler, rows_of_users

USERS = [0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3] + [4 + i // 3 for i in range(57)]  # 23 users of 1 to 7 rows
ROWS = rows_of_users(USERS)


def sampler(steps: int, *, rank: int = 0, replicas: int = 1, seed: int = 0, k: int = 3) -> UserPoissonBatchSampler:
    return UserPoissonBatchSampler(
        user_rows=ROWS, sample_rate=0.3, max_rows_per_user=k, steps=steps, num_replicas=replicas, rank=rank, seed=seed
    )


def test_rows_are_grouped_by_user() -> None:
    assert ROWS[:4] == [[0], [1, 2], [3, 4, 5, 6, 7, 8, 9], [10]] and len(ROWS) == 23


def test_each_user_joins_a_batch_with_probability_q_and_brings_at_most_k_rows() -> None:
    steps, owner = 4000, dict(enumerate(USERS))
    included = torch.zeros(len(ROWS))
    for batch in sampler(steps):
        users = [owner[row] for row in batch]
        for user in set(users):
            assert users.count(user) == min(3, len(ROWS[user]))  # k rows, or all of a smaller user's
            included[user] += 1
        assert len(set(batch)) == len(batch)  # no row twice in a step
    # binomial: each user's count is within 4.5 standard deviations of q·steps (all 23 at once: p < 2e-4)
    spread = math.sqrt(steps * 0.3 * 0.7)
    assert bool(((included - 0.3 * steps).abs() < 4.5 * spread).all()), included


def test_a_large_users_rows_are_drawn_uniformly_among_its_rows() -> None:
    seen = torch.zeros(len(USERS))
    for batch in sampler(3000):
        seen[batch] += 1
    large = torch.tensor(ROWS[2])  # 7 rows, 3 drawn each time the user is sampled: each row 3/7 of those times
    share = seen[large] / seen[large].sum()
    assert bool(((share - 1 / 7).abs() < 0.02).all()), share


@pytest.mark.parametrize("replicas", [2, 3])
def test_no_user_is_split_across_ranks(replicas: int) -> None:
    owner = dict(enumerate(USERS))
    ranks_of_user: dict[int, set[int]] = {}
    for rank in range(replicas):
        for batch in sampler(200, rank=rank, replicas=replicas):
            for row in batch:
                ranks_of_user.setdefault(owner[row], set()).add(rank)
    assert len(ranks_of_user) == len(ROWS) and all(len(ranks) == 1 for ranks in ranks_of_user.values())


def test_a_seed_repeats_its_batches_and_another_seed_does_not() -> None:
    assert list(sampler(5, seed=7)) == list(sampler(5, seed=7))
    assert list(sampler(5, seed=7)) != list(sampler(5, seed=8))


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"user_rows": []}, "at least one user"), ({"user_rows": [[0], []]}, "every user at least one row"),
     ({"max_rows_per_user": 0}, "max_rows_per_user must be ≥ 1"), ({"sample_rate": 0.0}, "sample rate")],
)  # fmt: skip
def test_bad_settings_are_refused(settings: dict, message: str) -> None:
    arguments = {"user_rows": ROWS, "sample_rate": 0.3, "max_rows_per_user": 2, "steps": 1, **settings}
    with pytest.raises(ValueError, match=message):
        UserPoissonBatchSampler(**arguments)
