"""Every error at its `FILE:LINE`: the generic engine under orchestrator.inventory, over orchestrator.yamlload.

Loading is two passes, the second only when an error must be placed:

- `load_data` is yamlload's first pass (libyaml straight to plain data, cached for large texts); a mapping
  with fewer keys than entries there sends it to the second pass, which names the duplicate at both lines
  (or finds a `<<` merge's override, which is no duplicate).
- `key_lines` composes the same text again with its marks and maps every key path to its 1-based line,
  refusing duplicate keys at their line. It runs for a duplicate the first pass noticed, for validation or
  reference errors, and for `line_of`.

`validation_errors` turns a pydantic ValidationError over the data into `FILE:LINE: key.path: what` lines
(unknown keys get a "did you mean", a discriminated union's tag is left out of the path), and `place` does
the same for errors found by other checks (a list of (key path, message)).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from orchestrator.errors import InventoryError

from orchestrator.yamlload import DuplicateKey, Loader, load_plain, no_gc, run_loader

Lines = dict[tuple[str, ...], int]


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest of `choices` to `word` (difflib), or None when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def load_data(text: str, source: str, *, fixable: bool = True, cache_dir: Path | None = None) -> Any:
    """The plain data of YAML `text`: yamlload's first pass (`cache_dir`: where large texts' data is kept).

    Raises:
        InventoryError: a control character, a YAML syntax error, an alias or a duplicate key, as one
            `FILE:LINE: what` line.
    """
    try:
        return load_plain(text, source, fixable=fixable, cache_dir=cache_dir)
    except DuplicateKey:
        key_lines(text, source)  # raises at the duplicate's line
        # None there: a `<<` merge, whose overrides are not duplicates.
        return load_plain(text, source, fixable=fixable, cache_dir=cache_dir, merges=True)


def key_lines(text: str, source: str) -> Lines:
    """The second pass: every key path (as strings; list items by index) to the 1-based line of its key.

    Raises:
        InventoryError: a duplicate key (both lines named), or what load_data raises.
    """
    node = run_loader(Loader, text, source, lambda ld: ld.get_single_node())
    lines: Lines = {}

    def walk(n, path: tuple[str, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                key = str(k.value)
                line = k.start_mark.line + 1
                if key in seen:
                    dotted = ".".join((*path, key))
                    raise InventoryError(f"{source}:{line}: {dotted}: duplicate key (first at line {seen[key]})",
                                         fix="remove one of the two")
                seen[key] = line
                lines[(*path, key)] = line
                walk(v, (*path, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[(*path, str(i))] = v.start_mark.line + 1
                walk(v, (*path, str(i)))

    if node is not None:
        lines[()] = node.start_mark.line + 1
        with no_gc():  # a key path per node: each collection would walk all of them again (19 s on 10 MB)
            walk(node, ())
    return lines


def line_for(lines: Lines, path: Iterable[str]) -> int | None:
    """Line of the deepest prefix of `path` that exists in the file (a missing key: its parent's line)."""
    path = list(path)
    for n in range(len(path), -1, -1):
        line = lines.get(tuple(path[:n]))
        if line is not None:
            return line
    return None


def place(errors: list[tuple[tuple[str, ...], str]], lines: Lines, source: str) -> list[str]:
    """`FILE:LINE: key.path: message` for each (path, message), in the order given."""
    out = []
    for path, msg in errors:
        line = line_for(lines, path)
        out.append(f"{source}:{line}: {'.'.join(path)}: {msg}" if line else f"{source}: {'.'.join(path)}: {msg}")
    return out


# ------------------------------------------------------------------------------------ pydantic errors


def _data_path(raw: Any, loc: tuple) -> tuple[list[str], list[str]]:
    """Split a pydantic loc into the path in the YAML data and the discriminator tags it passed through.

    Pydantic inserts the union tag (e.g. 'container') into locs of discriminated unions; the YAML has no
    such key, so it is dropped from the path shown to the user.
    """
    path: list[str] = []
    tags: list[str] = []
    cur = raw
    for comp in loc:
        if isinstance(cur, dict) and comp in cur:
            cur = cur[comp]
            path.append(str(comp))
        elif isinstance(cur, dict) and isinstance(comp, str) and cur.get("kind") == comp:
            tags.append(comp)
        elif isinstance(cur, list) and isinstance(comp, int) and 0 <= comp < len(cur):
            cur = cur[comp]
            path.append(str(comp))
        else:
            path.append(str(comp))
            cur = None
    return path, tags


def _model_at(root: type[BaseModel], path: list[str], tags: list[str]):
    """The pydantic model class that owns the last key of `path` (for 'did you mean' on unknown keys)."""
    tp: Any = root
    tag_iter = iter(tags)
    for comp in path[:-1]:
        tp = _unwrap(tp, tag_iter)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(comp)
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp, tag_iter)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any, tags) -> Any:
    """Strip Annotated/Optional; pick the union member whose `kind` literal is the next tag."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin is Union or str(origin) == "types.UnionType":
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
            tag = next(tags, None)
            for m in members:
                kind = getattr(m, "model_fields", {}).get("kind")
                if kind is not None and tag in typing.get_args(kind.annotation):
                    tp = m
                    break
            else:
                return None
            continue
        return tp


def _message(err: dict, path: list[str], tags: list[str], root: type[BaseModel]) -> tuple[str | None, str]:
    """(the dotted path when it differs from `path`'s, the message) of one pydantic error."""
    etype = err["type"]
    if etype == "extra_forbidden":
        model = _model_at(root, path, tags)
        fields = [f for f in (model.model_fields if model else {})]
        close = suggest(path[-1], fields) if path else None
        msg = "unknown key" + (f"; did you mean {close!r}?" if close else "")
        if fields and not close:
            msg += f" (allowed: {', '.join(fields)})"
        return None, msg
    if path and path[-1] == "[key]":
        return ".".join(path[:-1]), f"a name must be text, got {err.get('input')!r}; quote it (\"{err.get('input')}\")"
    if etype == "missing":
        return None, "required key is missing"
    if etype == "union_tag_invalid":
        ctx = err.get("ctx", {})
        return None, f"unknown kind {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
    if etype == "union_tag_not_found":
        return None, "missing `kind:` (what sort of entry this is)"
    msg = err["msg"]
    if "input" in err and not isinstance(err["input"], (dict, list)):
        msg += f" (got {err['input']!r})"
    return None, msg


def validation_errors(exc: ValidationError, raw: Any, lines: Lines, source: str,
                      root: type[BaseModel]) -> list[str]:
    """Every error of `exc` (pydantic's, validating `raw` as `root`) as `FILE:LINE: key.path: what`, by line."""
    out = []
    for err in exc.errors():
        path, tags = _data_path(raw, tuple(err["loc"]))
        if err["type"] == "union_tag_invalid":
            path.append("kind")  # point at the `kind:` line itself
        line = line_for(lines, path)
        where = f"{source}:{line}" if line else source
        dotted, msg = _message(err, path, tags, root)
        out.append((line or 0, f"{where}: {dotted if dotted is not None else '.'.join(path) or '(top level)'}: {msg}"))
    return [text for _, text in sorted(out, key=lambda item: item[0])]


__all__ = ["Lines", "key_lines", "line_for", "load_data", "place", "suggest", "validation_errors"]
