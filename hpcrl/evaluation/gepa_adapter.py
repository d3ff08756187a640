"""The GEPA adapter: a candidate is one system prompt; evaluating it on a batch of tasks is one scored
rollout per task through the same rollout code as training and `hpcrl eval`.

GEPA (the `gepa` package) owns the search: Pareto candidate selection, minibatches, reflection
prompts, acceptance, its state file and resume. This module only answers its three questions:
what does this prompt score on these tasks (evaluate), what should the reflection model see
(make_reflective_dataset: the task, the reply, the reward and metrics, the expected answer and the
--state-columns fields), and what must survive a restart (get/set_adapter_state: the result rows of
every full validation evaluation, so results.jsonl needs no extra rollouts).

One metric call = one scored rollout. BudgetStopper keeps the total at or under the budget: an
iteration starts only when its worst case (parent and child minibatches plus a full validation
evaluation) still fits.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.envs.base import Environment, Task
from hpcrl.evaluation.rollouts import result_rows, score_all
from hpcrl.orchestrator.rollout import Generator

COMPONENT = "system_prompt"


def prompt_key(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def _text(messages: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(f"[{m.get('role')}] {m.get('content') or ''}" for m in messages)


def feedback(row: Mapping[str, Any], task: Task, state_columns: Sequence[str]) -> dict[str, Any]:
    """One reflective-dataset record: what the model saw (minus the system prompt under
    optimisation), what it answered, and why it scored what it did."""
    metrics = ", ".join(f"{k}={v:.3g}" for k, v in row["metrics"].items())
    lines = [f"Reward {row['reward']:.3f}" + (f" ({metrics})" if metrics else "") + "."]
    if task.answer:
        lines.append(f"The expected answer was: {task.answer}")
    if row["error"]:
        lines.append(f"The rollout failed: {row['error']}")
    if row["truncated"]:
        lines.append("The reply was cut off at the token limit.")
    record: dict[str, Any] = {
        "Inputs": _text([m for m in row["prompt"] if m.get("role") != "system"]),
        "Generated Outputs": _text(row["completion"]) or "(empty reply)",
        "Feedback": " ".join(lines),
    }
    for col in state_columns:
        record[col] = state_value(col, row, task)
    return record


def state_value(col: str, row: Mapping[str, Any], task: Task) -> Any:
    """A --state-columns field: a task info key, else a result-row field (answer, metrics, ...)."""
    if col in task.info:
        return task.info[col]
    return row.get(col, "(not available)")


class BudgetStopper:
    """gepa stopper: stop before an iteration whose worst case would exceed `max_calls`."""

    def __init__(self, max_calls: int, minibatch_size: int, num_val: int):
        self.max_calls = max_calls
        self.worst_iteration = 2 * minibatch_size + num_val

    def __call__(self, gepa_state: Any) -> bool:
        return gepa_state.total_num_evals + self.worst_iteration > self.max_calls


class PromptAdapter:
    """gepa.GEPAAdapter over one hpcrl environment. Sync (gepa's engine is), running the async
    rollouts on the caller's event loop."""

    propose_new_texts = None  # gepa's reflective proposer with our reflection LM

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        gen: Generator,
        env_name: str,
        env: Environment,
        sampling: Mapping[str, Any],
        valset: Sequence[Task],
        state_columns: Sequence[str],
    ):
        self.loop, self.gen, self.env_name, self.env = loop, gen, env_name, env
        self.sampling, self.state_columns = dict(sampling), list(state_columns)
        self.val_ids = [t.example_id for t in valset]
        self.val_rows: dict[str, list[dict[str, Any]]] = {}  # prompt key -> rows of its full val evaluation
        self.rollouts = 0  # rollouts actually run by this process
        self.replay: dict[int, float] | None = None  # resume: the stored base scores, see replay_base

    # -- gepa.GEPAAdapter -----------------------------------------------------------------------------
    def evaluate(self, batch: list[Task], candidate: dict[str, str], capture_traces: bool = False) -> Any:
        from gepa import EvaluationBatch

        if self.replay is not None:  # gepa re-scores the base prompt before it loads its state
            scores, self.replay = [self.replay[i] for i in range(len(batch))], None
            return EvaluationBatch(outputs=[None] * len(batch), scores=scores, num_metric_calls=0)
        rows = self.score(batch, candidate[COMPONENT])
        if [t.example_id for t in batch] == self.val_ids:
            self.val_rows[prompt_key(candidate[COMPONENT])] = rows
        scores = [float(r["reward"]) for r in rows]
        traces = [(r, t) for r, t in zip(rows, batch)] if capture_traces else None
        return EvaluationBatch(outputs=rows, scores=scores, trajectories=traces, num_metric_calls=len(batch))

    def make_reflective_dataset(
        self, candidate: dict[str, str], eval_batch: Any, components_to_update: list[str]
    ) -> dict[str, list[dict[str, Any]]]:
        records = [feedback(row, task, self.state_columns) for row, task in eval_batch.trajectories or []]
        return {c: records for c in components_to_update}

    def get_adapter_state(self) -> dict[str, Any]:
        return {"val_rows": {k: list(v) for k, v in self.val_rows.items()}}

    def set_adapter_state(self, state: dict[str, Any]) -> None:
        self.val_rows.update(state.get("val_rows") or {})

    # -- ours ------------------------------------------------------------------------------------------
    def replay_base(self, scores_by_val_index: Mapping[int, float]) -> None:
        """On resume, answer gepa's base re-evaluation with the stored scores instead of rollouts
        (gepa discards that evaluation once it has loaded its state)."""
        self.replay = dict(scores_by_val_index)

    def score(self, batch: Sequence[Task], prompt: str) -> list[dict[str, Any]]:
        """One scored rollout per task with `prompt` as the system message. The request seed depends
        on the example, not the prompt: candidates are compared on the same random draws."""
        self.env.system_prompt_override = prompt
        jobs = [(self.env_name, self.env, t, 1) for t in batch]
        groups = self.loop.run_until_complete(score_all(self.gen, jobs, self.sampling, lambda _: ("gepa",)))
        self.rollouts += len(batch)
        return [row for g in groups for row in result_rows(g, self.env)]


class ReflectionLM:
    """gepa LanguageModel over any OpenAI-compatible chat endpoint."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        base_url: str,
        model: str,
        api_key: str | None,
        max_tokens: int | None,
        temperature: float,
        timeout: float,
    ):
        from hpcrl.inference.client import InferenceClient

        self.loop, self.model = loop, model
        self.client = InferenceClient(base_url, timeout=timeout, api_key=api_key, max_connections=4)
        self.max_tokens, self.temperature = max_tokens, temperature
        self.calls = 0

    def __call__(self, prompt: str | list[dict[str, Any]]) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        self.calls += 1
        resp = self.loop.run_until_complete(
            self.client.chat_completion(
                messages,
                model=self.model,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                tokens=False,
            )
        )
        return ((resp.get("choices") or [{}])[0].get("message") or {}).get("content") or ""

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())


class GepaLog:
    """gepa's LoggerProtocol onto our logging (logs/gepa.log and the console); proposed prompts from a
    weak reflection model can be arbitrary bytes, so lines are shown escaped and shortened."""

    def __init__(self, max_chars: int = 300):
        import logging

        self.logger, self.max_chars = logging.getLogger("hpcrl.evaluation.gepa"), max_chars

    def log(self, message: str) -> None:
        text = message.encode("unicode_escape", "backslashreplace").decode("ascii")
        self.logger.info(text if len(text) <= self.max_chars else text[: self.max_chars] + "...")
