"""What a spec file claims, read without parsing the spec: its name and the op targets it lists.

A command that names some specs checks them against the folder's other specs (one name per kind,
one spec per op target: `spec.conflicts`). Parsing every other spec for that cost seconds a call,
so the catalogue reads each other file's claim and parses in full only the specs whose claim may
conflict. A claim is read only where the text shows it plainly: the file's root is a block mapping
whose keys each start a line as a plain word, the name key once and `targets` at most once; their
values (the lines up to the next key) are read by the strict loader and the targets resolved as the
spec parser resolves them. Any other file has no claim (None) and is parsed in full: a claim never
misses a target or a name the spec parser would find.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardverify.errors import SpecError
from shardverify.spec.fields import resolve_target
from shardverify.spec.loader import MAX_FILE_BYTES, Node, load_yaml_text, read_regular_file

__all__ = ["Claim", "read_claim"]

#: a top-level key of a block mapping: a plain word at the start of a line, then ':' and a space or the end
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t]*:(?=[ \t]|\Z)")
#: a document start marker alone on its line
_START = re.compile(r"---[ \t]*(#.*)?\Z")
#: a plain word or dotted name, which YAML reads as that string (but for the words below)
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
#: an entry of a block list of names: its indentation (spaces) and the name
_ENTRY = re.compile(r"( *)-[ \t]+(\S+)\Z")
#: plain words YAML reads as a boolean or null
_NOT_STRINGS = frozenset("yes Yes YES no No NO true True TRUE false False FALSE on On ON off Off OFF "
                         "null Null NULL".split())
#: a comment: '#' at a line's start or after a space or a tab, to the line's end
_COMMENT = re.compile(r"(?:^|(?<=[ \t]))#[^\n]*", re.M)
#: line breaks YAML knows besides "\n" and "\r" (rare; such a file is parsed in full)
_RARE_BREAKS = ("\x85", "\u2028", "\u2029")


@dataclass(frozen=True)
class Claim:
    """A spec's name (its kind's name key) and its op targets as the spec lists them."""

    name: str
    targets: tuple[str, ...]


def read_claim(path: Path, display: str, name_key: str) -> Claim | None:
    """The claim of the spec file at ``path``, or None where its text does not show it plainly
    (the caller then parses the spec in full). Reads the file once, as the loader would: a regular
    file, no link followed, at most the loader's size."""
    try:
        text = read_regular_file(path, MAX_FILE_BYTES, display=display, follow_symlinks=False).decode("utf-8")
    except (SpecError, UnicodeDecodeError):
        return None
    values = _top_level_values(text.removeprefix("\ufeff"))
    if values is None or name_key not in values:
        return None
    name, targets = _plain(values[name_key]), _plain(values["targets"]) if "targets" in values else []
    if isinstance(name, str) and isinstance(targets, list):
        entries = [Node(target, display, 0, "targets") for target in targets]
    else:
        read = _read_strictly(values, name_key, display)
        if read is None:
            return None
        name, entries = read
    try:   # the spec parser's gate: no module imported by a name
        return Claim(name, tuple(resolve_target(entry) for entry in entries))
    except SpecError:
        return None


def _plain(value: str) -> str | list[str] | None:
    """The value of a key written the plain way most specs write it (``op: mm``, ``targets:
    [torch.mm, torch.Tensor.mm]``, comments and line breaks between the names): a plain word or a
    list of plain dotted names; None for any other form (the strict loader reads that)."""
    body = value.partition(":")[2]
    if "#" in body:
        body = _COMMENT.sub("", body)
        if "#" in body:
            return None
    body_first_line = body.partition("\n")[0]
    lines = [line.rstrip(" \t") for line in body.split("\n") if line.strip()]
    body = body.strip()
    if _PLAIN.match(body) and body not in _NOT_STRINGS:
        return body
    if body.startswith("["):
        if not body.endswith("]"):
            return None
        items = [item.strip() for item in body[1:-1].split(",")]
        if items[-1] == "":   # "[]", or a trailing comma
            items.pop()
    else:   # a block list, from the line after the key's, every "- name" at one indentation
        entries = [_ENTRY.match(line) for line in lines] if not body_first_line.strip() else [None]
        if not entries or None in entries or len({entry.group(1) for entry in entries}) > 1:  # type: ignore[union-attr]
            return None
        items = [entry.group(2) for entry in entries]  # type: ignore[union-attr]
    return items if all(_PLAIN.match(item) and item not in _NOT_STRINGS for item in items) else None


def _read_strictly(values: dict[str, str], name_key: str, display: str) -> tuple[str, list[Node]] | None:
    """The name and the target entries' name nodes, by the strict loader; None unless the name is
    a string and the targets a list of names or of mappings with a ``target``."""
    try:
        root = load_yaml_text("".join(values[key] for key in (name_key, "targets") if key in values), display)
    except (SpecError, RecursionError):
        return None
    name = root.value.get(name_key)  # type: ignore[union-attr]
    targets = root.value.get("targets")  # type: ignore[union-attr]
    if not isinstance(name.value, str) or (targets is not None and not isinstance(targets.value, list)):
        return None
    entries = [item.value.get("target") if isinstance(item.value, dict) else item
               for item in (targets.value if targets is not None else ())]  # type: ignore[union-attr]
    if not all(isinstance(entry, Node) for entry in entries):
        return None
    return name.value, entries


def _top_level_values(text: str) -> dict[str, str] | None:
    """{top-level key: its text, from its line up to the next key's}, or None unless every line
    that starts at column 0 is a plain key, an entry of the list under the key before it, a
    comment, blank, or a leading document start, and no key comes twice."""
    if any(mark in text for mark in _RARE_BREAKS):
        return None
    values: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line.strip() or line.lstrip(" \t").startswith("#"):
            pass
        elif line.startswith((" ", "\t")) or line == "-" or line.startswith(("- ", "-\t")):
            if current is None:
                return None
        elif current is None and not values and _START.match(line):
            continue
        else:
            key = _KEY.match(line)
            if key is None or key.group(1) in values:
                return None
            current = values[key.group(1)] = []
        if current is not None:
            current.append(line + "\n")
    return {key: "".join(lines) for key, lines in values.items()}
