"""Pieces, buckets and the sharded manifest (hpcrl.weights.shards / manifest / checksum): hand-checked
sizes and digests, and every broken directory refused in one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrl.weights.checksum import digest_sum, rows_digest, state_dict_checksum
from hpcrl.weights.manifest import MANIFEST, assemble, finish, read_manifest, write_pieces
from hpcrl.weights.shards import Piece, buckets, split_rows


def _policy() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 4, generator=g).to(torch.bfloat16),  # 10 rows of 8 B
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),  # 4 rows of 2 B
        "scale": torch.tensor(3.0),  # 0-dim: one row of 4 B
    }


def _halves(policy: dict[str, torch.Tensor]) -> list[list[Piece]]:
    """Two ranks as FSDP2 would shard dim 0 (torch.chunk): rank 0 the first ceil(n/2) rows; the 0-dim
    tensor on rank 0 only."""
    ranks: list[list[Piece]] = [[], []]
    for name, t in policy.items():
        if t.dim() == 0:
            ranks[0].append(Piece(name, (), 0, t))
            continue
        a = -(-t.shape[0] // 2)
        ranks[0].append(Piece(name, tuple(t.shape), 0, t[:a]))
        ranks[1].append(Piece(name, tuple(t.shape), a, t[a:]))
    return ranks


def test_row_digests_add_up_to_the_whole_tensor() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    whole = rows_digest(t)
    assert digest_sum([rows_digest(t[:1], 0), rows_digest(t[1:4], 1), rows_digest(t[4:], 4)]) == whole
    assert rows_digest(t[1:4], 0) != rows_digest(t[1:4], 1)  # a row's place is part of its digest
    swapped = t[[1, 0, 2, 3, 4, 5]]
    assert rows_digest(swapped) != whole
    assert state_dict_checksum({"a": t}) == state_dict_checksum([("a", t.clone())])
    assert state_dict_checksum({"a": t}) != state_dict_checksum({"a": t.reshape(4, 6)})  # shape hashed


def test_buckets_and_row_splits_have_the_sizes_asked() -> None:
    p = Piece("e", (10, 4), 0, torch.zeros(10, 4, dtype=torch.bfloat16))  # 80 B, 8 B per row
    cut = list(split_rows(p, 24))  # 3 rows (24 B) per piece: rows 0-3, 3-6, 6-9, 9-10
    assert [(q.row0, q.rows, q.nbytes) for q in cut] == [(0, 3, 24), (3, 3, 24), (6, 3, 24), (9, 1, 8)]
    assert list(split_rows(p, 1))[0].rows == 1  # never less than one row
    small = [Piece(str(i), (2,), 0, torch.zeros(2)) for i in range(5)]  # 8 B each
    assert [len(b) for b in buckets(small, 20)] == [2, 2, 1]
    assert [len(b) for b in buckets([*small[:1], p, *small[1:2]], 20)] == [1, 1, 1]  # big piece alone


def test_pieces_of_two_ranks_assemble_to_the_full_policy(tmp_path: Path) -> None:
    policy = _policy()
    for rank, pieces in enumerate(_halves(policy)):
        w = write_pieces(tmp_path, rank, pieces, bucket_bytes=24)
        assert w.files >= 2  # rank 0: 5 rows of embed (40 B) cut at 24 B, and more
    m = finish(tmp_path, 7, world=2)
    assert m.checksum == state_dict_checksum(policy)  # today's full checksum, from pieces only
    assert m.num_params == 10 * 4 + 4 + 1 and m.num_bytes == 80 + 8 + 4
    assert [p[2:4] for p in m.tensors["embed.weight"].pieces] == [(0, 3), (3, 5), (5, 8), (8, 10)]
    got = dict(assemble(tmp_path))
    assert list(got) == sorted(policy)
    for k, v in policy.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype
    assert read_manifest(tmp_path).step == 7


def _written(tmp_path: Path) -> Path:
    for rank, pieces in enumerate(_halves(_policy())):
        write_pieces(tmp_path, rank, pieces, bucket_bytes=1 << 20)
    finish(tmp_path, 1, world=2)
    return tmp_path


def test_a_missing_rank_is_refused_before_any_manifest(tmp_path: Path) -> None:
    write_pieces(tmp_path, 0, _halves(_policy())[0], bucket_bytes=1 << 20)
    with pytest.raises(ValueError, match="rank00001.json is missing: trainer rank 1 did not finish"):
        finish(tmp_path, 1, world=2)
    with pytest.raises(ValueError, match="has no manifest.json: the sharded publish did not complete"):
        read_manifest(tmp_path)


def test_torn_manifest_is_refused_in_one_line(tmp_path: Path) -> None:
    d = _written(tmp_path)
    text = (d / MANIFEST).read_text()
    (d / MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"manifest.json is corrupt: ") as e:
        read_manifest(d)
    assert "\n" not in str(e.value)


def test_a_piece_left_out_of_the_manifest_is_a_gap(tmp_path: Path) -> None:
    d = _written(tmp_path)
    raw = json.loads((d / MANIFEST).read_text())
    raw["tensors"]["embed.weight"]["pieces"].pop()  # rank 1's rows 5..10
    (d / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"pieces of 'embed.weight' cover rows \[0, 5\) of 10"):
        read_manifest(d)


def test_missing_or_altered_piece_file_is_refused(tmp_path: Path) -> None:
    d = _written(tmp_path)
    (d / "rank00001-00000.safetensors").unlink()
    with pytest.raises(ValueError, match=r"piece file .*rank00001-00000.safetensors is missing"):
        list(assemble(d))
    d2 = _written(tmp_path / "b")
    from safetensors.torch import load_file, save_file

    f = d2 / "rank00000-00000.safetensors"
    t = load_file(str(f))
    t["embed.weight#rows0"][0, 0] += 1  # one element of one row
    save_file(t, str(f))
    with pytest.raises(ValueError, match=r"piece 'embed.weight#rows0' .* does not match its digest"):
        list(assemble(d2))
