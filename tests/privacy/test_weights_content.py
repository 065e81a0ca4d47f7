"""The weights' content digest: the same values give the same digest, whatever their dtype or sharding (issue 49)."""

from __future__ import annotations

import torch

from dplit.privacy.weights_content import _local_row_digests, content_digest


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(5, 3), "a.bias": torch.randn(3), "ids": torch.arange(4), "scale": torch.tensor(2.0)}


def test_lossless_dtype_conversions_keep_the_digest_and_a_one_ulp_change_does_not() -> None:
    base = state()
    digest = content_digest(base)
    as_float64 = {name: value.double() if value.is_floating_point() else value for name, value in base.items()}
    assert content_digest(as_float64) == digest  # trainer.precision="64-true" converts a float32 model
    bf16 = {name: value.bfloat16() if value.is_floating_point() else value for name, value in base.items()}
    widened = {name: value.float() if value.is_floating_point() else value for name, value in bf16.items()}
    assert content_digest(bf16) == content_digest(widened) != digest  # the rounding to bfloat16 is a change
    assert content_digest({**base, "a.weight": base["a.weight"].bfloat16().double()}) != digest
    nudged = {**base, "a.weight": base["a.weight"].clone()}
    nudged["a.weight"][2, 1] = torch.nextafter(nudged["a.weight"][2, 1], torch.tensor(10.0))
    assert content_digest(nudged) != digest
    finer = {**as_float64, "a.bias": as_float64["a.bias"] + 1e-12}  # float64 values float32 cannot hold
    assert content_digest(finer) != digest


def test_names_shapes_and_order_are_covered() -> None:
    base = state()
    digest = content_digest(base)
    assert content_digest(dict(reversed(list(base.items())))) == digest  # the order of the entries is not content
    assert content_digest({**base, "a.weight": base["a.weight"].reshape(3, 5)}) != digest
    renamed = {("b.weight" if name == "a.weight" else name): value for name, value in base.items()}
    assert content_digest(renamed) != digest
    assert content_digest({**base, "extra": torch.zeros(1)}) != digest


def test_rows_hash_alone_so_any_dim0_split_gives_the_same_row_digests() -> None:
    tensor = state()["a.weight"]
    whole = _local_row_digests(tensor)
    for cut in range(tensor.shape[0] + 1):  # FSDP2 gives each rank a dim-0 chunk (possibly empty)
        assert _local_row_digests(tensor[:cut]) + _local_row_digests(tensor[cut:]) == whole


def test_each_row_takes_its_own_canonical_dtype_so_shards_of_mixed_rows_hash_as_the_whole() -> None:
    mixed = torch.randn(4, 6).bfloat16().float()  # every row exactly a bfloat16 row...
    mixed[2] += 1e-3  # ...but one: the whole tensor is not bfloat16-exact, rows 0, 1, 3 are
    whole = _local_row_digests(mixed)
    assert _local_row_digests(mixed[:2]) + _local_row_digests(mixed[2:]) == whole  # rank 0's rows all bf16-exact
    assert _local_row_digests(mixed[:2]) == _local_row_digests(mixed[:2].bfloat16())
    nan = torch.tensor([[float("nan"), 1.0]], dtype=torch.float64)
    assert _local_row_digests(nan) == _local_row_digests(nan.float())  # a NaN row: float32 holds it
