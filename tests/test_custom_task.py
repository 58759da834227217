"""A researcher's own task: ``data.task = "module:Class"`` names a `Task` subclass imported from the current folder,
and every command that reads data.task resolves it (`task_class`); a bad path is one line naming data.task."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from test_readme import MODEL, README, blocks

from lengthgen.cli import main
from lengthgen.config import ConfigError
from lengthgen.data.tasks import TASKS, make_task, task_class

#: a module of the current folder holding a Task subclass (``parity``) and things that are not one
MODULE = '''
import torch
from lengthgen.data.tasks import Batch, Task
from lengthgen.data.tasks.common import masked_accuracy

helper = len


class Bare(Task):
    name, vocab_size = "bare", 2


class Parity(Task):
    name, head, metric, higher_is_better = "parity", "lm", "accuracy", True
    vocab_size = 2

    def __init__(self, flip: bool = False):
        self.flip = flip

    def sample(self, batch_size, length, generator):
        tokens = torch.randint(2, (batch_size, length), generator=generator, device=generator.device)
        return Batch(tokens, (tokens.cumsum(1) + self.flip) % 2, torch.ones_like(tokens, dtype=torch.bool))

    def metrics(self, output, batch):
        return {"accuracy": masked_accuracy(output, batch.targets, batch.loss_mask)}
'''


@pytest.fixture
def in_folder(tmp_path, monkeypatch):
    """The current folder is ``tmp_path`` (not on sys.path: the resolver puts it there, as ``python -m`` would),
    with ``user_tasks.py`` (`MODULE`), ``broken.py`` (whose own import fails) and the README's example task as the
    ``my_tasks.py`` it names; sys.path is restored afterwards, and every module imported from the folder (the
    tests write more) is forgotten."""
    (tmp_path / "user_tasks.py").write_text(MODULE)
    (tmp_path / "broken.py").write_text("import not_installed_anywhere_xyz\n")
    (tmp_path / "my_tasks.py").write_text(next(code for code in blocks("python") if "(Task):" in code))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    folder = tmp_path.resolve()
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve().is_relative_to(folder):
            del sys.modules[name]


def test_an_import_path_names_a_task_class_of_the_current_folder(in_folder):
    cls = task_class("user_tasks:Parity")
    assert cls.__module__ == "user_tasks" and task_class("counting") is TASKS["counting"]
    task = make_task("user_tasks:Parity", flip=True)
    assert task.flip and task.sample(2, 8, torch.Generator().manual_seed(0)).tokens.shape == (2, 8)
    with pytest.raises(ConfigError, match=r"^task\.bogus is not a valid key; valid keys: flip$"):
        make_task("user_tasks:Parity", bogus=1)


def test_a_constructor_taking_keyword_arguments_accepts_any_task_kwargs(in_folder, capsys):
    """``**options`` takes every data.task_kwargs key (each used to be refused, 'valid keys: options'); a named
    argument beside it stays a valid key."""
    (in_folder / "open_tasks.py").write_text(MODULE.replace("flip: bool = False", "flip: bool = False, **options")
                                             .replace("self.flip = flip", "self.flip, self.options = flip, options"))
    task = make_task("open_tasks:Parity", flip=True, width=3, mode="x")
    assert task.flip and task.options == {"width": 3, "mode": "x"}
    assert main(["config", "show", "--set", "data.task=open_tasks:Parity", "--set", "data.task_kwargs.width=3"]) == 0
    assert "task_kwargs = {width = 3}" in capsys.readouterr().out


@pytest.mark.parametrize("task, message", [
    ("nope", "data.task='nope' is not valid; it must be one of counting, set_complement, max_retrieval, dyck, tomita, "
             "mqar, passkey, or 'module:Class' naming a lengthgen.data.tasks.Task subclass importable from the current "
             "folder or PYTHONPATH"),
    ("user_tasks:", "data.task='user_tasks:' is not valid; it must be one of counting, "),
    ("no_such_module_xyz:Parity", "data.task='no_such_module_xyz:Parity': cannot import module 'no_such_module_xyz' "
                                  "(No module named 'no_such_module_xyz'); it must be importable from the current "
                                  "folder or PYTHONPATH"),
    ("broken:Task", "data.task='broken:Task': cannot import module 'broken' (No module named "
                    "'not_installed_anywhere_xyz'); "),
    ("./user_tasks.py:Parity", "data.task='./user_tasks.py:Parity': './user_tasks.py' is not a module name; name the "
                               "module as Python imports it, dotted names without a path or .py (./my_tasks.py: "
                               "my_tasks:Class)"),
    (".user_tasks:Parity", "data.task='.user_tasks:Parity': '.user_tasks' is not a module name; "),
    ("user_tasks:Parit", "data.task='user_tasks:Parit': module 'user_tasks' has no attribute 'Parit' (its Task "
                         "subclasses: Bare, Parity)"),
    ("user_tasks:helper", "data.task='user_tasks:helper': helper is a builtin_function_or_method, not a subclass of "
                          "lengthgen.data.tasks.Task"),
    ("user_tasks:Batch", "data.task='user_tasks:Batch': Batch is a class, not a subclass of lengthgen.data.tasks.Task"),
    ("user_tasks:Bare", "data.task='user_tasks:Bare': Bare does not define sample() or metrics(), which every task "
                        "defines (lengthgen/data/tasks/base.py: a Batch of any length; per-position metrics, {} for "
                        "none)"),
    ("user_tasks:Task", "data.task='user_tasks:Task': Task is the base class, not a subclass of "
                        "lengthgen.data.tasks.Task"),
])
def test_a_bad_task_is_one_line_naming_data_task(in_folder, capsys, task, message):
    assert main(["config", "show", "--set", f"data.task={task}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lengthgen config: error: {message}") and err.count("\n") == 1, err


#: Parity subclasses whose sample breaks the Batch contract, each one way
BROKEN = MODULE + '''

class Short(Parity):
    def sample(self, batch_size, length, generator):
        batch = super().sample(batch_size, length, generator)
        batch.targets = batch.targets[:, 1:]
        return batch


class Floats(Parity):
    def sample(self, batch_size, length, generator):
        batch = super().sample(batch_size, length, generator)
        batch.tokens = batch.tokens.float()
        return batch


class Large(Parity):
    def sample(self, batch_size, length, generator):
        batch = super().sample(batch_size, length, generator)
        batch.tokens = batch.tokens + 2
        return batch


class Targets(Parity):
    def sample(self, batch_size, length, generator):
        batch = super().sample(batch_size, length, generator)
        batch.targets = batch.targets * 0 + 5
        return batch


class Nothing(Parity):
    def sample(self, batch_size, length, generator):
        return None
'''


@pytest.mark.parametrize("task, message", [
    ("Short", "returned targets (1, 7) torch.int64; with head 'lm' it must be (B, L) = (1, 8) long (B sequences of "
              "length L: the Batch contract, lengthgen/data/tasks/base.py)"),
    ("Floats", "returned tokens (1, 8) torch.float32; with head 'lm' it must be (B, L) = (1, 8) long"),
    ("Large", "returned token ids in [2, 3]; they must be in [0, vocab_size) = [0, 2)"),
    # was the cross-entropy's IndexError 'Target 5 is out of bounds' at the first step
    ("Targets", "returned targets in [5, 5] where loss_mask is set; they must be in [0, vocab_size) = [0, 2)"),
    ("Nothing", "returned a NoneType, not a lengthgen.data.tasks.Batch"),
])
def test_a_sample_breaking_the_batch_contract_is_one_line_naming_the_class(in_folder, capsys, task, message):
    """A first sequence drawn before anything runs is checked (shapes, dtypes, token ids), so a broken sample is one
    line naming data.task, the class and what is wrong, not a traceback from the model or the loss."""
    (in_folder / "broken_tasks.py").write_text(BROKEN)
    assert main(["config", "show", "--set", f"data.task=broken_tasks:{task}", "--set", "data.length=8", "--set",
                 "train.eval_lengths=[8]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lengthgen config: error: data.task: broken_tasks.{task}.sample(1, 8, generator) {message}")
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("metrics, message", [
    ('{"accuracy": accuracy.nanmean(1)}', "returned accuracy (2,); each metric must be (B, L) = (2, 8), per position, "
                                          "NaN where undefined (Task.metrics, lengthgen/data/tasks/base.py)"),
    ('{"acc": accuracy}', "gave no accuracy, which the task states (metric, also_reported); it gave loss, acc (with "
                          "batch_metrics)"),
])
def test_metrics_breaking_the_contract_is_one_line_naming_the_class(in_folder, capsys, monkeypatch, metrics,
                                                                     message):
    """Metrics of the wrong shape were a traceback from the evaluator (IndexError), and a metric the task names as its
    headline but never returns was an n/a at every length of a report: both one line naming the class, before a
    step is trained (they came at the first evaluation, after training when train.eval_every = 0)."""
    monkeypatch.setattr("lengthgen.train.trainer.Trainer._train_step", _no_training)
    (in_folder / "metric_tasks.py").write_text(MODULE.replace(
        'return {"accuracy": masked_accuracy(output, batch.targets, batch.loss_mask)}',
        f"accuracy = masked_accuracy(output, batch.targets, batch.loss_mask)\n        return {metrics}"))
    tiny = MODEL + ["--set", "train.steps=1", "--set", "train.batch_size=2", "--set", "train.tokens_per_step=none",
                    "--set", "train.eval_batches=1", "--set", "train.eval_batch_size=2", "--set", "data.length=8"]
    assert main(["train", "--set", "data.task=metric_tasks:Parity", *tiny, "--out", "run", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lengthgen train: error: data.task: metric_tasks.Parity.metrics(output, batch) {message}")
    assert err.count("\n") == 1, err


def _no_training(self, step):
    pytest.fail("a step was trained before the task's contract was checked")


def test_a_chance_level_may_be_one_float_for_every_position(in_folder, capsys, monkeypatch):
    """A per-position metric's chance as a float (as for a per-sequence one) was a TypeError traceback from the
    evaluator ('float' object is not subscriptable): it is the level at every position; a tensor of another length is
    one line naming the class."""
    chance = "\n    def chance(self, metric, length):\n        return {CHANCE}\n"
    (in_folder / "chance_tasks.py").write_text(MODULE + chance.replace("{CHANCE}", "0.5 if metric == 'accuracy' "
                                                                                  "else None"))
    tiny = MODEL + ["--set", "train.steps=1", "--set", "train.batch_size=2", "--set", "train.tokens_per_step=none",
                    "--set", "train.eval_batches=1", "--set", "train.eval_batch_size=2", "--set", "data.length=8"]
    assert main(["train", "--set", "data.task=chance_tasks:Parity", *tiny, "--set", "train.eval_lengths=[8, 16]",
                 "--out", "run", "--no-progress"]) == 0
    evaluation = json.loads((in_folder / "run" / "eval.json").read_text())["lengths"][0]
    assert evaluation["chance"] == {"accuracy": 0.5} and evaluation["chance_buckets"]["accuracy"][0]["mean"] == 0.5
    (in_folder / "short_chance.py").write_text(MODULE + chance.replace("{CHANCE}", "torch.zeros(length - 1)"))
    monkeypatch.setattr("lengthgen.train.trainer.Trainer._train_step", _no_training)
    assert main(["train", "--set", "data.task=short_chance:Parity", *tiny, "--out", "run2", "--no-progress"]) == 2
    assert capsys.readouterr().err.endswith(
        "error: data.task: short_chance.Parity.chance('loss', 8) returned (7,); it must be a float or a (8,) tensor "
        "(per position), or None (Task.chance)\n")


@pytest.mark.parametrize("task, setting, message", [
    ("my_tasks:FirstToken", 'data.task_kwargs.vocab_size="16"', "my_tasks.FirstToken.vocab_size='16' is not valid; "
                                                                "it must be an integer in [1, 2147483647]"),
    ("user_tasks:Parity", "model.dim=16", "user_tasks.Parity.vocab_size=0 is not valid; it must be an integer in "
                                          "[1, 2147483647]"),
    ("my_tasks:FirstToken", ('data.task_kwargs.vocab_size="16"', "model.vocab_size=16"),
     "my_tasks.FirstToken.vocab_size='16' is not valid; it must be an integer in [1, 2147483647]"),
])
def test_a_tasks_own_bad_vocabulary_names_the_task_not_model_vocab_size(in_folder, capsys, task, setting, message):
    """A task argument of the wrong type, or a class whose vocab_size is unset, was reported as model.vocab_size
    (a key the researcher never set): it names data.task and the class. With model.vocab_size set too, the
    comparison of the two was a TypeError traceback ('<' between int and str)."""
    if "Parity" in task:
        (in_folder / "user_tasks.py").write_text(MODULE.replace("    vocab_size = 2\n", ""))
    sets = [x for s in ([setting] if isinstance(setting, str) else setting) for x in ("--set", s)]
    assert main(["config", "show", "--set", f"data.task={task}", *sets]) == 2
    assert capsys.readouterr().err == (f"lengthgen config: error: data.task: {message}"
                                       + " (the model takes it from the task: its class or data.task_kwargs)\n")


@pytest.mark.parametrize("declared, message", [
    ('name = ""', "name='' is not valid; it must be a non-empty string (the task's title in reports)"),
    ("metric = 5", "metric=5 is not valid; it must be a non-empty string, the headline"),
    ('higher_is_better = "no"', "higher_is_better='no' is not valid; it must be True or False"),
    ('also_reported = ["acc"]', "also_reported=['acc'] is not valid; it must be a dict of metric name -> whether"),
    ('max_length = "10"', "max_length='10' is not valid; it must be None (unbounded) or an integer >= 1"),
])
def test_a_tasks_declared_attributes_of_the_wrong_kind_are_one_line(in_folder, capsys, declared, message):
    """``metric = 5``, ``also_reported`` as a list and ``max_length`` as a string were TypeError tracebacks; a
    ``higher_is_better`` of "no" read as True and an empty name made an untitled report, silently."""
    vocab = "    vocab_size = 2\n"
    (in_folder / "declared.py").write_text(MODULE.replace(vocab, f"{vocab}    {declared}\n", 1))
    assert main(["config", "show", "--set", "data.task=declared:Parity"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lengthgen config: error: data.task: declared.Parity.{message}") and err.count("\n") == 1


def test_a_run_whose_task_does_not_import_here_is_not_called_damaged(in_folder, capsys):
    """Evaluating a run away from its task's module said 'no readable checkpoint' (each checkpoint 'its config does
    not load'), and a run folder's config.json was 'unreadable; pass --overwrite to start over' (compare --resume),
    advice that deletes sound runs: both are the data.task error, naming the file."""
    from lengthgen.train.run_folder import saved_run_config

    tiny = MODEL + ["--set", "train.steps=1", "--set", "train.batch_size=2", "--set", "train.tokens_per_step=none",
                    "--set", "data.length=8"]
    assert main(["train", "--set", "data.task=user_tasks:Parity", *tiny, "--out", "run", "--no-progress"]) == 0
    (in_folder / "user_tasks.py").rename(in_folder / "moved_tasks.py")
    sys.modules.pop("user_tasks", None)
    capsys.readouterr()
    assert main(["eval", "run", "--lengths", "8", "--tokens", "16"]) == 2
    missing = ("data.task='user_tasks:Parity': cannot import module 'user_tasks' (No module named 'user_tasks'); it "
               "must be importable from the current folder or PYTHONPATH")
    assert capsys.readouterr().err == (f"lengthgen eval: error: run/checkpoints/step_00000001/state.json: {missing}\n")
    with pytest.raises(ConfigError, match=re.escape(f"run/config.json: {missing}")):
        saved_run_config("run")
    assert sorted(p.name for p in (in_folder / "run" / "checkpoints").iterdir()) == ["step_00000001"]


def test_a_value_error_from_the_researchers_own_code_says_where_it_was_raised(in_folder, capsys):
    """A ValueError (or a constructor's TypeError) becomes one line keyed data.length / data.task_kwargs, as a length
    the task cannot generate or a bad argument does; from a bug in the researcher's own sample or constructor that
    line hid where it was raised ('data.length: length 8: too many values to unpack (expected 2)'): it names the
    file, line and function."""
    code = MODULE.replace("        self.flip = flip\n", "        self.flip = flip\n        int(flip)\n").replace(
        "    def sample(self, batch_size, length, generator):\n",
        "    def sample(self, batch_size, length, generator):\n        a, b = 1, 2, 3\n")
    (in_folder / "buggy_tasks.py").write_text(code)
    lines = code.splitlines()
    path = in_folder / "buggy_tasks.py"
    for setting, error, line, function in [
            ("data.length=8", "data.length: length 8: too many values to unpack (expected 2)",
             lines.index("        a, b = 1, 2, 3"), "sample"),
            ('data.task_kwargs.flip="x"', "data.task_kwargs: invalid literal for int() with base 10: 'x'",
             lines.index("        int(flip)"), "__init__")]:
        assert main(["config", "show", "--set", "data.task=buggy_tasks:Parity", "--set", setting]) == 2
        assert capsys.readouterr().err == (f"lengthgen config: error: {error} (raised at {path}:{line + 1}, in "
                                           f"{function})\n")


def test_compare_task_flag_takes_an_import_path(in_folder, capsys):
    assert main(["compare", "--task", "user_tasks:Nope", "--out", str(in_folder / "c")]) == 2
    assert capsys.readouterr().err == ("lengthgen compare: error: data.task='user_tasks:Nope': module 'user_tasks' has "
                                       "no attribute 'Nope' (its Task subclasses: Bare, Parity)\n")


def test_config_show_lists_an_own_tasks_arguments(in_folder, capsys):
    assert main(["config", "show", "--set", "data.task=user_tasks:Parity", "--set", "data.task_kwargs.flip=true"]) == 0
    out = capsys.readouterr().out
    assert 'task = "user_tasks:Parity"' in out and "task_kwargs = {flip = true}" in out
    assert out.rstrip().endswith("# data.task_kwargs of user_tasks:Parity: flip (default False)")


@pytest.mark.parametrize("constructor, listed", [
    ("flip: bool = False, **options", "flip (default False), any key (**options)"),
    ("*, flip: bool", "flip (required)"),
    ("", "none"),
])
def test_config_show_lists_every_kind_of_task_argument(in_folder, capsys, constructor, listed):
    """The task_kwargs line listed only arguments with defaults: a constructor taking **kwargs, or none at all, left
    'data.task_kwargs of X: ' empty, and a required argument was not named."""
    (in_folder / "args_tasks.py").write_text(MODULE.replace("flip: bool = False", constructor).replace(
        "self.flip = flip", "self.flip = False"))
    setting = ["--set", "data.task_kwargs.flip=true"] if "required" in listed else []
    assert main(["config", "show", "--set", "data.task=args_tasks:Parity", *setting]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"# data.task_kwargs of args_tasks:Parity: {listed}")


def test_the_readme_task_trains_compares_with_workers_and_evaluates(in_folder, capsys):
    """The README's own task, saved as the my_tasks.py it names, runs its compare command (two variants, each in its
    own spawned worker, which imports the class again by its path); a run's saved config keeps the path, so eval,
    a resumed run and report read it back."""
    command = re.search(r"`lengthgen (compare --task my_tasks:FirstToken[^`]*)`", README.read_text()).group(1)
    tiny = MODEL + ["--seeds", "1", "--workers", "2", "--steps", "2", "--eval-lengths", "16,32", "--eval-tokens", "32",
                    "--set", "train.threads=1", "--set", "train.batch_size=4", "--out", "c", "--no-progress"]
    assert main(command.split() + tiny) == 0
    results = json.loads((in_folder / "c" / "results.json").read_text())
    assert set(results["variants"]) == {"baseline", "l2"} and results["title"] == "lengthgen compare: first_token"
    run = in_folder / "c" / "runs" / "l2-seed0"
    assert json.loads((run / "config.json").read_text())["data"]["task"] == "my_tasks:FirstToken"
    assert main(["eval", str(run), "--lengths", "16,32", "--tokens", "32"]) == 0
    assert "length 32: loss" in capsys.readouterr().out
    assert main(["train", "--config", str(run / "config.json"), "--out", str(run), "--resume", "--extend", "--set",
                 "train.steps=3", "--no-progress"]) == 0
    assert "step 3/3" in capsys.readouterr().out
    assert main(["report", "c"]) == 0
