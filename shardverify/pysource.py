"""Python source for plain values, refusing anything else: what a generated file or a repro
script may write of a spec's or a call's values.

Each function re-checks its input, so a caller that forgets to validate fails loudly instead
of emitting code an attacker chose. The templates (`shardverify.codegen.render`) use them as
filters; a spec kind building source text (a model's plan) and the DTensor repro use them directly.
"""

from __future__ import annotations

import keyword
import math
import re
from typing import Any

from shardverify.errors import InvalidArgument

__all__ = ["py_literal", "py_identifier", "py_dotted"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def py_literal(value: Any) -> str:
    """`repr()` of a plain literal (None, bool, int, finite float, str, tuple/list/dict of
    those); anything else is refused because its repr may not be code we want to emit."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"cannot emit the non-finite float {value!r} as a literal")
        return repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(py_literal(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    raise InvalidArgument(f"cannot emit {type(value).__name__} {value!r} as a Python literal")


def py_identifier(value: Any) -> str:
    """`value` unchanged if it is an ASCII identifier and not a keyword."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value) or keyword.iskeyword(value):
        raise InvalidArgument(f"refusing to emit {value!r} as a Python identifier")
    return value


def py_dotted(value: Any) -> str:
    """`value` unchanged if it is a dotted name of identifiers (torch.nn.Linear)."""
    if not isinstance(value, str) or not _DOTTED.match(value) or any(
            keyword.iskeyword(part) for part in value.split(".")):
        raise InvalidArgument(f"refusing to emit {value!r} as a dotted Python name")
    return value
