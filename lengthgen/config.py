"""The configuration system: typed, documented dataclass fields and one checker.

A config is a dataclass whose fields are declared with `option` (default, one-line meaning, numeric
bounds, optional parse hook). Its ``__post_init__`` calls `check` once, which validates and converts every
field from its type hint (``Literal[...]`` choices, bool, int, float, str, ``X | None``, lists, tuples,
dicts, nested configs built from dicts), then checks only the rules that involve several fields.
`check_value` is the same checker for arguments that are not dataclass fields (task arguments, corpus
options, theory parameters).

Errors are `ConfigError` naming the key: ``TrainConfig.lr=nan is not valid; it must be a finite float32 number >=
0``. A config nested in another reports the outer key (``train.lr=...``, see `ConfigError.under`).

`build` makes a config from a TOML/JSON dict (unknown keys are errors), `set_key` sets one dotted key of
such a dict (``--set`` overrides), `parse_value` reads an override's value, `describe` lists a config's
keys with their types, values and meanings, `format_config` prints them (``lengthgen config show``),
`documented` writes them into the class docstring (``help(TrainConfig)``) and `differences` compares two config
dicts key by key.

Python 3.10 has no ``tomllib``: install ``tomli`` there (it is used as a drop-in fallback).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import json
import math
import numbers
import os
import re
import traceback
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Literal

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


class ConfigWarning(UserWarning):
    """A valid config that likely does not do what was meant (a training stage after the last step)."""


#: the largest length, size or count a config key takes (a bigger tensor dimension only overflows torch's size
#: arithmetic, with a traceback, rather than running out of memory)
MAX_SIZE = 2**31 - 1


class ConfigError(ValueError):
    """An invalid configuration key or value. The message starts with ``key`` (``""``: it names none)."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key

    def under(self, key: str) -> "ConfigError":
        """This error as reported by the config holding the failing one at ``key``: the key's first part
        (the owner that raised it, e.g. ``TrainConfig``) becomes ``key`` (``""`` drops it)."""
        message = str(self)
        if not self.key:
            return ConfigError(f"{key}: {message}" if key else message, key)
        _, dot, rest = self.key.partition(".")
        if not key and not dot:  # the top-level config itself: nothing to drop
            return self
        new = f"{key}{dot}{rest}" if key else rest
        return ConfigError(new + message[len(self.key):], new)


def raised_in_user_code(err: BaseException) -> str:
    """`` (raised at FILE:LINE, in FUNCTION)``: the deepest frame of ``err``'s traceback outside lengthgen and the
    installed packages, a researcher's own code (a `Task`'s sample or constructor) whose error a one-line message
    would otherwise hide; ``""`` when every frame is lengthgen's or a package's."""
    package = Path(__file__).resolve().parent
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = Path(frame.filename).resolve()
        if not (path.is_relative_to(package) or {"site-packages", "dist-packages"} & set(path.parts)
                or frame.filename.startswith("<")):
            return f" (raised at {frame.filename}:{frame.lineno}, in {frame.name})"
    return ""


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural (an ``s`` appended) unless ``count`` is 1: ``1 sequence``, ``2 sequences``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def steps_trained(start: int, end: int) -> str:
    """The steps after ``start`` up to ``end``, as a log line names what a session trained: ``8 steps`` from step 0,
    ``steps 5-8`` or ``step 8`` for a resumed run."""
    return counted(end, "step") if start == 0 else f"step {end}" if end == start + 1 else f"steps {start + 1}-{end}"


def invalid(key: str, value: Any, what: str) -> ConfigError:
    """``key=value is not valid; it must be <what>``."""
    return ConfigError(f"{key}={value!r} is not valid; it must be {what}", key)


#: what `folder_name` accepts, in words
FOLDER_NAME = "a plain folder name (no '/' or '\\', not blank, '.' or '..')"


def folder_name(name: str) -> bool:
    """Whether ``name`` names a folder inside another (`FOLDER_NAME`): a run's folder under runs/."""
    return name.strip() not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def unknown_key(owner: str, name: Any, valid: typing.Iterable[str]) -> ConfigError:
    """``owner.name is not a valid key; valid keys: ...``."""
    key = f"{owner}.{name}"
    return ConfigError(f"{key} is not a valid key; valid keys: {', '.join(valid)}", key)


# ---------------------------------------------------------------------------------------------------
# fields


