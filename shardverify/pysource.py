"""Python source for plain values, refusing anything else: what a generated file or a repro
script may write of a spec's or a call's values.

Each function re-checks its input, so a caller that forgets to validate fails loudly instead
of emitting code an attacker chose. The templates (`shardverify.codegen.render`) use them as
filters; a spec kind building source text (a model's plan) and the DTensor repro use them directly.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
import sys
from typing import Any

from shardverify.errors import InvalidArgument

__all__ = ["py_literal", "py_identifier", "py_dotted", "ModelSource", "py_model"]

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


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A value of the op model as Python source: the expression, and the classes it names as
    (module, name) pairs, for the generated module to import."""

    text: str
    imports: tuple[tuple[str, str], ...]


def py_model(value: Any, indent: int | None = None) -> ModelSource:
    """Source of a value of the op model (a spec's declarations, its parsed rule): a frozen
    dataclass as a call of its class with every field that differs from its default (nested ones
    alike), or a plain literal (:func:`py_literal`). A class is named only where it is importable
    as itself from its module (the rule's classes, a family's options class registered in code),
    so the source rebuilds that very class; anything else is refused. ``indent``: the outer
    call's arguments one a line, at that indentation."""
    imports: set[tuple[str, str]] = set()
    return ModelSource(_model_text(value, imports, indent), tuple(sorted(imports)))


def _model_text(value: Any, imports: set[tuple[str, str]], indent: int | None = None) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(_model_text(item, imports) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return py_literal(value)
    cls = type(value)
    module, name = cls.__module__, cls.__qualname__
    if not cls.__dataclass_params__.frozen or \
            getattr(sys.modules.get(module), name, None) is not cls:   # type: ignore[attr-defined]
        raise InvalidArgument(f"cannot emit {name} {value!r} as source: not a frozen dataclass importable by "
                              f"its name from its module")
    imports.add((py_dotted(module), py_identifier(name)))
    fields = []
    for f in dataclasses.fields(value):
        if not f.init:
            continue
        held = getattr(value, f.name)
        if f.default is not dataclasses.MISSING and _same(held, f.default):
            continue
        if f.default_factory is not dataclasses.MISSING and _same(held, f.default_factory()):
            continue
        fields.append(f"{py_identifier(f.name)}={_model_text(held, imports)}")
    if indent is None or not fields:
        return f"{name}({', '.join(fields)})"
    return f"{name}(\n" + "".join(f"{' ' * (indent + 4)}{f},\n" for f in fields) + " " * indent + ")"


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type throughout (True is not 1 here: a default of 1 keeps a True)."""
    return type(a) is type(b) and a == b and (not isinstance(a, tuple) or all(map(_same, a, b)))
