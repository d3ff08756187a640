"""Router replay plumbing: routes laid out along sequences, packed, carried on the bus compactly."""

from __future__ import annotations

import numpy as np

from hpcrl.bus.messages import TrainBatch, compact_routes, decode, encode
from hpcrl.envs.base import Turn
from hpcrl.orchestrator import routes
from hpcrl.orchestrator.packing import Sample, pack_for_ranks


def _turn(prompt: list[int], comp: list[int], routed) -> Turn:
    return Turn(
        text="",
        prompt_token_ids=prompt,
        completion_token_ids=comp,
        completion_logprobs=[0.0] * len(comp),
        policy_steps=[0],
        routed_experts=routed,
    )


def _sample(n: int, routed) -> Sample:
    return Sample(
        input_ids=np.arange(n),
        loss_mask=np.arange(n) >= 1,
        inference_logprobs=np.zeros(n, np.float32),
        advantage=1.0,
        policy_version=0,
        example_id=n,
        env_name="e",
        temperature=1.0,
        reward=0.0,
        routed_experts=routed,
    )


def test_stitched_routes_put_each_turn_at_its_completion_tokens() -> None:
    t1 = _turn([1, 2], [3, 4], [[[0, 1]], [[2, 3]]])  # 1 layer, top-2
    t2 = _turn([1, 2, 3, 4, 5], [6], [[[7, 6]]])  # env token 5 between the turns
    w = routes.width([t1, t2])
    assert w == 2
    rows = routes.stitched_routes([t1, t2], w, 6)
    assert rows == [[-1, -1], [-1, -1], [0, 1], [2, 3], [-1, -1], [7, 6]]
    assert routes.turn_routes(t2, w) == [[-1, -1]] * 5 + [[7, 6]]
    assert routes.width([_turn([1], [2], None)]) is None
    assert routes.width([_turn([1], [2], [[[0, 1]], [[1, 2]]])]) is None  # wrong length: ignored


def test_compact_dtype_and_bus_round_trip() -> None:
    r = compact_routes(np.array([[0, 7], [-1, -1]]))
    assert r.dtype == np.uint8 and r.tolist() == [[0, 7], [255, 255]]
    assert compact_routes(np.array([[300, -1]])).dtype == np.int16

    batches, _ = pack_for_ranks([_sample(3, np.array([[-1, -1], [1, 2], [3, 4]])), _sample(2, None)], 1, 16)
    b = batches[0]
    tb = TrainBatch(step=1, rank=0, world_size=1, total_loss_tokens=3, **b)
    back = decode(encode(tb), TrainBatch)
    assert back.routed_experts.dtype == np.uint8
    ids = back.route_ids()
    assert ids.shape == (5, 2) and (ids == -1).sum() == 6
    assert sorted(map(tuple, ids[ids[:, 0] >= 0].tolist())) == [(1, 2), (3, 4)]


def test_max_vio_and_metrics_by_hand() -> None:
    import torch

    from hpcrl.models.qwen3.moe import MoE
    from hpcrl.trainer.moe_metrics import collect, max_vio

    assert max_vio(torch.tensor([2, 2, 2, 2])) == 0.0
    assert max_vio(torch.tensor([8, 0, 0, 0])) == 3.0  # (8 - 2) / 2
    model = torch.nn.Sequential(MoE(4, 2, num_experts=4, top_k=2, norm_topk_prob=True))
    m = model[0]
    m.stats.load = torch.tensor([3, 1, 0, 0])
    m.stats.confidence, m.stats.tokens = 1.5, 2
    m.stats.replay_slots, m.stats.replay_hits = 4, 3
    out = collect(model)
    assert out["moe/max_vio/layer_0"] == 2.0  # (3 - 1) / 1
    assert out["moe/routing_confidence/layer_0"] == 0.75
    assert out["moe/load_max/layer_0"] == 0.75 and out["moe/load_min/layer_0"] == 0.0
    assert out["moe/replay_hit_rate"] == 0.75
    assert m.stats.tokens == 0  # reset for the next step


def test_prompt_routes_fill_prompt_and_environment_tokens_earliest_turn_first() -> None:
    t1 = _turn(
        [1, 2],
        [3, 4],
        [
            [[0, 1]],
            [[2, 3]],
        ],
    )
    t1.prompt_routed_experts = [[[5, 6]], [[6, 7]]]
    # turn 2's prefill re-routed token 3 (position 2) differently: turn 1's decode route stays, its
    # last token (position 3, -1 from the decode) and the env token 5 take turn 2's prefill routes
    t2 = _turn([1, 2, 3, 4, 5], [6], [[[7, 6]]])
    t2.prompt_routed_experts = [[[5, 6]], [[6, 7]], [[1, 1]], [[4, 0]], [[3, 2]]]
    t1.routed_experts = [[[0, 1]], [[-1, -1]]]  # the engine's shape: the last token was never fed back
    rows = routes.stitched_routes([t1, t2], 2, 6)
    assert rows == [[5, 6], [6, 7], [0, 1], [4, 0], [3, 2], [7, 6]]
    assert routes.turn_routes(t1, 2) == [[5, 6], [6, 7], [0, 1], [-1, -1]]
    t2.prompt_routed_experts = [[[5, 6]]]  # wrong length: ignored
    assert routes.stitched_routes([t2], 2, 6) == [[-1, -1]] * 5 + [[7, 6]]


