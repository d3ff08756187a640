"""A classic verifiers environment (vf.SingleTurnEnv + vf.Rubric), loaded by id
`tests.integration.vf_env_fixture:load_environment` in the orchestrator's verifiers test."""

from __future__ import annotations


def reversed_exactly(completion, answer, **kwargs) -> float:
    return float(completion[-1]["content"].strip() == answer)


def load_environment(num_examples: int = 16):
    import datasets
    import verifiers as vf

    words = ["abc", "hello", "xyz", "tree", "moon", "cat", "dog", "star"]
    rows = [
        {"question": w, "answer": w[::-1]} for w in (words * (num_examples // len(words) + 1))[:num_examples]
    ]
    return vf.SingleTurnEnv(
        dataset=datasets.Dataset.from_list(rows),
        system_prompt="Reverse the text.",
        rubric=vf.Rubric(funcs=[reversed_exactly]),
    )
