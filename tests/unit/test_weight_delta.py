"""Delta weight sync: encode/apply is bit-exact, falls back to dense, rejects bad payloads."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hpcrl.weights.checksum import payload_bytes, state_dict_checksum  # noqa: E402
from hpcrl.weights.delta import BLOCK, Delta, apply_delta, encode_delta  # noqa: E402


def policy(seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": (torch.randn(300, 700, generator=g) * 0.02).to(dtype),  # > 3 blocks of 65536
        "b.weight": (torch.randn(64, generator=g)).to(dtype),
        "c.weight": torch.zeros(3, 5, dtype=dtype),
    }


def adam_like_step(p: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # c.weight is frozen: it must travel as "same" (nothing)
    return {
        k: v.clone()
        if k == "c.weight"
        else (v.float() + lr * torch.randn(v.shape, generator=g).sign()).to(v.dtype)
        for k, v in p.items()
    }


def roundtrip(prev, new):
    d = encode_delta(prev, new, 3, state_dict_checksum(prev))
    # through the wire form: manifest JSON + plain tensors
    d2 = Delta.from_manifest(d.manifest_json(), {k: v.clone() for k, v in d.tensors.items()})
    base = {k: v.clone() for k, v in prev.items()}
    touched = apply_delta(base, d2)
    return d, base, touched


def test_sparse_delta_is_bit_exact_and_small() -> None:
    prev = policy()
    new = adam_like_step(prev, 1e-5, 1)  # a few % of the bf16 elements change (ulp at 0.02 is ~1.5e-4)
    d, rebuilt, touched = roundtrip(prev, new)
    assert state_dict_checksum(rebuilt) == state_dict_checksum(new)
    assert d.layout["a.weight"][2] == "sparse"
    assert d.layout["c.weight"][2] == "same" and "c.weight" not in touched
    assert d.nbytes < 0.5 * payload_bytes(new)


def test_positions_in_every_block_including_the_high_half() -> None:
    prev = {"w": torch.zeros(5 * BLOCK + 17, dtype=torch.bfloat16)}
    new = {"w": prev["w"].clone()}
    idx = torch.tensor([0, 1, 40000, BLOCK - 1, BLOCK, 3 * BLOCK + 65535, 5 * BLOCK + 16])
    new["w"][idx] = torch.tensor([1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0], dtype=torch.bfloat16)
    d, rebuilt, _ = roundtrip(prev, new)
    assert d.layout["w"][2] == "sparse"
    assert torch.equal(rebuilt["w"].view(torch.int16), new["w"].view(torch.int16))


def test_bits_not_values_are_compared() -> None:
    prev = {"w": torch.tensor([0.0, float("nan"), 1.0] * 100, dtype=torch.float32)}
    new = {"w": prev["w"].clone()}
    new["w"][0] = -0.0  # equal as a value, different bits
    d, rebuilt, _ = roundtrip(prev, new)
    assert d.layout["w"][2] != "same"
    assert torch.equal(rebuilt["w"].view(torch.int32), new["w"].view(torch.int32))


def test_dense_when_sparse_is_not_smaller_and_fp32_base_receives_bf16() -> None:
    prev = policy()
    new = {k: (v.float() + 1.0).to(v.dtype) for k, v in prev.items()}  # everything changes
    d, rebuilt, _ = roundtrip(prev, new)
    assert all(kind == "dense" for _, _, kind in d.layout.values())
    assert state_dict_checksum(rebuilt) == state_dict_checksum(new)
    # a server running float32 holds bf16 values exactly: applying there and casting back is exact
    small = adam_like_step(prev, 1e-5, 2)
    d = encode_delta(prev, small, 0, "x")
    base32 = {k: v.float() for k, v in prev.items()}
    apply_delta(base32, d)
    assert state_dict_checksum({k: v.to(torch.bfloat16) for k, v in base32.items()}) == state_dict_checksum(
        small
    )


def test_bad_payloads_are_refused() -> None:
    prev = policy()
    d = encode_delta(prev, adam_like_step(prev, 1e-5, 1), 0, "x")
    bad = dict(d.tensors)
    bad["a.weight/index"] = bad["a.weight/index"][:-1]
    with pytest.raises(ValueError, match="disagree"):
        Delta.from_manifest(d.manifest(), bad)
    with pytest.raises(ValueError, match="not in the manifest"):
        Delta.from_manifest(d.manifest(), {**d.tensors, "zzz": torch.zeros(1)})
    with pytest.raises(ValueError, match="malformed"):
        Delta.from_manifest({"layout": {}}, {})
    with pytest.raises(ValueError, match="does not hold"):
        apply_delta({"a.weight": prev["a.weight"].clone()}, d)
