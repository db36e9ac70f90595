"""Strict YAML reading that keeps where every value came from.

Specs are written by hand, so every complaint must point at a file, a line and a field.
PyYAML's composer gives positioned nodes; we turn them into `Node`s ourselves instead of
using its constructor, which silently lets a duplicate key overwrite the first one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml

from shardverify.errors import SpecError

__all__ = ["Node", "load_yaml", "load_yaml_text"]


@dataclass(frozen=True)
class Node:
    """A YAML value with its position: `value` is dict[str, Node], list[Node] or a scalar."""

    value: object
    file: str
    line: int
    path: str = ""
    key_line: int | None = field(default=None, compare=False)  # line of the key holding this value

    def plain(self) -> object:
        """The value with every nested Node replaced by plain Python values."""
        if isinstance(self.value, dict):
            return {key: child.plain() for key, child in self.value.items()}
        if isinstance(self.value, list):
            return [child.plain() for child in self.value]
        return self.value

    def error(self, message: str) -> SpecError:
        """A SpecError naming this node's file, line and field path (raise it); a value
        under a key is reported on the key's line, where a block mapping or list starts."""
        line = self.key_line if self.key_line is not None else self.line
        return SpecError(message, file=self.file, line=line, field=self.path or None)

    def child_path(self, key: str | int) -> str:
        """The dotted field path of a child: "verify.grid" + "dim" -> "verify.grid.dim"."""
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key


class _Loader(yaml.SafeLoader):
    """SafeLoader used only to compose nodes and resolve scalar tags.

    Aliases are refused: they can make cycles and exponential documents, and a spec that
    needs to repeat itself is clearer written out."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not supported; write the value out",
                event.start_mark)
        return super().compose_node(parent, index)


def _mark_line(mark: object) -> int | None:
    return None if mark is None else mark.line + 1  # type: ignore[attr-defined]


def load_yaml_text(text: str, file: str) -> Node:
    """Parse YAML text (named `file` in messages) into a Node tree; see `load_yaml`."""
    loader = _Loader(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            reason = " ".join(part for part in (exc.context, exc.problem) if part)
            raise SpecError(f"invalid YAML: {reason}", file=file, line=_mark_line(mark)) from None
        except yaml.YAMLError as exc:
            raise SpecError(f"invalid YAML: {exc}", file=file) from None
        if root is None:
            raise SpecError("the file is empty; expected a mapping", file=file, line=1)
        return _convert(loader, root, file, "", None)
    finally:
        loader.dispose()


def load_yaml(path: str | os.PathLike[str], *, display: str | None = None) -> Node:
    """Read one YAML file strictly: syntax errors, duplicate keys, non-string keys, tags and
    merge keys are SpecErrors naming the file and line. `display` is the file name used in
    messages (default: the path as given)."""
    name = display if display is not None else os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the file: {exc}", file=name) from None
    return load_yaml_text(text, name)


_PLAIN_TAGS = {
    "tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null",
}


def _convert(loader: _Loader, node: yaml.Node, file: str, path: str, key_line: int | None) -> Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        if node.tag != "tag:yaml.org,2002:map":
            raise SpecError(f"YAML tag {node.tag!r} is not allowed", file=file, line=line, field=path or None)
        children: dict[str, Node] = {}
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            kline = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError("YAML merge keys ('<<') are not supported; write the keys out",
                                file=file, line=kline, field=path or None)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                shown = getattr(key_node, "value", "?")
                raise SpecError(f"mapping keys must be strings, got {shown!r}",
                                file=file, line=kline, field=path or None)
            key = key_node.value
            child_path = f"{path}.{key}" if path else key
            if key in children:
                raise SpecError(f"duplicate key {key!r} (first defined on line {first_line[key]})",
                                file=file, line=kline, field=child_path)
            first_line[key] = kline
            children[key] = _convert(loader, value_node, file, child_path, kline)
        return Node(children, file, line, path, key_line)
    if isinstance(node, yaml.SequenceNode):
        if node.tag != "tag:yaml.org,2002:seq":
            raise SpecError(f"YAML tag {node.tag!r} is not allowed", file=file, line=line, field=path or None)
        items = [_convert(loader, item, file, f"{path}[{index}]", None)
                 for index, item in enumerate(node.value)]
        return Node(items, file, line, path, key_line)
    if node.tag not in _PLAIN_TAGS:
        raise SpecError(f"YAML tag {node.tag!r} is not allowed", file=file, line=line, field=path or None)
    try:
        value = loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise SpecError(f"invalid YAML scalar {node.value!r}: {exc}", file=file, line=line,
                        field=path or None) from None
    return Node(value, file, line, path, key_line)
