"""[orchestrator.algo] type = "echo" (prime-rl's orchestrator/algo/echo.py): which env-provided tokens
get a cross-entropy weight, on real multi-turn rollouts through hpcrl's chat-template client, and the
trainer's ce term by hand (value and gradient)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from hpcrl.bus import TrainBatch, decode, encode
from hpcrl.config.sections.algo import AlgoConfig, EchoFilterConfig, EchoRoleConfig, EchoRolesConfig
from hpcrl.envs import load_environment
from hpcrl.orchestrator.algo.echo import Echo, piece_weights
from hpcrl.orchestrator.batch import build_batches, repack_batches, unpack_samples
from hpcrl.orchestrator.chat import RolloutClient
from hpcrl.orchestrator.env_roles import ROLES, bridge_env_roles, char_roles
from hpcrl.orchestrator.packing import Sample
from hpcrl.orchestrator.state import Piece
from hpcrl.orchestrator.stitching import to_record
from hpcrl.trainer.loss import LossParams, ce_loss, compute_loss, summarize


def keep_first_tokens(rollout, n: int = 0) -> list[list[bool]]:
    """An echo filter (`[orchestrator.algo.filter]`): keep only the first `n` tokens of each piece."""
    return [[t < n for t in range(len(p.input_ids))] for p in rollout.pieces]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedPool:
    """The ServerPool a RolloutClient talks to, answering each request with the next scripted reply
    (tokenized by the real tokenizer, ending with <|im_end|> as the server's stop token)."""

    request_model = "m"

    def __init__(self, tok, replies: list[str]):
        self.tok, self.replies = tok, list(replies)

    def pick(self) -> int:
        return 0

    async def call(self, server, kind, payload, model=None, **body):
        text = self.replies.pop(0)
        ids = self.tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        if kind == "chat_completion":
            prompt = self.tok.apply_chat_template(
                payload, tools=body.get("tools"), add_generation_prompt=True, tokenize=False
            )
            logprobs = {"content": [{"logprob": -0.5}] * len(ids)}
            return {
                "prompt_token_ids": self.tok(prompt, add_special_tokens=False)["input_ids"],
                "choices": [{"message": {"content": text}, "token_ids": ids, "logprobs": logprobs}],
            }
        return {
            "choices": [{"text": text, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]
        }


def rollout(tok, env, task, replies: list[str], env_roles: bool = True):
    client = RolloutClient(ScriptedPool(tok, replies), tok, 4096, None, lambda: 0)
    client.env_roles = env_roles  # as the train Generator of a run with an echo algo sets it
    traj = asyncio.run(env.rollout(task, client, {}))
    return traj, to_record(0, traj)


def echo(**roles: float) -> AlgoConfig:
    table = EchoRolesConfig(**{k: EchoRoleConfig(alpha=a) for k, a in roles.items()})
    return AlgoConfig(type="echo", roles=table)


def weighted_spans(tok, piece: Piece) -> list[tuple[str, float]]:
    """The runs of equal nonzero weight, decoded."""
    w = piece.ce_weights or [0.0] * len(piece.input_ids)
    spans, cur, cur_w = [], [], 0.0
    for tid, x in [*zip(piece.input_ids, w), (None, 0.0)]:
        if cur and x != cur_w:
            spans.append((tok.decode(cur), cur_w))
            cur = []
        if x:
            cur.append(tid)
        cur_w = x
    return spans


@pytest.fixture(scope="module")
def calculator():
    env = load_environment("calculator", num_examples=4, num_eval_examples=0, num_val_examples=0)
    return env, env.tasks()[0]


def tool_call(task) -> str:
    expr = task.info["expression"]
    return f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


def test_tool_rollout_weights_the_tool_result_body_at_the_default_alpha(tok, calculator) -> None:
    env, task = calculator
    traj, rec = rollout(tok, env, task, [tool_call(task), f"#### {task.answer}"])
    assert traj.reward == 1.0 and rec.bridge_breaks == 0 and len(rec.pieces) == 1
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    Echo(AlgoConfig(type="echo")).weigh([rec])  # the default: tool, alpha 0.1
    (p,) = rec.pieces
    # exactly the tool message's body ("45" for this task), not its <|im_start|>tool / <|im_end|> wrap
    assert weighted_spans(tok, p) == [(task.answer, 0.1)]
    w, mask = np.asarray(p.ce_weights), np.asarray(p.loss_mask)
    assert not np.any(mask & (w != 0))  # outside the rl mask
    ids = tok(task.answer, add_special_tokens=False)["input_ids"]
    assert int(np.count_nonzero(w)) == len(ids) and math.isclose(float(w.sum()), 0.1 * len(ids))
    # the user role is not in the default table; enabling it alone weights nothing here: the only user
    # message is the initial prompt, which echo excludes
    Echo(echo(user=1.0)).weigh([rec])
    assert p.ce_weights is None


def test_a_run_without_echo_records_no_roles_and_the_same_tokens(tok, calculator) -> None:
    """Roles are recorded only where a run trains echo (Generator.env_roles): the same rollout without
    them has the same tokens, and its pieces carry no role bytes."""
    env, task = calculator
    replies = [tool_call(task), f"#### {task.answer}"]
    _, with_roles = rollout(tok, env, task, replies)
    _, without = rollout(tok, env, task, replies, env_roles=False)
    assert [p.input_ids for p in without.pieces] == [p.input_ids for p in with_roles.pieces]
    assert with_roles.pieces[0].env_roles is not None and without.pieces[0].env_roles is None


def test_user_feedback_of_later_turns_only(tok) -> None:
    env = load_environment("alphabet-sort", num_examples=4, num_eval_examples=0, num_val_examples=0)
    task = env.tasks()[0]
    replies = ["Ada\nBea", "Ada\nBea\nCy", "Ada\nBea\nCy\nDi", "x", "y"]
    traj, rec = rollout(tok, env, task, replies)
    users = [i for i, m in enumerate(traj.messages) if m["role"] == "user"]
    first_reply = next(i for i, m in enumerate(traj.messages) if m["role"] == "assistant")
    later = [traj.messages[i]["content"] for i in users if i > first_reply]
    assert users[0] < first_reply and later, traj.messages  # a prompt user message and feedback
    assert rec.bridge_breaks == 0 and len(rec.pieces) == 1
    Echo(echo(user=0.5, system=2.0)).weigh([rec])
    (p,) = rec.pieces
    # every later user message's body at 0.5; the initial prompt (system and first user) excluded
    assert weighted_spans(tok, p) == [(c, 0.5) for c in later]


def test_branching_weighs_each_env_message_once_in_the_sample_that_follows_it(tok) -> None:
    """trajectory_strategy = "branching" (one sample per turn, its prompt holding the earlier turns): as
    prime-rl weighs the observations of every branch after its first response and trains a node the
    branches share once (trajectories._loss_weights), each later user message's body is weighted in
    the sample of the turn that follows it, and only there: the same tokens as the stitched piece."""
    env = load_environment(
        "alphabet-sort", num_examples=4, num_eval_examples=0, num_val_examples=0, min_turns=3, max_turns=3
    )
    task = env.tasks()[0]
    traj, rec = rollout(tok, env, task, ["Ada\nBea", "Ada\nBea\nCy", "Ada\nBea\nCy\nDi", "x", "y"])
    branch = to_record(0, traj, branching=True)
    turns = traj.turns
    assert len(turns) >= 3 and len(branch.pieces) == len(turns) and len(rec.pieces) == 1
    algo = Echo(echo(user=0.5, system=2.0))
    algo.weigh([rec])
    algo.weigh([branch])
    msgs = traj.messages
    replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert branch.pieces[0].ce_weights is None  # the first turn: only the initial prompt precedes it
    for k, p in enumerate(branch.pieces[1:], start=1):
        # sample k: the feedback between reply k-1 and its own reply, not the earlier feedback its
        # prompt also holds (weighted in the earlier samples)
        own = [m["content"] for m in msgs[replies[k - 1] + 1 : replies[k]] if m["role"] == "user"]
        assert own and weighted_spans(tok, p) == [(c, 0.5) for c in own], k
        assert p.after_response and not np.any(np.asarray(p.loss_mask) & (np.asarray(p.ce_weights) != 0))
    assert [s for p in branch.pieces for s in weighted_spans(tok, p)] == weighted_spans(tok, rec.pieces[0])
    n_ce = sum(int(np.count_nonzero(p.ce_weights or [])) for p in branch.pieces)
    assert n_ce == int(np.count_nonzero(rec.pieces[0].ce_weights))
    # the filter: one keep-mask per branch sample, each spanning it
    cut = Echo(
        AlgoConfig(
            type="echo",
            roles=echo(user=0.5).roles,
            filter=EchoFilterConfig(
                import_path="tests.unit.test_echo.keep_first_tokens", kwargs={"n": 10**6}
            ),
        )
    )
    cut.weigh([branch])
    assert [s for p in branch.pieces for s in weighted_spans(tok, p)] == weighted_spans(tok, rec.pieces[0])
    # packed: every branch sample with weights travels, the step's ce count is the stitched one's
    samples = [
        Sample(
            np.asarray(p.input_ids, np.int32),
            np.asarray(p.loss_mask),
            np.asarray(p.logprobs, np.float32),
            1.0,
            0,
            i,
            "e",
            1.0,
            0.0,
            ce_weights=np.asarray(p.ce_weights or [0.0] * len(p.input_ids), np.float32),
        )  # fmt: skip
        for i, p in enumerate(branch.pieces)
    ]
    batches, _ = build_batches(samples, step=1, world_size=2, seq_len=4096)
    assert all(b.total_ce_tokens == n_ce for b in batches)


def test_branch_roles_by_hand() -> None:
    """Three turns that stitch: interleaved, one piece weighs both env parts; branching, the second
    turn's sample weighs the first env part and the third turn's sample only the second."""
    from hpcrl.envs import Turn
    from hpcrl.orchestrator.stitching import pieces_from_turns

    t, u = ROLES["tool"], ROLES["user"]
    t1 = Turn("a", [10, 11], [12, 13], [-0.1] * 2, [0])
    t2 = Turn("b", [10, 11, 12, 13, 20, 21, 22], [14], [-0.1], [0], env_roles=bytes([0, u, 0]))
    t3 = Turn("c", [10, 11, 12, 13, 20, 21, 22, 14, 30, 31], [15], [-0.1], [0], env_roles=bytes([t, 0]))
    w = {t: 0.1, u: 0.5}
    (whole,) = pieces_from_turns([t1, t2, t3])
    assert np.flatnonzero(piece_weights(whole, w)).tolist() == [5, 8] and not whole.after_response
    p1, p2, p3 = pieces_from_turns([t1, t2, t3], branching=True)
    assert p1.env_roles is None and piece_weights(p1, w) is None and not p1.after_response
    assert p2.env_roles == bytes([0] * 4 + [0, u, 0] + [0]) and p2.after_response
    assert piece_weights(p2, w) == [0.0] * 4 + [0.0, 0.5, 0.0] + [0.0]
    assert p3.env_roles == bytes([0] * 8 + [t, 0] + [0])  # 21 (the first env part) is p2's
    assert piece_weights(p3, w) == [0.0] * 8 + [0.1, 0.0, 0.0]
    # a re-rendered turn carries no roles: its whole prompt counts as initial prompt
    t3r = Turn("c", [9, 9, 30, 31], [15], [-0.1], [0], rerendered=True)
    assert pieces_from_turns([t1, t2, t3r], branching=True)[2].env_roles is None


def test_filter_narrows_the_role_selection(tok, calculator) -> None:
    env, task = calculator
    _, rec = rollout(tok, env, task, [tool_call(task), f"#### {task.answer}"])
    (p,) = rec.pieces
    first = p.env_roles.index(ROLES["tool"])  # the tool body's first token
    cfg = AlgoConfig(
        type="echo",
        filter=EchoFilterConfig(
            import_path="tests.unit.test_echo.keep_first_tokens", kwargs={"n": first + 1}
        ),
    )
    Echo(cfg).weigh([rec])
    w = np.asarray(p.ce_weights)
    assert np.flatnonzero(w).tolist() == [first] and w[first] == pytest.approx(0.1)
    # a filter keeping nothing leaves the piece without weights (prime-rl: no ce stream)
    Echo(msgspec.structs.replace(cfg, filter=EchoFilterConfig(import_path=cfg.filter.import_path))).weigh(
        [rec]
    )
    assert p.ce_weights is None
    # a filter must return one mask per piece, each spanning it
    bad = Echo(cfg)
    bad.filter = lambda r: [[True]]
    with pytest.raises(ValueError, match="mask for piece 0 must span the piece's tokens: got 1, expected"):
        bad.weigh([rec])
    bad.filter = lambda r: []
    with pytest.raises(ValueError, match="one keep-mask per piece: got 0, expected 1"):
        bad.weigh([rec])


def test_weights_by_hand_on_a_toy_piece() -> None:
    """roles: 0 prompt, sampled, tool body, scaffold, user body, sampled, tool body at the end."""
    t, u = ROLES["tool"], ROLES["user"]
    piece = Piece(
        input_ids=list(range(9)),
        loss_mask=[False, True, False, False, False, False, True, False, False],
        logprobs=[0.0] * 9,
        env_roles=bytes([u, 0, t, t, 0, u, 0, t, 0]),  # token 0: a user token BEFORE the first response
    )
    assert piece_weights(piece, {t: 0.1, u: 0.5}) == [0.0, 0.0, 0.1, 0.1, 0.0, 0.5, 0.0, 0.1, 0.0]
    assert piece_weights(piece, {u: 0.5}, keep=[True] * 6 + [False] * 3) == [0.0] * 5 + [0.5] + [0.0] * 3
    assert piece_weights(piece, {u: 0.5}, keep=[True] * 5 + [False] * 4) is None  # nothing left
    assert piece_weights(Piece(input_ids=[1], loss_mask=[True], logprobs=[0.0]), {t: 0.1}) is None


def test_char_roles_and_bridge_roles() -> None:
    text = "<e>\n<s>tool\n42<e>\n<s>user\nok 42<e>\n<s>assistant\n"
    codes = char_roles(text, 4, [{"role": "tool", "content": "42"}, {"role": "user", "content": "ok 42"}])
    marked = "".join(c if k else "." for c, k in zip(text, codes))
    assert marked == "." * 12 + "42" + "." * 12 + "ok 42" + "." * 17
    # a renderer's bridge: message_indices relative to the new messages (-1 scaffold), is_content
    bridged = SimpleNamespace(
        token_ids=[1, 2, 3, 4, 5, 6, 7],
        message_indices=[-1, -1, -1, 0, 0, 1, -1],
        is_content=[False, False, False, False, True, True, False],
    )
    new = [{"role": "tool", "content": "x"}, {"role": "user", "content": "y"}]
    assert bridge_env_roles(bridged, 2, new) == bytes([0, 0, ROLES["tool"], ROLES["user"], 0])
    # no is_content (e.g. the default renderer's attribution): the whole message span
    bridged.is_content = []
    assert bridge_env_roles(bridged, 2, new) == bytes([0, ROLES["tool"], ROLES["tool"], ROLES["user"], 0])


def sample(n: int, ce: list[float] | None, example: int) -> Sample:
    mask = np.zeros(n, bool)
    mask[1] = True
    return Sample(
        np.arange(n, dtype=np.int32), mask, np.zeros(n, np.float32), 1.0, 0, example, "e", 1.0, 0.0,
        ce_weights=None if ce is None else np.asarray(ce, np.float32),
    )  # fmt: skip


def test_ce_weights_travel_packed_and_counted_over_every_rank() -> None:
    samples = [sample(4, [0, 0, 0.1, 0.1], 0), sample(3, None, 1), sample(5, [0, 0, 0, 0.5, 0], 2)]
    batches, _ = build_batches(samples, step=1, world_size=2, seq_len=16)
    assert all(b.total_ce_tokens == 3 for b in batches)
    got = {s.example_id: s for b in batches for s in unpack_samples(b)}
    assert got[1].ce_weights is None and got[0].ce_weights.tolist() == pytest.approx([0, 0, 0.1, 0.1])
    back = decode(encode(batches[0]))
    assert np.array_equal(back.ce_weights, batches[0].ce_weights) and back.total_ce_tokens == 3
    again = repack_batches(batches, 1, 16)[0]
    assert again.total_ce_tokens == 3 and float(again.ce_weights.sum()) == pytest.approx(0.7)
    by_example = {s.example_id: s for s in unpack_samples(again)}
    assert by_example[1].ce_weights is None and by_example[2].ce_weights.tolist() == [0, 0, 0, 0.5, 0]
    # a batch file written before echo existed (a48cbd3's encoder, tests/golden/bus): no ce fields
    golden = Path(__file__).parents[1] / "golden" / "bus" / "train_batch_a48cbd3.msgpack"
    old = decode(golden.read_bytes(), TrainBatch)
    assert "ce_weights" not in golden.read_bytes().decode("latin-1")  # the keys are not in the file
    assert old.ce_weights is None and old.total_ce_tokens == 0 and old.input_ids.size > 0


def test_ce_loss_value_and_gradient_by_hand() -> None:
    # logprobs as leaves: loss = -(0.1 * -2 + 0.5 * -0.5) / N_ce, N_ce = 4 tokens in the whole step
    lp = torch.tensor([-1.0, -2.0, -3.0, -0.5], requires_grad=True)
    w = torch.tensor([0.0, 0.1, 0.0, 0.5])
    loss, nll, count = ce_loss(lp, w, 4)
    assert loss.item() == pytest.approx((0.2 + 0.25) / 4) and nll.item() == pytest.approx(2.5)
    assert count.item() == 2
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, -0.025, 0.0, -0.125])
    # through a softmax: z = [0, ln 3] -> p = [1/4, 3/4]; target 0: -logp = ln 4, d/dz = w (p - e_0) / N
    z = torch.tensor([0.0, math.log(3.0)], requires_grad=True)
    lp0 = torch.log_softmax(z, -1)[0]
    loss, _, _ = ce_loss(torch.stack([torch.tensor(-9.0), lp0]), torch.tensor([0.0, 0.3]), 2)
    assert loss.item() == pytest.approx(0.3 * math.log(4.0) / 2)
    loss.backward()
    assert z.grad.tolist() == pytest.approx([0.3 * (0.25 - 1) / 2, 0.3 * 0.75 / 2])
    # a -inf logprob on a token without weight stays out of the value and the gradient
    lp = torch.tensor([float("-inf"), -1.0], requires_grad=True)
    loss, _, _ = ce_loss(lp, torch.tensor([0.0, 1.0]), 1)
    loss.backward()
    assert loss.item() == 1.0 and lp.grad.tolist() == [0.0, -1.0]


