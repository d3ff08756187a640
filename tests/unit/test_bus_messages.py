"""Wire format: round trips, zero-copy decoding, validation, and every corruption detected."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from hpcrl.bus import CorruptMessageError, PolicyReady, ServerInfo, Shutdown, TrainBatch, decode, encode
from hpcrl.bus import messages as m


def make_batch(
    step: int = 0, rank: int = 0, world_size: int = 1, samples: int = 3, sample_len: int = 5, **kw
):
    """A small valid batch whose content is a function of (step, rank): lets tests check identity."""
    seq_lens = np.full(samples, sample_len, dtype=np.int32)
    t = samples * sample_len
    rng = np.random.default_rng(step * 1000 + rank)
    fields = dict(
        step=step,
        rank=rank,
        world_size=world_size,
        input_ids=rng.integers(0, 50_000, t, dtype=np.int32),
        position_ids=np.concatenate([np.arange(n, dtype=np.int32) for n in seq_lens])
        if samples
        else np.zeros(0),
        seq_lens=seq_lens,
        loss_mask=(np.arange(t) % sample_len) >= 2,
        advantages=rng.standard_normal(t).astype(np.float32),
        inference_logprobs=-rng.random(t).astype(np.float32),
        policy_versions=np.full(samples, max(step - 1, 0), dtype=np.int32),
        temperatures=np.ones(samples, dtype=np.float32),
        env_names=["reverse_text"] * samples,
        example_ids=np.arange(samples, dtype=np.int64) + 1000 * step + 100 * rank,
        rewards=rng.random(samples).astype(np.float32),
        total_loss_tokens=samples * (sample_len - 2) * world_size,
    )
    fields.update(kw)
    return TrainBatch(**fields)


def assert_same_batch(a: TrainBatch, b: TrainBatch) -> None:
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


def test_train_batch_round_trip_is_zero_copy_aligned_and_writable():
    batch = make_batch(step=7, teacher_logprobs=np.zeros(15, dtype=np.float32))
    buf = np.frombuffer(encode(batch), dtype=np.uint8).copy()  # writable, like a file read
    out = decode(buf, TrainBatch)
    assert_same_batch(batch, out)
    assert out.reference_logprobs is None
    for name in ("input_ids", "advantages", "example_ids", "loss_mask", "teacher_logprobs"):
        arr = getattr(out, name)
        assert np.shares_memory(arr, buf), f"{name} was copied"
        assert arr.flags.aligned and arr.flags.writeable and arr.flags.c_contiguous
        assert arr.ctypes.data % 8 == 0 or arr.itemsize < 8
    assert out.input_ids.dtype == np.int32 and out.loss_mask.dtype == np.bool_
    # bytes input gives read-only views (still no copy)
    assert not decode(encode(batch), TrainBatch).input_ids.flags.writeable


def test_constructor_coerces_dtypes_and_offers_helpers():
    batch = make_batch(samples=2, sample_len=4, input_ids=list(range(8)), step=np.int64(3))
    assert batch.input_ids.dtype == np.int32
    assert batch.num_tokens == 8 and batch.num_samples == 2 and batch.num_loss_tokens == 4
    assert batch.sample_offsets().tolist() == [0, 4, 8]
    assert decode(encode(batch)).step == 3  # numpy scalars encode as plain ints


def test_empty_batch_round_trips():
    batch = make_batch(samples=0, total_loss_tokens=0)
    out = decode(encode(batch), TrainBatch)
    assert out.num_tokens == 0 and out.num_samples == 0 and out.env_names == []


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(advantages=np.zeros(3, dtype=np.float32)), "advantages has 3 tokens"),
        (dict(rewards=np.zeros(2, dtype=np.float32)), "rewards has 2 samples"),
        (dict(env_names=["a"]), "env_names has 1"),
        (dict(seq_lens=np.array([5, 5, 4], dtype=np.int32)), "seq_lens sums to 14"),
        (dict(rank=1), "rank 1 outside world_size 1"),
        (dict(input_ids=np.zeros((3, 5))), "must be 1-D"),
    ],
)
def test_invalid_batches_raise_value_error(override, match):
    with pytest.raises(ValueError, match=match):
        make_batch(**override)


def test_small_messages_round_trip():
    msgs = [
        PolicyReady(
            step=4, transport="filesystem", path="/w/step_4", checksum="ab", num_params=10, num_bytes=40
        ),
        Shutdown(reason="done", origin="orchestrator"),
        ServerInfo(index=0, base_url="http://h:1/v1", host="h", port=1, pid=2, model="tiny"),
    ]
    for msg in msgs:
        assert decode(encode(msg), type(msg)) == msg
        assert m.peek_type(encode(msg)) is type(msg)
    with pytest.raises(ValueError, match="path is required"):
        PolicyReady(step=1, transport="filesystem", checksum="x", num_params=1, num_bytes=1)


@pytest.mark.parametrize("algo", ["crc32", "xxh3"])
def test_every_bit_flip_and_truncation_is_detected(algo):
    data = encode(make_batch(samples=2, sample_len=3), checksum=algo)
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            flipped = bytearray(data)
            flipped[i] ^= bit
            with pytest.raises(CorruptMessageError):
                decode(flipped, TrainBatch)
    for n in range(len(data)):
        with pytest.raises(CorruptMessageError):
            decode(data[:n], TrainBatch)
    with pytest.raises(CorruptMessageError, match="trailing"):
        decode(data + b"\0", TrainBatch)


def _reheader(data: bytes, **fields) -> bytes:
    """Rewrite header fields and fix the header crc: simulates a well-formed but foreign frame."""
    names = [
        "magic",
        "version",
        "tag",
        "algo",
        "flags",
        "reserved",
        "meta_len",
        "blob_len",
        "checksum",
        "crc",
    ]
    values = dict(zip(names, m.HEADER.unpack_from(data), strict=True))
    values.update(fields)
    head = bytearray(m.HEADER.pack(*values.values()))
    struct.pack_into("<I", head, m.HEADER_SIZE - 4, zlib.crc32(head[: m.HEADER_SIZE - 4]))
    return bytes(head) + data[m.HEADER_SIZE :]


def test_foreign_files_are_named_clearly():
    data = encode(Shutdown(reason="r", origin="o"))
    cases = {
        b"not a bus file at all, just some text in a file" * 2: "not a bus file",
        _reheader(data, version=m.SCHEMA_VERSION + 1): "schema version",
        _reheader(data, tag=99): "unknown message type tag",
        _reheader(data, algo=7): "unknown checksum",
    }
    for blob, match in cases.items():
        with pytest.raises(CorruptMessageError, match=match):
            decode(blob, Shutdown)
    with pytest.raises(CorruptMessageError, match="holds a Shutdown, expected a TrainBatch"):
        decode(data, TrainBatch)


def test_malicious_array_descriptors_are_rejected():
    blob = memoryview(bytes(128))
    for desc, match in [
        (["|O8", [1], 0, 8], "not allowed"),
        (["<i4", [4], 128, 16], "outside"),
        (["<i4", [4], 32, 16], "outside"),
        (["<i4", [4], 0, 15], "does not match"),
        (["<i4", [-1], 0, 4], "bad shape"),
        (["nonsense", [1], 0, 4], "bad dtype"),
        ("x", "must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            m._array_from_wire(desc, blob)
    batch = make_batch()
    batch.input_ids = np.array(["a"] * 15, dtype=object)  # bypassing the constructor's coercion
    with pytest.raises(ValueError, match="bool/int/uint/float"):
        m.encode_parts(batch)


def test_non_messages_and_bad_checksum_names_are_value_errors():
    with pytest.raises(ValueError, match="not a bus message type"):
        encode(m.Ring("x"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checksum must be one of"):
        encode(Shutdown(reason="r", origin="o"), checksum="md5")


def test_no_pickle_in_the_bus():
    src = Path(m.__file__).parent
    for f in src.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"import pickle|from pickle|pickle\.|allow_pickle|cloudpickle", text), f
