"""Strict YAML reading that keeps where every value came from.

Specs are written by hand, so every complaint must point at a file, a line and a field.
PyYAML's composer gives positioned nodes; we turn them into `Node`s ourselves instead of
using its constructor, which silently lets a duplicate key overwrite the first one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import yaml

from shardverify.errors import SpecError
from shardverify.files import read_regular_file  # noqa: F401 - the one reader, re-exported here

__all__ = ["Node", "load_yaml", "load_yaml_text", "read_regular_file", "MAX_FILE_BYTES", "MAX_DEPTH", "MAX_INT_BITS",
           "MAX_STRING_CHARS"]

# Limits on what a spec file may hold: far above any real spec, low enough that a hostile
# one ends in a SpecError instead of a RecursionError, a memory blow-up or a huge literal
# written into generated code (documented in specs/README.md).
MAX_FILE_BYTES = 1 << 20        # 1 MiB
MAX_DEPTH = 32                  # nested mappings and lists
MAX_INT_BITS = 64               # integers fit a signed 64-bit value
MAX_STRING_CHARS = 4096         # one string value
# Characters YAML does not allow or that only hide things: C0 controls but tab, newline and
# carriage return; DEL; C1 controls; bidi overrides; the BOM anywhere but the start.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ufeff\ufffe\uffff]")


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

    def where(self) -> tuple[str, int | None, str | None]:
        """(file, line, field path) of this node; a value under a key is placed on the key's
        line, where a block mapping or list starts."""
        return self.file, self.key_line if self.key_line is not None else self.line, self.path or None

    def error(self, message: str) -> SpecError:
        """A SpecError naming this node's file, line and field path (raise it)."""
        file, line, field = self.where()
        return SpecError(message, file=file, line=line, field=field)

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
    text = text.removeprefix("\ufeff")
    _check_characters(text, file)
    try:
        fast = _check_depth(text, file)
        loader = _FAST_EVENTS(text) if fast else _Loader(text)
    except yaml.MarkedYAMLError as exc:
        raise _syntax_error(exc, file) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"invalid YAML: {exc}", file=file) from None
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            raise _syntax_error(exc, file) from None
        except yaml.YAMLError as exc:
            raise SpecError(f"invalid YAML: {exc}", file=file) from None
        except RecursionError:
            raise SpecError(f"the YAML nests deeper than {MAX_DEPTH} levels", file=file) from None
        if root is None:
            raise SpecError("the file is empty; expected a mapping", file=file, line=1)
        return _convert(loader, root, file, "", None)
    finally:
        loader.dispose()


def _syntax_error(exc: yaml.MarkedYAMLError, file: str) -> SpecError:
    mark = exc.problem_mark or exc.context_mark
    reason = " ".join(part for part in (exc.context, exc.problem) if part)
    return SpecError(f"invalid YAML: {reason}", file=file, line=_mark_line(mark))


def _check_characters(text: str, file: str) -> None:
    """Control characters are errors, named by code point and line, before YAML sees them."""
    found = _CONTROL.search(text)
    if found:
        line = text.count("\n", 0, found.start()) + 1
        raise SpecError(f"control character U+{ord(found.group()):04X} is not allowed in a spec",
                        file=file, line=line)


#: libyaml's parser, where PyYAML was built with it: the same events as the pure-Python one, in a
#: twentieth of the time (every spec is read this way before it is composed)
_FAST_EVENTS = getattr(yaml, "CSafeLoader", None)


def _check_depth(text: str, file: str) -> bool:
    """Nesting deeper than MAX_DEPTH is an error found from the event stream (which, unlike
    composing the tree, does not recurse), so no spec can exhaust the stack. libyaml's events
    clear a spec that has neither; on anything it finds wrong (a YAML error, an alias, too deep)
    the pure-Python parser reads the text again and the refusal is PyYAML's own, as before.
    True where libyaml cleared the text: it then composes the tree too (the same nodes, tags and
    marks; no alias is left for the pure-Python loader to refuse)."""
    if _FAST_EVENTS is not None:
        try:
            _check_events(yaml.parse(text, Loader=_FAST_EVENTS), file)
            return True
        except (yaml.YAMLError, SpecError):
            pass
    _check_events(yaml.parse(text, Loader=_Loader), file)
    return False


def _check_events(events, file: str) -> None:
    depth = 0
    for event in events:
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(f"the YAML nests deeper than {MAX_DEPTH} levels", file=file,
                                line=_mark_line(event.start_mark))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            raise SpecError(f"YAML aliases (*{event.anchor}) are not supported; write the value out",
                            file=file, line=_mark_line(event.start_mark))


def load_yaml(path: str | os.PathLike[str], *, display: str | None = None) -> Node:
    """Read one YAML file strictly: syntax errors, duplicate keys, non-string keys, tags and
    merge keys are SpecErrors naming the file and line. `display` is the file name used in
    messages (default: the path as given)."""
    name = display if display is not None else os.fspath(path)
    if os.path.islink(path):
        raise SpecError("the spec is a symbolic link; specs must be regular files (copy it instead)",
                        file=name)
    data = read_regular_file(path, MAX_FILE_BYTES, display=name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x})", file=name,
                        line=line) from None
    return load_yaml_text(text, name)


_PLAIN_TAGS = {
    "tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null",
}


def _convert(loader: _Loader | yaml.CSafeLoader, node: yaml.Node, file: str, path: str,
             key_line: int | None) -> Node:
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
    shown = node.value if len(node.value) <= 40 else node.value[:40] + "..."
    if len(node.value) > MAX_STRING_CHARS:
        raise SpecError(f"a value of {len(node.value)} characters is longer than the limit of "
                        f"{MAX_STRING_CHARS}", file=file, line=line, field=path or None)
    try:
        value = loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:   # ValueError: int beyond 4300 digits
        reason = exc if isinstance(exc, yaml.YAMLError) else "not a representable number"
        raise SpecError(f"invalid YAML scalar {shown!r}: {reason}", file=file, line=line,
                        field=path or None) from None
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() >= MAX_INT_BITS:
        raise SpecError(f"integer {shown} does not fit in {MAX_INT_BITS} bits", file=file, line=line,
                        field=path or None)
    return Node(value, file, line, path, key_line)
