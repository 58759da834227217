"""Synthetic tasks generated on the fly at any length from a seeded ``torch.Generator``.

``TASKS`` maps each task's name (a `TaskName`) to its class; ``make_task(name, **kwargs)`` builds one with
checked arguments.
"""

from __future__ import annotations

import inspect
from typing import Literal

from lengthgen.config import ConfigError, unknown_key

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.data.tasks.counting import CountingTask
from lengthgen.data.tasks.dyck import DyckTask
from lengthgen.data.tasks.max_retrieval import MaxRetrievalTask
from lengthgen.data.tasks.mqar import MQARTask
from lengthgen.data.tasks.passkey import PasskeyTask
from lengthgen.data.tasks.set_complement import SetComplementTask
from lengthgen.data.tasks.tomita import TomitaTask, roc_auc

TaskName = Literal["counting", "set_complement", "max_retrieval", "dyck", "tomita", "mqar", "passkey"]
TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (
    CountingTask, SetComplementTask, MaxRetrievalTask, DyckTask, TomitaTask, MQARTask, PasskeyTask)}


def make_task(name: TaskName, **kwargs) -> Task:
    """Build the task ``name`` with constructor ``kwargs``; a `ConfigError` for an unknown name or kwarg, or a
    bad value (``counting.vocab_size=1 is not valid; ...``)."""
    if not isinstance(name, str) or name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid choices: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    valid = list(inspect.signature(cls).parameters)
    for kwarg in kwargs:
        if kwarg not in valid:
            raise unknown_key(name, kwarg, valid)
    return cls(**kwargs)


__all__ = ["TASKS", "Batch", "CountingTask", "DyckTask", "MQARTask", "MaxRetrievalTask", "PasskeyTask",
           "SetComplementTask", "Task", "TaskName", "TomitaTask", "make_task", "roc_auc"]
