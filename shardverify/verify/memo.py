"""Values remembered per live object, looked up by the object's id.

The verifier is handed the same objects over and over (a case, its strategies, the reference
tensors every strategy compares against) and keeps what it works out about them.  Hashing a
frozen case or strategy costs more than the work saved, so tables are keyed by ``id``; each
entry holds its object, so while remembered the object stays alive and no other object can
take its id.  A table is emptied when it reaches its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["remembered", "recalled"]

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