def test_cp_group_merges_routes_and_slices_them_per_rank() -> None:
    """Context parallelism: a cp group trains the union of its ranks' shards, routes included (one shard
    uint8 on the wire, one int16, one without), and each rank replays the routes of its own slice."""
    import torch

    from hpcrl.trainer.context_parallel import local_range, local_routes, merge_batches

    def shard(routed, n: int) -> TrainBatch:
        b, _ = pack_for_ranks([_sample(n, routed)], 1, 16)
        return decode(
            encode(TrainBatch(step=1, rank=0, world_size=1, total_loss_tokens=n - 1, **b[0])), TrainBatch
        )

    a = shard(np.array([[0, 1], [-1, -1]]), 2)  # uint8 on the wire: 255 = none
    b = shard(None, 3)
    c = shard(np.array([[300, -1], [2, 3]]), 2)  # int16: an id >= 255
    merged = merge_batches([a, b, c])
    assert merged.route_ids().tolist() == [[0, 1], [-1, -1], [-1, -1], [-1, -1], [-1, -1], [300, -1], [2, 3]]
    assert merge_batches([b, b]).routed_experts is None
    routed = torch.tensor([[1, 2], [3, 4], [5, 6]])
    padded, lo, hi = local_range(3, 2, 1)  # 3 tokens over cp = 2: one pad token, rank 1 holds [2, 4)
    assert local_routes(routed, padded - 3, lo, hi).tolist() == [[[5, 6], [-1, -1]]]


def test_prompt_rows_from_every_wire_shape() -> None:
    """The prompt's routes of a choice: hpcrl's chat field, or the rows of a generate answer (the dict)
    or of vLLM's .npy that fall inside the prompt (-1 before `start`)."""
    import base64
    import io

    from hpcrl.inference.routed import encode, prompt_rows

    listed = {"prompt_routed_experts": [[[0, 1]], [[2, 3]]], "routed_experts": [[[6, 7]], [[-1, -1]]]}
    assert prompt_rows(listed, 2) == [[[0, 1]], [[2, 3]]]
    assert prompt_rows(listed, 3) is None  # wrong length: no replay, never misaligned
    assert prompt_rows({"routed_experts": [[[6, 7]]]}, 2) is None  # completion rows only
    # the generate route's dict from position 1 of a 3-token prompt: rows 1, 2, then the completion's
    dic = {"routed_experts": encode(np.array([[[2, 3]], [[4, 5]], [[6, 7]], [[-1, -1]]]), start=1)}
    assert prompt_rows(dic, 3) == [[[-1, -1]], [[2, 3]], [[4, 5]]]
    assert prompt_rows({"routed_experts": encode(np.array([[[6, 7]]]), start=3)}, 3) is None
    buf = io.BytesIO()
    np.save(buf, np.array([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]], np.uint8))  # vLLM: (tokens - 1, ...)
    npy = {"routed_experts": base64.b64encode(buf.getvalue()).decode()}
    assert prompt_rows(npy, 3) == [[[0, 1]], [[2, 3]], [[4, 5]]]


def test_v1_branch_turns_carry_the_branch_routes() -> None:
    """A verifiers v1 branch's routes ([tokens, layers, k]) cut into turns, then stitched back."""
    from hpcrl.envs.verifiers.v1_env import branch_turns

    ids = [1, 2, 3, 4, 5, 6]
    mask = [False, False, True, True, False, True]
    routes = np.arange(12).reshape(6, 1, 2)
    turns = branch_turns(ids, mask, [0.0] * 6, 0, routes)
    assert [t.prompt_token_ids for t in turns] == [[1, 2], [1, 2, 3, 4, 5]]
    assert turns[0].routed_experts == [[[4, 5]], [[6, 7]]] and turns[0].prompt_routed_experts == [
        [[0, 1]],
        [[2, 3]],
    ]
    assert stitched(turns) == routes.reshape(6, 2).tolist()


def stitched(turns: list[Turn]) -> list[list[int]]:
    return routes.stitched_routes(turns, 2, 6)
