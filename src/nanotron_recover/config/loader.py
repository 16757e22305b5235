"""Strict YAML -> dataclass loading.

Every section of the config is a dataclass. ``from_dict`` walks the dataclass fields with their
type hints and refuses anything it does not understand: an unknown key is an error that names the
key and the section it appeared in, and a value of the wrong type names the field, what it expected
and what it got. That strictness is the point: a typo in a 512-GPU job's YAML must fail in the
first second, not silently fall back to a default.

Two hooks let a section speak Nanotron: a ``REFUSED_KEYS`` class table gives keys Nanotron knows
(its older schema, other models' options) their own one-line refusal instead of "unknown key", and
a ``yaml_variant`` classmethod picks the class a mapping describes (``model_config``: LLaMA or
Qwen2) or refuses another model before its keys are checked.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Union

import yaml

from ..errors import InputError


class ConfigError(InputError):
    """A config that cannot be used; the message says which field and what to change."""


class SectionError(ConfigError):
    """A section refused its own fields (its ``__post_init__``) without knowing where it sits.

    A section that can appear at several places (an entry of ``recover.faults``) names itself with
    its usual path; :func:`from_dict` builds it at a known path and puts that one in front of
    ``rest``, so the message names the entry the file wrote ("recover.faults[3]: ...")."""

    def __init__(self, section: str, rest: str):
        super().__init__(section + rest)
        self.rest = rest


# PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent: ``1e-3`` and ``1.0e5``
# load as strings. Accept them where a number is expected, as YAML 1.2 (and every user) would.
_FLOAT_STR = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_error(e: yaml.YAMLError) -> str:
    """A PyYAML error on one line: the problem and where (its own message spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type ``tp`` or raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where}: not supported by this engine; remove it or set it to null")
        return None
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{where}: must not be null")
        # A mapping that holds a required key of exactly one section type is that section: its own
        # error (an unknown key, a wrong type) says more than "expected A or B".
        if isinstance(value, dict):
            claimed = [
                o
                for o in options
                if dataclasses.is_dataclass(o) and set(value) & _required_keys(o)  # type: ignore[arg-type]
            ]
            if len(claimed) == 1:
                return _convert(value, claimed[0], where)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        # One non-null option: its own message is the most helpful.
        if len(errors) == 1:
            raise ConfigError(errors[0])
        expected = " or ".join(_type_name(o) for o in options)
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping (section {tp.__name__}), got {value!r}")
        # A section with several Nanotron spellings (model_config: LLaMA or Qwen2) picks the class
        # its keys name, or refuses a kind this engine does not train, before any key is checked.
        variant = getattr(tp, "yaml_variant", None)
        if variant is not None:
            tp = variant(value, where)
        return from_dict(tp, value, where)
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_convert(k, key_tp, where): _convert(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:
            value = "off"  # YAML 1.1 reads a bare `off` as false
        if value not in allowed:
            names = ", ".join(repr(a.value if isinstance(a, Enum) else a) for a in allowed)
            raise ConfigError(f"{where}: must be one of {names}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_STR.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{where}: expected a path, got {value!r}")
        return Path(value)
    if isinstance(tp, type) and issubclass(tp, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported annotation {tp!r}")


def _required_keys(cls: type) -> set[str]:
    """Fields of a section that have no default."""
    return {
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    }


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are ConfigErrors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    section = where or "top level"
    unknown = sorted(set(data) - names, key=str)
    # Keys Nanotron knows (now or in its older schema) that this engine refuses have their own
    # one-line reason, looked up in the class's table order (the weightiest reason first).
    for key, reason in getattr(cls, "REFUSED_KEYS", {}).items():
        if key in unknown:
            raise ConfigError(f"{where + '.' if where else ''}{key} {reason}")
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r} in section {section!r} (allowed: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in data:
            if (
                f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
            ):
                raise ConfigError(f"missing required key {f.name!r} in section {section!r}")
            continue
        key = f"{where}.{f.name}" if where else f.name
        kwargs[f.name] = _convert(data[f.name], hints[f.name], key)
    try:
        return cls(**kwargs)
    except SectionError as e:
        if not where:
            raise
        raise ConfigError(where + e.rest) from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain YAML-serialisable structure (paths become strings)."""
    if dataclasses.is_dataclass(obj):
        # Fields outside __init__ are run-time state, not configuration (and from_dict refuses them).
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, Enum):  # a name of the failure vocabulary (a phase, a kind): its plain string
        return obj.value
    return obj


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override to the raw YAML mapping, in place.

    The value is parsed as YAML (``3`` is an int, ``[1, 2]`` a list, ``null`` None). List items are
    addressed by index: ``data_stages.0.data.seed=7``. A path through a missing section creates it,
    so the strict loader still gets to say whether the key is allowed.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. parallelism.tp=2")
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"--set {assignment!r}: empty key in {path!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {assignment!r}: value is not valid YAML: {_yaml_error(e)}") from e
    node: Any = data
    for i, key in enumerate(keys[:-1]):
        node = _step(node, key, ".".join(keys[: i + 1]), create=True)
    last = keys[-1]
    if isinstance(node, list):
        node[_index(node, last, path)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {assignment!r}: {'.'.join(keys[:-1])} is not a section")


def _index(node: list, key: str, where: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"--set {where}: {key!r} is not an index of a list of length {len(node)}")
    return int(key)


def _step(node: Any, key: str, where: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, key, where)]
    if not isinstance(node, dict):
        raise ConfigError(f"--set {where}: parent is not a section")
    if node.get(key) is None and create:
        node[key] = {}
    return node[key]


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_error(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must contain a mapping of sections")
    return data
