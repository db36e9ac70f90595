"""The registry of spec kinds: how each kind of YAML spec is parsed and rendered.

One generator serves op, collective and model specs; a kind plugs in by registering a
`SpecKind` when its module (listed in `KIND_MODULES`) is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardverify.errors import InvalidArgument

if TYPE_CHECKING:
    from shardverify.spec.loader import Node
    from shardverify.codegen.render import Renderer

__all__ = ["SpecKind", "register_spec_kind", "spec_kinds", "get_spec_kind", "KIND_MODULES"]

# Modules that register a SpecKind on import, in the order `generate` and `list` use them.
KIND_MODULES = ("shardverify.codegen.op_kind", "shardverify.algorithms.spec", "shardverify.ddp.spec",
                "shardverify.reshard.spec", "shardverify.plan.spec")


@dataclass(frozen=True)
class SpecKind:
    """One kind of spec: where its files live and how to turn one into generated files.

    `parse(root)` returns a frozen spec model with `.name` and `.source` (the spec file as
    named in messages) and raises SpecError on any problem; `render(spec, renderer)` returns
    {repo-relative output path: file body}. The generator adds the header to each body.
    `summary(spec)`, if given, returns the {column: text} that `shardverify list` prints."""

    name: str
    subdir: str
    parse: Callable[[Node], object]
    render: Callable[[object, Renderer], dict[str, str]]
    summary: Callable[[object], dict[str, str]] | None = None   # columns for `shardverify list`


_KINDS: dict[str, SpecKind] = {}


def register_spec_kind(kind: SpecKind) -> SpecKind:
    """Register `kind` by name. Re-registering a name from the same module (a reload) replaces
    it; a second kind claiming a name or spec subdirectory already taken is an error."""
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