def option(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None,
           parse: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field: ``default`` (a mutable one is copied for each instance), its one-line meaning
    ``doc``, bounds for numbers (``ge``: >=, ``gt``: >, ``le``: <=, ``lt``: <; for lists and tuples, their
    numbers) and ``parse``, a hook turning the given value into the field's type before it is checked."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"doc": doc, "bounds": bounds, "parse": parse}
    if getattr(default, "__hash__", None) is None:  # list, dict, mutable dataclass
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of dataclass ``cls``."""
    return typing.get_type_hints(cls)


def _bounds_text(bounds: dict[str, float]) -> str:
    def num(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    if low and high:
        return f" in {low[0]}{num(low[1])}, {num(high[1])}{high[0]}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {num(low[1])}"
    if high:
        return f" {'<=' if high[0] == ']' else '<'} {num(high[1])}"
    return ""


def _in_bounds(x: float, bounds: dict[str, float]) -> bool:
    return (x >= bounds.get("ge", -math.inf) and x > bounds.get("gt", -math.inf)
            and x <= bounds.get("le", math.inf) and x < bounds.get("lt", math.inf))


#: Floats must fit float32 (the model's and the optimizers' arithmetic): ``lr=1e39`` overflowed in AdamW.
FLOAT32_MAX = 3.4028234663852886e38


def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x) and abs(x) <= FLOAT32_MAX
    except OverflowError:  # an int beyond float range
        return False


def _optional_arm(hint: Any) -> Any:
    """``X`` for ``X | None``, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(arms) == 1 and len(typing.get_args(hint)) == 2:
            return arms[0]
    return None


def expected(hint: Any, bounds: dict[str, float] | None = None) -> str:
    """What a value of type ``hint`` must be, in words: ``an integer >= 1``, ``one of a, b``, ..."""
    bounds = bounds or {}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "anything"
    if _optional_arm(hint) is not None:
        return f"{expected(_optional_arm(hint), bounds)}, or none"
    if origin is Literal:
        return f"one of {', '.join(json.dumps(a) if isinstance(a, bool) else str(a) for a in args)}"  # true, as TOML
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer" + _bounds_text(bounds)
    if hint is float:
        return "a finite float32 number" + _bounds_text(bounds)
    if hint is str:
        return "a string"
    if origin is list:
        return f"a list, each item {expected(args[0], bounds)}"
    if origin is tuple:
        items = {expected(a, bounds) for a in args}
        each = f"each {items.pop()}" if len(items) == 1 else "; ".join(expected(a, bounds) for a in args)
        return f"a list of {len(args)} items, {each}"
    if origin is dict:
        return "a table" + ("" if args[1] is Any else f", each value {expected(args[1], bounds)}")
    if dataclasses.is_dataclass(hint):
        return f"a table with keys {', '.join(f.name for f in dataclasses.fields(hint))}"
    raise TypeError(f"config type {hint!r} is not supported")


def check_value(key: str, value: Any, hint: Any, **bounds: float) -> Any:
    """``value`` checked against type ``hint`` and ``bounds`` (``ge``, ``gt``, ``le``, ``lt``), converted
    (an int to a float, a list to a tuple, a dict to a dataclass); a `ConfigError` naming ``key`` if it does
    not fit. Floats must be finite and fit float32."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    arm = _optional_arm(hint)
    if arm is not None:
        if value is None:
            return None
        try:
            return check_value(key, value, arm, **bounds)
        except ConfigError as err:
            raise invalid(key, value, expected(hint, bounds)) if err.key == key else err from None
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and _in_bounds(value, bounds):
            return int(value)
    elif hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value) \
                and _in_bounds(value, bounds):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)) and (origin is list or len(value) == len(args)):
            items = args * len(value) if origin is list else args
            out = [check_value(f"{key}[{i}]", v, a, **bounds) for i, (v, a) in enumerate(zip(value, items))]
            return out if origin is list else tuple(out)
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(k, args[0]) for k in value):
            return {k: check_value(f"{key}.{k}", v, args[1], **bounds) for k, v in value.items()}
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            try:
                return build(hint, value)
            except ConfigError as err:
                raise err.under(key) from None
    else:
        raise TypeError(f"{key}: config type {hint!r} is not supported")
    raise invalid(key, value, expected(hint, bounds))


def check(obj: Any) -> None:
    """Validate and convert every field of the dataclass ``obj`` in place (frozen ones too), each by its
    parse hook, type hint and bounds; errors name ``ClassName.field``."""
    owner = type(obj).__name__
    for f in dataclasses.fields(obj):
        key, value = f"{owner}.{f.name}", getattr(obj, f.name)
        if f.metadata.get("parse") is not None:
            try:
                value = f.metadata["parse"](value)
            except ConfigError as err:
                raise err.under(key) from None
        value = check_value(key, value, hints(type(obj))[f.name], **f.metadata.get("bounds", {}))
        object.__setattr__(obj, f.name, value)


# ---------------------------------------------------------------------------------------------------
# dicts, overrides, files


def build(cls: type, data: Any) -> Any:
    """Dataclass ``cls`` from a (TOML/JSON) dict; a `ConfigError` for an unknown key or a bad value."""
    if not isinstance(data, dict):
        raise invalid(cls.__name__, data, "a table")
    names = [f.name for f in dataclasses.fields(cls)]
    for name in data:
        if name not in names:
            raise unknown_key(cls.__name__, name, names)
    return cls(**data)


def differences(a: Any, b: Any, key: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, value in a, value in b)`` wherever the config dicts ``a`` and ``b`` differ (a key missing
    from one is None there)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in differences(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))]
    return [] if a == b else [(key, a, b)]


def to_plain(value: Any) -> Any:
    """A config as JSON/TOML data: dataclasses become dicts, tuples lists, paths strings (``from_dict`` reads it
    back)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


_NONE_WORDS = ("none", "null")


def key_path(key: str | tuple[str, ...]) -> tuple[str, ...]:
    """The parts of a dotted TOML key: ``train.adam_lr_mul."value_embeds.*"`` -> ``("train", "adam_lr_mul",
    "value_embeds.*")`` (a quoted part may hold dots); a tuple is returned as it is."""
    if isinstance(key, tuple):
        return key
    parts: list[str] = []
    try:
        table = tomllib.loads(f"{key} = 0") if tomllib is not None else None
    except tomllib.TOMLDecodeError:
        table = None
    while isinstance(table, dict) and len(table) == 1:
        (part, table), = table.items()
        parts.append(part)
    return tuple(parts) if table == 0 else tuple(part.strip() for part in key.split("."))


def set_key(data: dict[str, Any], key: str | tuple[str, ...], value: Any, cls: type | None = None
            ) -> dict[str, Any]:
    """A copy of the config dict ``data`` with ``key`` (dotted, see `key_path`, or its parts) set to ``value``
    (sub-dicts created as needed; a preset name where a key goes inside becomes ``{preset = NAME}``, so
    ``model.attention=l2`` then ``model.attention.window=4`` is l2 with a window). A ``preset`` key in a table
    whose class has ``set_preset`` goes through it: ``model.attention.preset=l2`` is l2 on top of the config's
    attention. The only conversion: ``"none"``/``"null"`` becomes None where the field of ``cls`` at ``key`` is
    optional (or of any type). Validation is the checker's, when the dict is built."""
    head, *rest = key_path(key)
    hint = hints(cls).get(head) if cls is not None and dataclasses.is_dataclass(cls) else None
    out = dict(data)
    if head == "preset" and not rest and hasattr(cls, "set_preset"):
        return cls.set_preset(out, value)
    if rest:
        inner = out.get(head)
        inner = inner if isinstance(inner, dict) else {"preset": inner} if isinstance(inner, str) else {}
        sub = hint if dataclasses.is_dataclass(hint) else _optional_arm(hint)
        out[head] = set_key(inner, tuple(rest), value, sub)
    elif (hint is Any or _optional_arm(hint) is not None) and isinstance(value, str) \
            and value.lower() in _NONE_WORDS:
        out[head] = None
    else:
        out[head] = value
    return out


def leaves(table: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """The key paths and values of a nested change table (``{model = {dim = 64}}`` -> ``(("model", "dim"), 64)``;
    a key holding dots, such as a parameter pattern, stays one part), for `set_key`: tables merge into the
    config's; an empty table changes nothing."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def parse_value(raw: str) -> Any:
    """A TOML literal (``64``, ``1e-3``, ``true``, ``[[0, 32]]``, ``{window = 64}``, ``"x"``), else the string."""
    if tomllib is None:  # pragma: no cover
        raise ConfigError("reading TOML needs Python >= 3.11 or the tomli package")
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_assignment(assignment: str) -> tuple[tuple[str, ...], Any]:
    """``"a.b=value"`` -> ``(("a", "b"), parse_value("value"))`` (the key's parts by `key_path`)."""
    key, sep, raw = assignment.partition("=")
    parts = key_path(key.strip())
    if not sep or not all(part.strip() for part in parts):
        raise ConfigError(f"override {assignment!r} is not valid; write key=value, e.g. train.steps=100")
    return parts, parse_value(raw.strip())


def load_toml(path: str | Path) -> dict[str, Any]:
    """The dict of a TOML file; FileNotFoundError or a `ConfigError` naming the file."""
    if tomllib is None:  # pragma: no cover
        raise ConfigError("reading TOML needs Python >= 3.11 or the tomli package")
    try:
        return tomllib.loads(read_config_text(path))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def read_config_text(path: str | Path) -> str:
    """The text of a config file; FileNotFoundError, or a `ConfigError` naming the file when it is a folder or
    not UTF-8 text."""
    path = Path(path)
    if not path.exists():
        near = Path("configs") / f"{path.name}.toml"       # `--config counting` for the shipped configs/counting.toml
        hint = f" (did you mean {near}?)" if not path.suffix and near.is_file() else \
            " (a name of configs/, listed by lengthgen config list, or a path)" if not path.suffix and \
            near.parent.is_dir() else ""
        raise FileNotFoundError(f"config file not found: {path}{hint}")
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file"
        raise ConfigError(f"config file {path} is {what}; give a TOML or JSON file")
    try:
        return path.read_text(encoding="utf-8-sig")       # a byte-order mark (Windows editors) is not TOML or JSON
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def describe(config: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(key, what it must be, value, meaning)`` for every key of ``config``, a config class (values: its
    defaults) or instance (its values), nested configs expanded (``train.bema.kappa``)."""
    cls, rows = config if isinstance(config, type) else type(config), []
    for f in dataclasses.fields(cls):
        hint, key, doc = hints(cls)[f.name], prefix + f.name, f.metadata.get("doc", "")
        if not isinstance(config, type):
            value = getattr(config, f.name)
        else:
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(hint):
            rows += [(key, "a table", None, doc), *describe(hint if isinstance(config, type) else value, key + ".")]
        else:
            rows.append((key, expected(hint, f.metadata.get("bounds")), value, doc))
    return rows


def documented(cls: type) -> type:
    """Class decorator (above ``@dataclass``): append each field's meaning, valid values and default to the
    class docstring, so that ``help(cls)`` documents every key."""
    lines = [f"    {key}: {doc} ({what}" + ("" if what == "a table" else f"; default {default!r}") + ")"
             for key, what, default, doc in describe(cls) if "." not in key]
    cls.__doc__ = (cls.__doc__ or cls.__name__).rstrip() + "\n\n    Fields:\n\n" + "\n".join(lines) + "\n"
    return cls


def pattern_matches(key: str, patterns: dict[str, Any], names: list[str], what: str) -> list[tuple[list[str], Any]]:
    """For each (fnmatch) pattern of the config table ``key``, in order: the ``names`` it matches and its value.
    A pattern that matches none is a `ConfigError` listing the ``what``s there are."""
    matches = []
    for pattern, value in patterns.items():
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ConfigError(f"{key}: pattern {pattern!r} matches no {what}; the {what}s are {', '.join(names)}",
                              key)
        matches.append((matched, value))
    return matches


def _toml_key(key: str) -> str:
    """A table key as TOML writes it: bare when it can be, else quoted (e.g. a pattern ``blocks.*.mlp.proj``)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """A value as written in a TOML file or a ``--set`` override (None: ``none``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, float) else str(value)


def format_config(config: Any, width: int = 34) -> str:
    """A config instance as TOML: the top-level keys, then a ``[section]`` per nested config with its meaning;
    each key ``= value`` followed by ``# meaning [valid values]``. TOML has no null: a key whose value is None
    is commented out (``# head_dim = none``); left out, it reads back as None, which is every optional key's
    default."""
    rows = describe(config)
    sections = {"": ""} | {key: doc for key, what, _, doc in rows
                           if what == "a table" and any(k.startswith(key + ".") for k, *_ in rows)}
    lines: dict[str, list[str]] = {section: [] for section in sections}
    for key, what, value, doc in rows:
        section, _, name = key.rpartition(".")
        if key not in sections:
            text = f"{'# ' if value is None else ''}{name} = {toml_value(to_plain(value))}"
            lines[section].append(f"{text:<{width}} # {doc} [{what}]" if len(text) < width else
                                  f"{text}  # {doc} [{what}]")
    out = lines[""]
    for section, doc in list(sections.items())[1:]:
        out += ["", f"[{section}]  # {doc}", *lines[section]]
    return "\n".join(out)


__all__ = ["ConfigError", "build", "check", "check_value", "counted", "describe", "differences", "documented",
           "expected", "format_config", "hints", "invalid", "key_path", "leaves", "load_toml", "option",
           "parse_assignment", "parse_value", "raised_in_user_code", "set_key", "to_plain", "toml_value",
           "unknown_key"]
