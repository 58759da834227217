"""Imports point down the layers: cli -> experiments -> hf -> report -> train -> eval -> model -> data ->
attention -> base modules (config, atomic, memory, optional, version). Every import of every module is read with
`ast`, top-level and inside functions alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lengthgen"

#: top to bottom; a module may import its own layer and the layers below it
LAYERS = ("cli", "experiments", "hf", "report", "train", "eval", "model", "data", "attention", "base")
#: modules whose layer is not their package's, by dotted name
BY_NAME = {"lengthgen.__main__": "cli"}
BASE = ("lengthgen", "lengthgen.config", "lengthgen.atomic", "lengthgen.memory", "lengthgen.optional",
        "lengthgen.version")


def layer(module: str) -> str:
    """The layer of a dotted module name inside the package (``lengthgen.train.trainer`` -> ``train``)."""
    parts = module.split(".")
    if module in BASE:
        return "base"
    if module in BY_NAME:
        return BY_NAME[module]
    if parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module} has no layer: add it to LAYERS or BY_NAME in tests/test_layers.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, imported lengthgen module) for every import in ``source``, a module of ``package``; relative
    imports are resolved and ``from X import name`` counts as importing ``X.name`` when that is a module."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((node.lineno, sub if is_module(sub) else base))
    return [(line, name) for line, name in out if name.split(".")[0] == "lengthgen"]


def upward_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports of ``module`` (its ``source``) that point to a higher layer, or to the package root
    (which re-exports the model: import from the defining module instead)."""
    package = module if is_package else module.rpartition(".")[0]
    own = LAYERS.index(layer(module))
    return [f"line {line}: {target} ({layer(target)})" for line, target in imports(source, package)
            if target == "lengthgen" or LAYERS.index(layer(target)) < own]


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_no_upward_import(path):
    name = module_name(path)
    if name == "lengthgen":
        return                                        # the package __init__ may re-export the public API
    upward = upward_imports(name, path.read_text(), path.name == "__init__.py")
    assert not upward, f"{name} ({layer(name)}) imports upward: {'; '.join(upward)}"


def test_the_check_can_fail():
    assert len(MODULES) > 40 and layer("lengthgen.experiments.needle") == "experiments"
    assert layer("lengthgen.report.needle") == "report" and layer("lengthgen.__main__") == "cli"
    assert layer("lengthgen.data.config") == "data" and layer("lengthgen.config") == "base"
    source = "import torch\nfrom lengthgen.config import check\n\n\ndef f():\n    from ...train import trainer\n"
    assert upward_imports("lengthgen.data.tasks.counting", source) == ["line 6: lengthgen.train.trainer (train)"]
    assert upward_imports("lengthgen.attention.spec", "from lengthgen import GPT\n") == [
        "line 1: lengthgen (base)"]
    assert upward_imports("lengthgen.train.trainer", "from lengthgen.data import tasks\n") == []
