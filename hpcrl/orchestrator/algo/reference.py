"""Reference logprobs of the ref_kl algorithms, scored when a batch is cut (prime-rl scores at ship
time too): every sampled sequence (Piece) gets `teacher_logprobs`, the reference's logprob of each
of its tokens given the ones before, which the trainer turns into the per-token reverse KL.

- opd: the frozen teacher scores the sequence as sampled.
- opsd (SDFT, arXiv:2601.19897): the live policy scores it with the task's demonstration prepended
  as a leading system message, `hint + ids`, and the logprobs of `ids` are kept. The sequence itself
  is scored verbatim (never re-rendered), so the join is the hint's closing special token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from hpcrl.envs.base import Task
from hpcrl.errors import UserError
from hpcrl.orchestrator.pool import RequestFailed, ServerPool, teacher_logprobs
from hpcrl.orchestrator.servers import InferenceUnavailable
from hpcrl.orchestrator.state import GroupRecord

HintIds = Callable[[str], list[int]]  # the system message's text -> its token ids


def demonstration(task: Task, key: str, env: str) -> str:
    """The task's demonstration: `info[key]`, else the task field `key` (e.g. answer)."""
    demo = task.info.get(key) if isinstance(task.info, dict) else None
    if demo is None:
        demo = getattr(task, key, None)
    if demo is None:
        raise UserError(
            f"orchestrator.algo.demo_key: opsd needs {key!r} in the task's info or as a task field "
            f"(env {env!r}, example {task.example_id}); set demo_key (e.g. 'answer')"
        )
    return str(demo)


def chat_template_hint(tokenizer: Any, renderer: Any = None) -> HintIds:
    """A system message's ids: through `renderer` (a renderers.Renderer) when given, else the
    tokenizer's chat template, as the policy's own prompts are rendered."""

    def ids(text: str) -> list[int]:
        msg = [{"role": "system", "content": text}]
        if renderer is not None:
            return list(renderer.render(msg, add_generation_prompt=False).token_ids)
        rendered = tokenizer.apply_chat_template(msg, add_generation_prompt=False, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    return ids


class ReferenceScorer:
    """Adds reference logprobs to every usable piece of a batch's groups.

    `pool`: the model that scores (opd: the teacher; opsd: the live policy's servers). For opsd,
    `hint` renders the demonstration message and `task_of(group)` finds the group's task."""

    def __init__(
        self,
        pool: ServerPool,
        *,
        hint: HintIds | None = None,
        template: str = "",
        demo_key: str = "",
        task_of: Callable[[GroupRecord], Task] | None = None,
    ):
        self.pool, self.hint, self.template, self.demo_key, self.task_of = (
            pool,
            hint,
            template,
            demo_key,
            task_of,
        )

    def prefix(self, group: GroupRecord) -> list[int]:
        if self.hint is None:
            return []
        assert self.task_of is not None
        demo = demonstration(self.task_of(group), self.demo_key, group.env)
        return self.hint(self.template.format(demonstration=demo))

    async def score(self, groups: Sequence[GroupRecord]) -> None:
        jobs = []
        for g in groups:
            prefix = self.prefix(g)
            jobs += [(prefix, p) for r in g.rollouts if not r.errored for p in r.pieces]
        try:
            lps = await asyncio.gather(*(teacher_logprobs(self.pool, pre + p.input_ids) for pre, p in jobs))
        except RequestFailed as e:  # refused (a context too long, a model name it does not serve)
            who = "the policy (opsd)" if self.hint is not None else "the teacher (opd)"
            raise InferenceUnavailable(f"reference logprobs from {who}: {e}") from None
        for (pre, p), lp in zip(jobs, lps):
            p.teacher_logprobs = lp[len(pre) :]


class References:
    """The reference scorers of a run with per-env algorithms: an env's own (None: an rl env, not
    scored), else the run's (`default`, None when the run's algo is an rl type)."""

    def __init__(
        self, default: ReferenceScorer | References | None, per_env: dict[str, ReferenceScorer | None]
    ):
        self.default, self.per_env = default, per_env

    def scorer(self, env: str) -> ReferenceScorer | References | None:
        return self.per_env.get(env, self.default)

    async def score(self, groups: Sequence[GroupRecord]) -> None:
        by: dict[int, tuple[ReferenceScorer | References, list[GroupRecord]]] = {}
        for g in groups:
            sc = self.scorer(g.env)
            if sc is not None:
                by.setdefault(id(sc), (sc, []))[1].append(g)
        await asyncio.gather(*(sc.score(gs) for sc, gs in by.values()))
