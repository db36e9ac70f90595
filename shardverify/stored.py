"""The one reader and writer of shardverify's stores: DTensor results and confirmations, the
on-demand verdict cache, the OpInfo sweep's entries. A store is untrusted input (a results folder
is committed, a cache folder is anyone's to edit), so a stored file is read as
:func:`~shardverify.files.read_regular_file` reads a user's file (a regular file of bounded size,
its own name no symbolic link, a FIFO or device refused without blocking), parsed as JSON of
bounded nesting, and checked field by field (:func:`need`, :func:`items`) before any of it is
used; a wrong field is a :class:`~shardverify.errors.StoreError` naming the file and the field,
never a traceback. Every store is written whole or not at all by
:func:`~shardverify.files.write_file_atomic`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from shardverify.errors import SpecError, StoreError
from shardverify.files import read_regular_file, write_file_atomic

__all__ = ["StoreError", "MAX_DEPTH", "read_json", "write_json", "need", "items", "nesting_problem", "safe_name"]

#: the deepest nesting of objects and lists a store holds (a DTensor result: 5); deeper is refused
MAX_DEPTH = 32

_MISSING = object()


def read_json(path: str | os.PathLike[str], max_bytes: int, *, setting: str = "") -> Any:
    """The JSON document stored at ``path``, or None when there is no file there. StoreError when
    it is no regular file (a link, a FIFO, a device: refused without reading or blocking), is
    larger than ``max_bytes``, is not UTF-8 JSON, or nests deeper than :data:`MAX_DEPTH`."""
    name = os.fspath(path)
    if not os.path.lexists(name):
        return None
    try:
        data = read_regular_file(name, max_bytes, setting=setting, follow_symlinks=False)
    except SpecError as exc:
        raise StoreError(exc.reason, file=name) from None
    try:
        document = json.loads(data)
    except RecursionError:
        raise StoreError(f"the JSON nests deeper than {MAX_DEPTH} levels", file=name) from None
    except ValueError as exc:     # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise StoreError(f"not JSON: {str(exc)[:200]}", file=name) from None
    problem = nesting_problem(document)
    if problem:
        raise StoreError(problem, file=name)
    return document


def nesting_problem(document: Any, limit: int = MAX_DEPTH) -> str:
    """Why ``document`` nests too deep ("" when it does not), found without recursion."""
    level = [document]
    for depth in range(limit + 1):
        level = [v for c in level if isinstance(c, (dict, list)) for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (dict, list))]
        if not level:
            return ""
    return f"the JSON nests deeper than {limit} levels"


def write_json(path: str | os.PathLike[str], document: Any, *, indent: int | None = None) -> None:
    """``document`` written at ``path`` whole or not at all (its folder made first)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    separators = (",", ":") if indent is None else None
    write_file_atomic(path, json.dumps(document, indent=indent, separators=separators) + "\n")


_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,99}")


def safe_name(text: str) -> str:
    """``text`` as (part of) one file name in a store: itself when it is plain (letters, digits,
    ``_.+-``, not starting with a dot, at most 100 characters), else its plain letters and a
    digest of it; a spec, case or entry name never climbs a folder nor names a hidden file."""
    if _PLAIN.fullmatch(text):
        return text
    return "".join(c if c.isalnum() else "_" for c in text)[:60] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                          list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _fits(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, float) and float in kinds:
        return math.isfinite(value)
    if isinstance(value, int) and float in kinds:
        return True
    return any(type(value) is k or (k is type(None) and value is None) for k in kinds)


def _expected(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_kind(k()) if k is not type(None) else "null" for k in kinds)


def need(item: Any, name: str, kind: type | tuple[type, ...], *, file: str, where: str = "",
         default: Any = _MISSING) -> Any:
    """``item[name]`` when ``item`` is an object and the value is of ``kind`` (``float`` takes a
    whole number, no kind takes a boolean unless it is ``bool``; ``type(None)`` admits null);
    ``default`` when the field is absent and a default is given; else a StoreError naming
    ``file`` and the field (``where.name``)."""
    field = f"{where}.{name}" if where else name
    if not isinstance(item, dict):
        raise StoreError(f"expected an object, got {_kind(item)}", file=file, field=where or None)
    if name not in item:
        if default is not _MISSING:
            return default
        raise StoreError("missing", file=file, field=field)
    value = item[name]
    if not _fits(value, kind):
        raise StoreError(f"expected {_expected(kind)}, got {_kind(value)} {json.dumps(value)[:60]}",
                         file=file, field=field)
    return value


def items(values: Any, kind: type | tuple[type, ...], *, file: str, field: str) -> list:
    """``values`` when it is a list of ``kind``, else a StoreError naming the field and the index."""
    if not isinstance(values, list):
        raise StoreError(f"expected a list, got {_kind(values)}", file=file, field=field)
    for index, value in enumerate(values):
        if not _fits(value, kind):
            raise StoreError(f"expected {_expected(kind)}, got {_kind(value)} {json.dumps(value)[:60]}",
                             file=file, field=f"{field}[{index}]")
    return values