def test_compute_loss_adds_the_ce_term_beside_the_rl_loss() -> None:
    """ce tokens are outside the loss mask: the rl part (and its normalisation) is unchanged."""
    torch.manual_seed(0)
    lp = (-torch.rand(6) - 0.1).requires_grad_()
    mask = torch.tensor([False, True, True, False, False, True])
    kw = dict(
        trainer_logprobs=lp,
        loss_mask=mask,
        num_loss_tokens=3,
        inference_logprobs=lp.detach(),
        advantages=torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, -1.0]),
    )
    params = LossParams()
    rl = compute_loss(params, **kw)
    ce_w = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.2, 0.0])
    both = compute_loss(params, **kw, ce_weights=ce_w, num_ce_tokens=5)
    expected_ce = -(0.1 * lp[3] + 0.2 * lp[4]).item() / 5
    assert both.loss.item() == pytest.approx(rl.loss.item() + expected_ce)
    s = summarize(both.stats)
    assert s["ce_loss"] == pytest.approx(expected_ce) and s["ce_tokens"] == 2
    assert s["ce_nll"] == pytest.approx(-(lp[3] + lp[4]).item() / 2) and s["loss_tokens"] == 3
    both.loss.backward()
    assert lp.grad[3].item() == pytest.approx(-0.1 / 5) and lp.grad[4].item() == pytest.approx(-0.2 / 5)


