"""The registry of spec kinds: how each kind of YAML spec is parsed, listed and which files it
generates.

The catalogue (`shardverify.spec.catalogue`) reads every registered kind's folder. Each kind is
defined beside its model (the op kind in `spec.op_kind`, the others in their feature's
`spec.py`) and registered where specs are read: the catalogue registers the op kind, the CLI
(`shardverify.cli.catalogue`) every kind, in the order `list` and `generate` read them.
A kind names its templates and their values; rendering them is `shardverify.codegen`'s job,
reached through the `TemplateRenderer` it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shardverify.errors import InvalidArgument

if TYPE_CHECKING:
    from shardverify.spec.loader import Node

__all__ = ["SpecKind", "TemplateRenderer", "register_spec_kind", "spec_kinds", "get_spec_kind"]


class TemplateRenderer(Protocol):
    """What a kind's `render` is handed: renders one template with its values (codegen's
    `Renderer`, whose filters only emit validated literals and names)."""

    def render(self, template: str, **context: Any) -> str: ...


@dataclass(frozen=True)
class SpecKind:
    """One kind of spec: where its files live and how to turn one into generated files.

    `parse(root)` returns a frozen spec model with `.name` and `.source` (the spec file as
    named in messages) and raises SpecError on any problem; `render(spec, renderer)` returns
    {repo-relative output path: file body}. The generator adds the header to each body.
    `summary(spec)`, if given, returns the {column: text} that `shardverify list` prints.
    `name_key` is the top-level key holding `.name` (read without parsing the spec: `spec.claims`)."""

    name: str
    subdir: str
    parse: Callable[[Node], object]
    render: Callable[[object, TemplateRenderer], dict[str, str]]
    summary: Callable[[object], dict[str, str]] | None = None   # columns for `shardverify list`
    name_key: str = "name"


_KINDS: dict[str, SpecKind] = {}


def register_spec_kind(kind: SpecKind) -> SpecKind:
    """Register `kind` by name. Registering a name again from the same module (a reload, or the
    CLI registering what the catalogue did) replaces it in place; a second kind claiming a name
    or spec subdirectory already taken is an error."""
    if not isinstance(kind, SpecKind):
        raise InvalidArgument(f"register_spec_kind expects a SpecKind, got {kind!r}")
    if not kind.name or not kind.name.isidentifier():
        raise InvalidArgument(f"spec kind name must be an identifier, got {kind.name!r}")
    if kind.subdir.startswith(("/", ".")) or "\\" in kind.subdir:
        raise InvalidArgument(f"spec kind subdir must be a plain relative folder name, got {kind.subdir!r}")
    old = _KINDS.get(kind.name)
    if old is not None and old.parse.__module__ != kind.parse.__module__:
        raise InvalidArgument(f"spec kind {kind.name!r} is already registered by {old.parse.__module__}")
    for other in _KINDS.values():
        if other.name != kind.name and other.subdir == kind.subdir:
            raise InvalidArgument(f"spec kinds {other.name!r} and {kind.name!r} both claim the spec "
                                  f"folder {kind.subdir or '.'!r}")
    _KINDS[kind.name] = kind
    return kind


def spec_kinds() -> tuple[SpecKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())


def get_spec_kind(name: str) -> SpecKind:
    """The kind registered as `name`."""
    try:
        return _KINDS[name]
    except KeyError:
        known = ", ".join(sorted(_KINDS)) or "none"
        raise InvalidArgument(f"unknown spec kind {name!r}; registered kinds: {known}") from None
