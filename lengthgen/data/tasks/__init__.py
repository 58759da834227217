"""Synthetic tasks generated on the fly at any length from a seeded ``torch.Generator``.

``TASKS`` maps each task's name to its class; ``make_task(name, **kwargs)`` builds one with checked
arguments.
"""

from __future__ import annotations

import inspect

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.data.tasks.counting import CountingTask
from lengthgen.data.tasks.dyck import DyckTask
from lengthgen.data.tasks.max_retrieval import MaxRetrievalTask
from lengthgen.data.tasks.mqar import MQARTask
from lengthgen.data.tasks.passkey import PasskeyTask
from lengthgen.data.tasks.set_complement import SetComplementTask
from lengthgen.data.tasks.tomita import TomitaTask, roc_auc

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (
    CountingTask, SetComplementTask, MaxRetrievalTask, DyckTask, TomitaTask, MQARTask, PasskeyTask)}


def make_task(name: str, **kwargs) -> Task:
    """Build the task ``name`` with constructor ``kwargs``; ValueError for an unknown name or kwarg."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid choices: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    valid = list(inspect.signature(cls).parameters)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"task {name!r}: unknown kwarg(s) {', '.join(unknown)}; "
                         f"valid kwargs: {', '.join(valid) or '(none)'}")
    return cls(**kwargs)


__all__ = ["TASKS", "Batch", "CountingTask", "DyckTask", "MQARTask", "MaxRetrievalTask", "PasskeyTask",
           "SetComplementTask", "Task", "TomitaTask", "make_task", "roc_auc"]
