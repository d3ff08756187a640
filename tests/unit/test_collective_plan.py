"""Protocol 4's plan (hpcrl.weights.collective): buckets per sender, the rounds, and the policy
checksum and row coverage computed from the parts' records alone."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hpcrl.weights import collective as coll  # noqa: E402
from hpcrl.weights.checksum import state_dict_checksum  # noqa: E402
from hpcrl.weights.shards import Piece  # noqa: E402


def rec(name: str, row0: int, rows: int, digest: int = 0, shape=(4, 2)) -> list:
    return [name, "float32", list(shape), row0, rows, f"{digest:032x}"]


def test_round_k_holds_bucket_k_of_every_sender() -> None:
    a0, a1, b0 = [rec("a", 0, 1)], [rec("a", 1, 1)], [rec("a", 2, 2)]
    rounds = coll.schedule([[a0, a1], [b0]])  # rank 0 has two buckets, rank 1 one
    assert rounds == [[[0, a0], [1, b0]], [[0, a1]]]


def test_checksum_from_parts_equals_the_full_tensors() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    s = torch.tensor(1.5)
    rank0 = [Piece("w", (6, 4), 0, t[:2]), Piece("s", (), 0, s)]
    rank1 = [Piece("w", (6, 4), 2, t[2:])]
    per = [coll.bucket_records(coll.plan_buckets(p, 40)) for p in (rank0, rank1)]
    # 40 bytes: rank 0's 2 rows (32 bytes) and the scalar (4) share a bucket; rank 1's 4 rows (64 bytes)
    # are cut into parts of 2 rows (32 bytes), one bucket each
    assert [len(b) for b in per] == [1, 2] and [r[3] for b in per[1] for r in b] == [2, 4]
    tensors, checksum = coll.layout_and_checksum(coll.schedule(per))
    assert tensors == [("s", "float32", ()), ("w", "float32", (6, 4))]
    assert checksum == state_dict_checksum({"w": t, "s": s})


@pytest.mark.parametrize(
    "runs, match",
    [
        ([(0, 2), (3, 1)], r"rows 2\.\.3 are missing"),
        ([(0, 2), (1, 3)], r"rows 2\.\.1 are sent twice"),
        ([(0, 3)], "pieces cover 3 of 4 rows"),
    ],
)
def test_a_plan_that_does_not_cover_every_row_once_is_refused(runs, match) -> None:
    rounds = [[[0, [rec("w", a, n) for a, n in runs]]]]
    with pytest.raises(ValueError, match=match):
        coll.layout_and_checksum(rounds)
