"""hpcrl.inference.routed: a choice's routed_experts in each server's wire shape, read back as the
completion's rows (hand-built arrays: 2 layers x top-2)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np

from hpcrl.envs.verifiers.v1_env import branch_routes, branch_turns
from hpcrl.inference.routed import completion_rows, encode

# positions 0..5: a 3-token prompt, then 3 completion tokens; row p = [[p, p+1], [p+2, p+3]]
FULL = np.array([[[p, p + 1], [p + 2, p + 3]] for p in range(6)], np.int16)


def test_nested_list_is_the_completion_itself() -> None:
    rows = FULL[3:].tolist()
    assert completion_rows(rows, prompt_len=3, n=3) == rows
    assert completion_rows(rows, prompt_len=3, n=4) is None  # another length: not replayed


def test_vllm_npy_string_skips_the_prompt_and_pads_the_last_token() -> None:
    buf = io.BytesIO()
    np.save(buf, FULL[:5].astype(np.uint8))  # vLLM: tokens - 1 rows, from position 0
    payload = base64.b64encode(buf.getvalue()).decode()
    assert completion_rows(payload, prompt_len=3, n=3) == [
        FULL[3].tolist(),
        FULL[4].tolist(),
        [[-1, -1], [-1, -1]],
    ]
    # asked with routed_experts_prompt_start = 2: rows begin at position 2
    buf = io.BytesIO()
    np.save(buf, FULL[2:5])
    payload = base64.b64encode(buf.getvalue()).decode()
    assert completion_rows(payload, 3, 3, prompt_start=2)[:2] == FULL[3:5].tolist()


def test_dict_shape_round_trips_from_its_start() -> None:
    assert completion_rows(encode(FULL[3:], start=3), 3, 3) == FULL[3:].tolist()
    assert completion_rows(encode(FULL, start=0), 3, 3) == FULL[3:].tolist()
    assert completion_rows(encode(FULL[4:], start=4), 3, 3) is None  # rows start after the completion does


def test_malformed_payloads_are_no_replay_never_an_error() -> None:
    for bad in ("%%%", {"data": "AQ=="}, {"data": "AQ==", "shape": [7, 2, 2]}, 5, [[1, 2]]):
        assert completion_rows(bad, 3, 3) is None
    assert completion_rows(None, 3, 3) is None


def test_v1_branch_routes_fill_nodes_without_rows_with_minus_one() -> None:
    nodes = [
        SimpleNamespace(token_ids=[1, 2, 3], routed_experts=None),  # prompt: the server sent no rows
        SimpleNamespace(token_ids=[4, 5], routed_experts=FULL[3:5]),  # sampled
        SimpleNamespace(token_ids=[6], routed_experts=None),  # environment message
        SimpleNamespace(token_ids=[7], routed_experts=FULL[5:6]),
    ]
    routes = branch_routes(nodes)
    assert routes.shape == (7, 2, 2)
    assert (routes[:3] == -1).all() and (routes[5] == -1).all()
    assert routes[3:5].tolist() == FULL[3:5].tolist() and routes[6].tolist() == FULL[5].tolist()
    turns = branch_turns(
        [1, 2, 3, 4, 5, 6, 7], [False] * 3 + [True] * 2 + [False, True], [0.0] * 7, 0, routes
    )
    assert [t.routed_experts for t in turns] == [FULL[3:5].tolist(), [FULL[5].tolist()]]
    assert branch_routes([SimpleNamespace(token_ids=[1], routed_experts=None)]) is None
