"""Jinja2 rendering for generated files, with filters that only emit safe Python.

Templates never interpolate raw YAML text: values pass through `py` (a `repr()` of plain,
validated literals), `ident` (an ASCII identifier) or `dotted` (a dotted name), the functions of
`shardverify.pysource`. Each filter re-checks its input, so a spec kind that forgets to validate
fails loudly instead of generating code an attacker chose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jinja2

from shardverify.pysource import py_dotted, py_identifier, py_literal

__all__ = ["Renderer", "py_literal", "py_identifier", "py_dotted"]


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
