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

__all__ = ["remembered"]

T = TypeVar("T")


def remembered(table: dict, key: Hashable, owner: object, build: Callable[[], T], limit: int) -> T:
    """``table``'s value for ``key`` (which includes ``id(owner)``), built by ``build()`` when
    absent or remembered for another object that had the same id."""
    hit = table.get(key)
    if hit is None or hit[0] is not owner:
        if len(table) >= limit:
            table.clear()
        hit = table[key] = (owner, build())
    return hit[1]
