"""Every rollout saved: `rollouts/step_N/{train,eval}/traces.jsonl` (+ `traces.index.json`).

    orchestrator loop ── RolloutLog.train(step, trained, generated, carried) ──▶ one writer thread:
                      ── RolloutLog.eval(step, [(env, tasks, groups)])      ──▶   encode_step (records, index)
                                                                                  write_step (traces.jsonl, then
                                                                                    traces.index.json, atomically)
                                                                                  prune (retention)

The loop only hands over references to the step's groups (nothing on the training path reads them
again); the thread builds the records, writes each file whole with write-then-rename and fsync
(hpcrl.fileio, as the bus files), and prunes old steps. A resumed run removes the files of the steps
it will generate again (forget_after) and writes them whole once more: never duplicated, never
half. The record format and the reader: docs/observability.md "Saved rollouts",
hpcrl.monitor.rollout_files.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from hpcrl.envs.base import Task
from hpcrl.fileio import refused_write, write_atomic
from hpcrl.monitor.rollout_files import COLUMNS, INDEX_FORMAT, row_of, summary_of
from hpcrl.orchestrator.state import GroupRecord, RolloutRecord
from hpcrl.orchestrator.transcript import Transcript, TurnLog
from hpcrl.paths import RunPaths
from hpcrl.storage import describe

log = logging.getLogger("hpcrl.orchestrator")

Decode = Callable[[list[int]], list[str]]  # token ids -> each token's text
_ENCODER = msgspec.json.Encoder(enc_hook=repr)  # a value JSON cannot hold is saved as its repr


# -- records (pure) ---------------------------------------------------------------------------------
def _span(policies: Sequence[tuple[int, int]], default: int) -> dict[str, int]:
    if not policies:
        return {"start": default, "end": default}
    return {"start": min(p[0] for p in policies), "end": max(p[1] for p in policies)}


def _errors(error: str | None) -> list[dict[str, str]]:
    """ "Type: message" (RolloutRecord.error) as prime-rl's {"type", "message"}."""
    if error is None:
        return []
    kind, sep, message = error.partition(": ")
    if not sep or " " in kind:
        return [{"type": "Error", "message": error}]
    return [{"type": kind, "message": message}]


def rubric_scores(metrics: dict[str, float], weights: dict[str, float]) -> tuple[dict, dict]:
    """(rewards: {function: {"score", "weight"}}, the other metrics) of one rollout."""
    rewards = {k: {"score": v, "weight": weights[k]} for k, v in metrics.items() if k in weights}
    return rewards, {k: v for k, v in metrics.items() if k not in weights}


def turn_dict(t: TurnLog, tokens: bool, decode: Decode | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_len": t.prompt_len,
        "finish_reason": t.finish_reason,
        "policy": {"start": t.policy[0], "end": t.policy[1]},
        "num_tokens": len(t.completion_ids),
    }
    if tokens:
        out["completion_ids"] = t.completion_ids
        out["logprobs"] = np.round(np.asarray(t.logprobs, dtype=np.float64), 4).tolist()
        if decode is not None:
            out["tokens"] = decode(t.completion_ids)
    return out


