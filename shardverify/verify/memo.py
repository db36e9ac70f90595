"""Values remembered per live object, looked up by the object's id.

The verifier is handed the same objects over and over (a case, its strategies, the reference
tensors every strategy compares against) and keeps what it works out about them.  Hashing a
frozen case or strategy costs more than the work saved, so tables are keyed by ``id``; each
entry holds its object, so while remembered the object stays alive and no other object can
take its id.  A table is emptied when it reaches its limit.

A table of values made from one case's reference tensors (their blocks, slices, bounds and
pieces) is a *case table* (:func:`case_table`): every case table is emptied whenever a reference
is built (``verify/reference.py``), which is before any value of its case is made. Else a table
holding a tensor of each case it has seen keeps every such case alive up to its count limit:
at large shapes, gigabytes a case.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["remembered", "recalled", "case_table", "forget_cases"]

T = TypeVar("T")


def remembered(table: dict, key: Hashable, owner: object, build: Callable[[], T], limit: int) -> T:
    """``table``'s value for ``key`` (which includes ``id(owner)``), built by ``build()`` when
    absent or remembered for another object that had the same id (a ``build`` that returns None
    would build again at every ask: none does)."""
    found = recalled(table, key, owner)
    if found is None:
        if len(table) >= limit:
            table.clear()
        found = build()
        table[key] = (owner, found)
    return found


def recalled(table: dict, key: Hashable, owner: object) -> object | None:
    """``table``'s value for ``key`` if it was remembered for ``owner`` itself, else None: the
    lookup alone, which a caller asking for every rank of every check tries before making the
    closure ``remembered`` builds with (values are never None)."""
    hit = table.get(key)
    return hit[1] if hit is not None and hit[0] is owner else None


class _CaseTable(dict):
    """A case table: a dict that a weak reference can name (one a thread made goes with it)."""

    __slots__ = ("__weakref__",)


_CASE_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # id -> table


def case_table() -> dict:
    """A new, empty case table (module docstring), emptied by :func:`forget_cases` from now on
    (a module's, or a thread's own: kept while the thread holds it)."""
    table = _CaseTable()
    _CASE_TABLES[id(table)] = table
    return table


def forget_cases() -> None:
    """Empty every case table: what they held is made again, from the tensors asked about."""
    for table in list(_CASE_TABLES.values()):
        table.clear()