def test_real_renderer_bridge_attributes_tool_bodies(tmp_path_factory: pytest.TempPathFactory) -> None:
    """renderer.name = "qwen3" (hpcrl.orchestrator.renderer_client): the bridge's own attribution puts
    the tool role on the two tool bodies only, not on Qwen3's <tool_response> wraps or the user block
    they sit in."""
    pytest.importorskip("renderers")
    from transformers import AutoTokenizer

    from hpcrl.config.schema import RendererConfig
    from hpcrl.models.tiny import build_tiny_model
    from hpcrl.render import select

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("q3"), template="qwen3"))
    renderer, _ = select.create(tok, RendererConfig(name="qwen3"), "tiny", "orchestrator.renderer")
    prompt = list(
        renderer.render([{"role": "user", "content": "2+3?"}], add_generation_prompt=True).token_ids
    )
    completion = tok("<think>\nok\n</think>\n\ncall<|im_end|>", add_special_tokens=False)["input_ids"]
    new = [
        {"role": "tool", "content": "5 apples", "tool_call_id": "a"},
        {"role": "tool", "content": "and 7", "tool_call_id": "b"},
    ]
    bridged = renderer.bridge_to_next_turn(prompt, completion, new)
    roles = bridge_env_roles(bridged, len(prompt) + len(completion), new)
    env_ids = list(bridged.token_ids)[len(prompt) + len(completion) :]
    body = [[i for i, r in zip(env_ids, roles) if r == ROLES["tool"]]]
    assert tok.decode(body[0]) == "5 applesand 7" and set(roles) == {0, ROLES["tool"]}
    assert "<tool_response>" in tok.decode(env_ids)


