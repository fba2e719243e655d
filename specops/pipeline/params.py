"""Fill a stage's typed config dataclass from its `params.yaml` section.

Defaults live only in the dataclasses. An unknown key is an error that names it, so a typo in
params.yaml can never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """params.yaml does not fit the stage's config; the message names the key."""


def read_params(path: Path | str = PARAMS_FILE) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path} not found. Run from the project root or pass --params.")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path} must hold a mapping of stage sections.")
    return data


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation) and isinstance(value, dict):
        return build(annotation, value, where)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, options[0], where) if len(options) == 1 else value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        (item,) = typing.get_args(annotation)[:1] or (Any,)
        return origin(_coerce(v, item, where) for v in value)
    check = origin or annotation
    if isinstance(check, type) and check is not Any and not isinstance(value, check):
        raise ParamsError(f"{where}: expected {getattr(check, '__name__', check)}, got {value!r}")
    return value


def build(cls: type[T], section: dict[str, Any] | None, where: str = "") -> T:
    """Instantiate dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    section = section or {}
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ParamsError(f"Unknown key(s) in params section '{where or cls.__name__}': {', '.join(unknown)}. "
                          f"Allowed: {', '.join(sorted(fields))}.")
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in section.items()}
    return cls(**values)