def traces_of(
    r: RolloutRecord, tr: Transcript, advantage: float | None, trace_adv: list[float] | None, tokens: bool,
    decode: Decode | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """One entry per trained trace (one for a single-agent rollout), each with its sampled turns."""
    n = max([len(r.trace_rewards or [])] + [t.trace + 1 for t in tr.turns] + [1])
    out = []
    for j in range(n):
        reward = r.trace_rewards[j] if r.trace_rewards and j < len(r.trace_rewards) else r.reward
        adv = trace_adv[j] if trace_adv and j < len(trace_adv) else advantage
        turns = [turn_dict(t, tokens, decode) for t in tr.turns if t.trace == j]
        out.append({"index": j, "reward": reward, "advantage": adv, "turns": turns})
    return out


def record_id(split: str, step: int, group: GroupRecord, index: int) -> str:
    """`<split>-<step>-<env>-<example>-<index>`, unique in the run; an example drawn again within
    one step (a later epoch of a small env) gets `.<epoch>` after its id."""
    epoch = f".{group.task_epoch}" if group.task_epoch else ""
    return f"{split}-{step}-{group.env}-{group.example_id}{epoch}-{index}"


def rollout_record(
    step: int,
    split: str,
    group: GroupRecord,
    r: RolloutRecord,
    *,
    trained: bool,
    task: Task | None = None,
    env_id: str | None = None,
    tools: list[dict] | None = None,
    tokens: bool = True,
    decode: Decode | None = None,
) -> dict[str, Any]:
    """The saved form of one rollout (docs/observability.md "Saved rollouts")."""
    tr = r.transcript or Transcript()
    advs = group.advantages
    advantage = advs[r.index] if advs is not None and r.index < len(advs) else None
    trace_adv = group.trace_advantages[r.index] if group.trace_advantages else None
    rewards, metrics = rubric_scores(r.metrics, tr.reward_weights)
    total = sum(len(p.input_ids) for p in r.pieces)
    policy = _span([t.policy for t in tr.turns], r.policy_version)
    rec: dict[str, Any] = {
        "id": record_id(split, step, group, r.index),
        "step": step,
        "split": split,
        "env": {"id": env_id or group.env, "name": group.env},
        "task": {"example_id": group.example_id, "epoch": group.task_epoch},
        # the group's other rewards and advantages are in the index (RolloutIndex.groups()): not
        # repeated in each of its n records (n^2 numbers per group)
        "group": {"id": f"{group.env}/{group.example_id}", "index": r.index, "size": len(group.rollouts)},
        "run": {"type": "train", "work": {"type": split, "step": step, "policy": policy}},
        "ok": not r.errored,
        "trained": trained,
        "is_timeout": False,
        "is_truncated": r.truncated,
        "errors": _errors(r.error),
        "reward": 0.0 if r.errored else r.reward,
        "advantage": advantage,
        "rewards": rewards,
        "metrics": metrics,
        "policy": policy,
        "num_turns": r.num_turns,
        "num_input_tokens": total - r.completion_tokens if total else 0,
        "num_output_tokens": r.completion_tokens,
        "num_total_tokens": total,
        "bridge_breaks": r.bridge_breaks,
        "timing": {
            "start": tr.started,
            "end": tr.finished,
            "duration": max(0.0, tr.finished - tr.started) if tr.started else None,
        },
        "messages": tr.messages,
        "num_prompt_messages": tr.num_prompt_messages,
        "traces": traces_of(r, tr, advantage, trace_adv, tokens, decode),
    }
    if task is not None:
        rec["task"].update(answer=task.answer, info=task.info)
    if tools:
        rec["tools"] = tools
    return rec


Item = tuple[GroupRecord, Task | None, bool]  # a group, its task (when known), trained


def encode_step(
    step: int,
    split: str,
    items: Sequence[Item],
    env_ids: dict[str, str],
    tools: dict[str, list[dict] | None],
    tokens: bool,
    decode: Decode | None,
) -> tuple[bytes, bytes]:
    """(traces.jsonl, traces.index.json) of one step and split."""
    lines, rows, offset = [], [], 0
    for group, task, trained in items:
        for r in group.rollouts:
            rec = rollout_record(
                step, split, group, r, trained=trained, task=task, env_id=env_ids.get(group.env),
                tools=tools.get(group.env), tokens=tokens, decode=decode,
            )  # fmt: skip
            line = _ENCODER.encode(rec) + b"\n"
            rows.append(row_of(summary_of(rec, offset, len(line))))
            lines.append(line)
            offset += len(line)
    index = {"format": INDEX_FORMAT, "size": offset, "columns": list(COLUMNS), "rows": rows}
    return b"".join(lines), _ENCODER.encode(index)


def train_items(
    trained: Sequence[GroupRecord],
    generated: Sequence[GroupRecord],
    carried: Sequence[GroupRecord],
    task_of: Callable[[GroupRecord], Task | None],
) -> list[Item]:
    """Step N's file: the groups its batch trained, then those generated for it and dropped by a
    filter. A group carried over to the next batch is saved with that batch (once, either way)."""
    kept = {id(g) for g in [*trained, *carried]}
    dropped = [g for g in generated if id(g) not in kept]
    return [(g, task_of(g), True) for g in trained] + [(g, task_of(g), False) for g in dropped]


def eval_items(evals: Sequence[tuple[str, Sequence[Task], Sequence[Sequence[RolloutRecord]]]]) -> list[Item]:
    """Eval groups (env name, its tasks, one rollout list per task) as items of the eval file."""
    return [
        (
            GroupRecord(env=name, example_id=t.example_id, task_index=i, task_epoch=0, rollouts=list(g)),
            t,
            False,
        )
        for name, tasks, groups in evals
        for i, (t, g) in enumerate(zip(tasks, groups))
    ]


def keep_steps(keep_last: int | None, ckpt_keep_last: int | None, ckpt_interval: int | None) -> int | None:
    """How many newest steps' saved rollouts retention keeps (None: all)."""
    if keep_last is not None:
        return keep_last
    if ckpt_keep_last is not None and ckpt_interval is not None:
        return ckpt_keep_last * ckpt_interval
    return None


# -- files ------------------------------------------------------------------------------------------
def remove_saved(paths: RunPaths, step: int, split: str) -> None:
    d = paths.saved_rollouts_file(step, split).parent
    shutil.rmtree(d, ignore_errors=True)
    try:
        paths.rollout_step_dir(step).rmdir()  # gone once neither bus files nor saved rollouts are left
    except OSError:
        pass


def saved_steps(paths: RunPaths, split: str) -> list[int]:
    return [
        s
        for s in RunPaths.steps_in(paths.rollouts_dir)
        if paths.saved_rollouts_file(s, split).parent.is_dir()
    ]


def prune(paths: RunPaths, newest: int, keep: int | None) -> list[int]:
    """Remove the saved rollouts (both splits) of steps older than the newest `keep`. Returns them."""
    if keep is None:
        return []
    doomed = [s for s in RunPaths.steps_in(paths.rollouts_dir) if s <= newest - keep]
    for s in doomed:
        for split in ("train", "eval"):
            remove_saved(paths, s, split)
    return doomed


def forget_after(paths: RunPaths, step: int, evaluated: Sequence[int]) -> list[tuple[int, str]]:
    """Resume at step+1: the train files of later steps, and eval files of policies not evaluated by
    then, are written again when those steps come; until then they must not show (a stale copy)."""
    gone = [(s, "train") for s in saved_steps(paths, "train") if s > step]
    gone += [(s, "eval") for s in saved_steps(paths, "eval") if s not in set(evaluated)]
    for s, split in gone:
        remove_saved(paths, s, split)
    return gone


def write_step(paths: RunPaths, step: int, split: str, data: bytes, index: bytes) -> None:
    """The records, then their index (a reader takes an index only when its size matches)."""
    write_atomic(paths.saved_rollouts_file(step, split), [data])
    write_atomic(paths.saved_rollouts_index(step, split), [index])


def token_decoder(tokenizer: Any) -> Decode | None:
    """Each token's text: the whole vocabulary decoded once (a token's text does not depend on its
    neighbours here), by a private copy of the fast tokenizer (one shared with the event loop's
    thread can fail with "Already borrowed"); then a list lookup per token. None without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer

        own = Tokenizer.from_str(backend.to_str())
        table = own.decode_batch([[i] for i in range(own.get_vocab_size(with_added_tokens=True))], False)
    except Exception:  # noqa: BLE001 - token texts are a nicety: ids and logprobs are saved anyway
        return None
    n = len(table)
    return lambda ids: [table[i] if 0 <= i < n else own.decode([i], False) for i in ids]


class RolloutLog:
    """The orchestrator's writer of saved rollouts: one thread, files written whole, retention."""

    def __init__(
        self,
        paths: RunPaths,
        *,
        enabled: bool = True,
        keep: int | None = None,
        tokens: bool = True,
        env_ids: dict[str, str] | None = None,
        tools: dict[str, list[dict] | None] | None = None,
        tokenizer: Any = None,
        task_of: Callable[[GroupRecord], Task | None] = lambda g: None,
    ):
        self.paths, self.enabled, self.keep, self.tokens = paths, enabled, keep, tokens
        self.env_ids, self.tools, self.task_of = env_ids or {}, tools or {}, task_of
        self.tokenizer = tokenizer
        self._decode: Decode | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-log") if enabled else None
        self._pending: list[Future] = []
        self.refused: str | None = None  # the last refusal named (one WARNING per cause)

    def train(
        self,
        step: int,
        trained: Sequence[GroupRecord],
        generated: Sequence[GroupRecord],
        carried: Sequence[GroupRecord],
    ) -> None:
        if self.enabled:
            self._submit(step, "train", train_items(trained, generated, carried, self.task_of))

    def eval(
        self, step: int, evals: Sequence[tuple[str, Sequence[Task], Sequence[Sequence[RolloutRecord]]]]
    ) -> None:
        if self.enabled and evals:
            self._submit(step, "eval", eval_items(evals))

    def forget_after(self, step: int, evaluated: Sequence[int]) -> None:
        if self.enabled:
            gone = forget_after(self.paths, step, evaluated)
            if gone:
                log.info(
                    "saved rollouts: %d file(s) after step %d removed (generated again)", len(gone), step
                )

    def _submit(self, step: int, split: str, items: list[Item]) -> None:
        assert self._pool is not None
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self._write, step, split, items))

    def _write(self, step: int, split: str, items: list[Item]) -> None:
        if self.tokens and self._decode is None and self.tokenizer is not None:
            self._decode, self.tokenizer = token_decoder(self.tokenizer), None
        try:
            data, index = encode_step(step, split, items, self.env_ids, self.tools, self.tokens, self._decode)
            write_step(self.paths, step, split, data, index)
            if split == "train":
                prune(self.paths, step, self.keep)
        except OSError as e:
            why = refused_write(e)
            if why is None:
                log.warning("saved rollouts of step %d (%s) not written: %s", step, split, e)
            elif why != self.refused:  # named once per cause (hpcrl.storage: a log never ends the run)
                log.warning(
                    "saved rollouts of step %d (%s) not written: %s; the run goes on",
                    step, split, describe(e),
                )  # fmt: skip
            self.refused = why
            return
        except Exception:  # noqa: BLE001 - saving rollouts must never end the run
            log.warning("saved rollouts of step %d (%s) not written", step, split, exc_info=True)
            return
        if self.refused is not None:
            log.warning("saved rollouts: written again from step %d on (it was: %s)", step, self.refused)
            self.refused = None

    def flush(self) -> None:
        for f in list(self._pending):
            f.result()
        self._pending = []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def from_setup(cfg: Any, paths: RunPaths, setup: Any) -> RolloutLog:
    """The run's RolloutLog from its config (orchestrator.save_rollouts, ckpt) and set-up."""
    from hpcrl.orchestrator.setup import env_name

    o, c = cfg.orchestrator, cfg.ckpt
    s = o.save_rollouts
    envs = [*o.train.env, *(o.eval.env if o.eval is not None else [])]
    all_envs = {**setup.envs, **{e.name: e.env for e in setup.eval_envs}}

    def task_of(g: GroupRecord) -> Task | None:
        tasks = setup.tasks.get(g.env)
        return tasks[g.task_index] if tasks is not None and 0 <= g.task_index < len(tasks) else None

    return RolloutLog(
        paths,
        enabled=s.enabled,
        keep=keep_steps(s.keep_last, c.keep_last if c else None, c.interval if c else None),
        tokens=s.tokens,
        env_ids={env_name(e): e.id for e in envs},
        tools={name: getattr(env, "tools", None) for name, env in all_envs.items()},
        tokenizer=setup.tokenizer,
        task_of=task_of,
    )