def test_context_parallel_shards_keep_the_ce_weights() -> None:
    """A cp group trains the union of its shards (one may have no ce weights: zeros), and each rank
    counts only the ce tokens it predicts, as it does loss tokens."""
    from hpcrl.models.parallelize import CPGroup
    from hpcrl.trainer.context_parallel import merge_batches, owned_tokens, restrict
    from hpcrl.trainer.rl import to_packed

    batches, _ = build_batches([sample(4, [0, 0, 0.1, 0.1], 0), sample(4, None, 1)], 1, 2, 16)
    with_ce = [b for b in batches if b.ce_weights is not None]
    assert len(with_ce) == 1  # the other shard has none
    merged = merge_batches(batches)
    assert merged.ce_weights.tolist() == pytest.approx(
        [w for b in batches for w in (b.ce_weights if b.ce_weights is not None else [0.0] * 4)]
    )
    mb = to_packed(merged, torch.device("cpu"))
    assert mb.trained().tolist() == (mb.loss_mask | (mb.ce_weights != 0)).tolist()
    parts = [restrict(mb, CPGroup(size=2, rank=r, group=None, members=(0, 1))).ce_weights for r in (0, 1)]
    assert torch.equal(parts[0] + parts[1], mb.ce_weights)  # each ce token on exactly one rank
    assert torch.equal(parts[1] != 0, (mb.ce_weights != 0) & owned_tokens(8, 2, 1))


