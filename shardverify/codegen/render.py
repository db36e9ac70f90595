"""Jinja2 rendering for generated files, with filters that only emit safe Python.

Templates never interpolate raw YAML text: values pass through `py` (a `repr()` of plain,
validated literals), `ident` (an ASCII identifier) or `dotted` (a dotted name). Each filter
re-checks its input, so a spec kind that forgets to validate fails loudly instead of
generating code an attacker chose.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable
from typing import Any

import jinja2

from shardverify.errors import InvalidArgument

__all__ = ["Renderer", "py_literal", "py_identifier", "py_dotted"]

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


class _TemplateLoader(jinja2.BaseLoader):
    """"name.j2" loads from shardverify/codegen/templates; "package:name.j2" loads from
    <package>/templates, so spec kinds living elsewhere can keep their own templates."""

    def __init__(self) -> None:
        self._loaders: dict[str, jinja2.PackageLoader] = {}

    def get_source(self, environment: jinja2.Environment, template: str
                   ) -> tuple[str, str | None, Callable[[], bool] | None]:
        package, _, name = template.rpartition(":")
        package = package or "shardverify.codegen"
        if package not in self._loaders:
            self._loaders[package] = jinja2.PackageLoader(package, "templates")
        return self._loaders[package].get_source(environment, name)


class Renderer:
    """Renders package templates with StrictUndefined (a missing variable is an error)."""

    def __init__(self) -> None:
        self.env = jinja2.Environment(
            loader=_TemplateLoader(), undefined=jinja2.StrictUndefined, autoescape=False,
            keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(py=py_literal, ident=py_identifier, dotted=py_dotted)

    def render(self, template: str, **context: Any) -> str:
        """Render `template` (see `_TemplateLoader` for names) with `context`."""
        return self.env.get_template(template).render(**context)
