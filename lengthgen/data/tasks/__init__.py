"""Synthetic tasks generated on the fly at any length from a seeded ``torch.Generator``.

``TASKS`` maps each built-in task's name (a `TaskName`) to its class; `task_class` resolves a name or an import
path ``"package.module:Class"`` of a researcher's own `Task` subclass to its class, and ``make_task(name, **kwargs)``
builds one with checked arguments.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from typing import Literal

from lengthgen.config import ConfigError, invalid, unknown_key

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


#: what a task name (``data.task``) may be, in words
TASK_CHOICES = (f"one of {', '.join(TASKS)}, or 'module:Class' naming a lengthgen.data.tasks.Task subclass "
                "importable from the current folder or PYTHONPATH")


def own_task(name: object) -> bool:
    """Whether ``name`` (a ``data.task``) names a researcher's own class, ``"module:Class"``, not a built-in task."""
    return isinstance(name, str) and ":" in name


def task_class(name: str) -> type[Task]:
    """The class of task ``name``: a built-in one (`TASKS`) or ``"package.module:Class"``, a `Task` subclass imported
    from the current folder (first on the path, as under ``python -m``) or PYTHONPATH. Otherwise a `ConfigError`
    keyed ``task`` that says why: an unknown name, a module that cannot be imported, no such attribute, not a Task
    subclass, or one without its own ``sample`` or ``metrics``."""
    if isinstance(name, str) and name in TASKS:
        return TASKS[name]
    module_name, colon, attribute = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not (module_name and colon and attribute):
        raise invalid("task", name, TASK_CHOICES)
    if not all(part.isidentifier() for part in module_name.split(".")):     # a path: import_module raises TypeError
        raise ConfigError(f"task={name!r}: {module_name!r} is not a module name; name the module as Python imports "
                          "it, dotted names without a path or .py (./my_tasks.py: my_tasks:Class)", "task")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"task={name!r}: cannot import module {module_name!r} ({err}); it must be importable from "
                          "the current folder or PYTHONPATH", "task") from None
    try:
        cls = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        found = sorted(key for key, value in vars(module).items()
                       if isinstance(value, type) and issubclass(value, Task) and value is not Task)
        raise ConfigError(f"task={name!r}: module {module_name!r} has no attribute {attribute!r}"
                          + (f" (its Task subclasses: {', '.join(found)})" if found else ""), "task") from None
    if not (isinstance(cls, type) and issubclass(cls, Task) and cls is not Task):
        what = "the base class" if cls is Task else f"a {'class' if isinstance(cls, type) else type(cls).__name__}"
        raise ConfigError(f"task={name!r}: {attribute} is {what}, not a subclass of lengthgen.data.tasks.Task",
                          "task")
    undefined = [f"{method}()" for method in ("sample", "metrics") if getattr(cls, method) is getattr(Task, method)]
    if undefined:
        raise ConfigError(f"task={name!r}: {attribute} does not define {' or '.join(undefined)}, which every task "
                          "defines (lengthgen/data/tasks/base.py: a Batch of any length; per-position metrics, {} "
                          "for none)", "task")
    return cls


def make_task(name: TaskName | str, **kwargs) -> Task:
    """Build the task ``name`` (`task_class`) with constructor ``kwargs``; a `ConfigError` for an unknown name or
    kwarg (a ``**kwargs`` constructor takes any), or a bad value (``counting.vocab_size=1 is not valid; ...``)."""
    cls = task_class(name)
    parameters = inspect.signature(cls).parameters.values()
    if all(p.kind is not p.VAR_KEYWORD for p in parameters):     # a ``**kwargs`` constructor takes any key
        valid = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for kwarg in kwargs:
            if kwarg not in valid:
                raise unknown_key(name if name in TASKS else "task", kwarg, valid)
    return cls(**kwargs)


__all__ = ["TASKS", "Batch", "CountingTask", "DyckTask", "MQARTask", "MaxRetrievalTask", "PasskeyTask",
           "SetComplementTask", "TASK_CHOICES", "Task", "TaskName", "TomitaTask", "make_task", "own_task", "roc_auc",
           "task_class"]