def test_env_roles_cross_the_env_server_wire() -> None:
    """An env run in an env server (hpcrl.envs.wire) hands its turns back with their roles."""
    from hpcrl.envs import Turn
    from hpcrl.envs.wire.messages import WTurn, from_wturn, to_wturn

    turn = Turn("t", [1, 2, 3], [4], [-0.5], [0], env_roles=bytes([0, ROLES["tool"]]))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wturn(turn)), type=WTurn)
    assert from_wturn(wire).env_roles == bytes([0, ROLES["tool"]])
    # an older peer's turn (no env_roles field, nor the images after it) reads as None
    short = msgspec.msgpack.encode(list(msgspec.structs.astuple(to_wturn(turn)))[:-2])
    assert from_wturn(msgspec.msgpack.decode(short, type=WTurn)).env_roles is None


def test_a_group_without_rl_signal_still_trains_its_ce_tokens(tok, calculator) -> None:
    """zero_advantage = "drop" (prime-rl's filter_zero_advantages): equal rewards drop a grpo group, but
    an echo group stays for its cross entropy, its sampled tokens out of the rl loss (and its count)."""
    from hpcrl.config.schema import AdvantageConfig
    from hpcrl.orchestrator.algo import Credit
    from hpcrl.orchestrator.batch import StepCounts, judge_group, to_samples
    from hpcrl.orchestrator.buffer import Buffer, BufferConfig
    from hpcrl.orchestrator.state import GroupRecord

    env, task = calculator

    def solved_group() -> GroupRecord:
        recs = [rollout(tok, env, task, [tool_call(task), f"#### {task.answer}"])[1] for _ in range(2)]
        for i, r in enumerate(recs):
            r.index = i
        return GroupRecord(env="e", example_id=0, task_index=0, task_epoch=0, rollouts=recs)

    buffer = Buffer({"e": 4}, BufferConfig())
    grpo, counts = solved_group(), StepCounts()
    assert not judge_group(grpo, buffer, Credit(AlgoConfig(), AdvantageConfig()), counts)
    assert counts.filtered["zero_advantage"] == 1
    g = solved_group()
    assert judge_group(g, buffer, Credit(AlgoConfig(type="echo"), AdvantageConfig()), StepCounts())
    assert g.advantages == [0.0, 0.0]
    samples = to_samples([g], 1, 8, 1.0, buffer, StepCounts())
    (batch,), stats = build_batches(samples, 1, 1, 4096)
    n_answer = len(tok(task.answer, add_special_tokens=False)["input_ids"])
    assert stats.num_samples == 2 and batch.total_loss_tokens == 0 and batch.total_ce_tokens == 2 * n_answer
