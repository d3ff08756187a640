"""A verifiers 0.4 (v1) taskset written as verifiers' docs (docs/v1/tasksets.md) show: TaskData,
a Task with an @vf.reward, a Taskset exported through __all__. Loaded by id
"tests.integration.vf1_taskset_fixture" in the verifiers-version tests."""

from __future__ import annotations

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: int


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 8


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        return [
            AdditionTask(AdditionData(idx=i, prompt=f"What is {i} + {i}?", answer=2 * i), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["AdditionTaskset"]
