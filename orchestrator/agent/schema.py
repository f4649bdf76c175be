"""The one field check of the agent protocol's typed requests and events (orchestrator.agent.requests,
orchestrator.agent.events): whether a JSON object is the fields of a dataclass. Standard library only."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, NamedTuple


class SchemaProblem(NamedTuple):
    message: str
    """What is wrong, naming the field: "unknown field 'x' (known: ...)", "missing field 'x'", ..."""
    unknown: bool
    """The field is one the schema does not know (a workstation and a bundle that disagree)."""


def schema_problem(cls: type, data: dict[str, Any]) -> SchemaProblem | None:
    """What keeps `data` from being the fields of the dataclass `cls`: an unknown field, a missing one (a
    field without a default), or a value whose JSON type does not fit the field's annotation; None if none."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        return SchemaProblem(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(fields))})", True)
    hints = typing.get_type_hints(cls)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                return SchemaProblem(f"missing field {name!r}", False)
            continue
        if not _fits(data[name], hints[name]):
            return SchemaProblem(f"field {name!r} must be {_describe(hints[name])}, got {_json(data[name])}", False)
    return None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (str, int, float, bool, dict, list, their | None)."""
    args = typing.get_args(hint)
    if _is_union(hint):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint) or hint
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if origin is Any:
        return True
    if isinstance(value, bool) and origin in (int, float):
        return False  # JSON true is not a number
    if origin is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin)


def _json(value: Any) -> str:
    """A value as the JSON it arrived as (`true`, `"soon"`), shortened."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if _is_union(hint):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint) or hint
    if origin is list and args:
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(args[0], _describe(args[0]))
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
            list: "a list"}.get(origin, getattr(origin, "__name__", str(origin)))
