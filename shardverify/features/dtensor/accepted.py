"""The accepted file: DTensor's known faults, one entry per root cause, each with its classes.

``shardverify dtensor`` exits 1 when it finds a silent-corruption or late-failure class this file
does not list, so CI can gate on DTensor's behaviour changing (a new torch, a user's own rule)::

    torch: 2.13.0            # the version the classes were found on (informative)
    accepted:
      - slug: conv2d-runtime-redistribution       # the root cause (its page: docs/upstream/SLUG.md)
        reason: aten.convolution's runtime handler never applies the redistribution its rule asks for
        culprits: ["runtime of aten.convolution.default (forward)"]   # what the harness finds at fault
        severity: [wrong shape, wrong values, fails later]
        repros: [docs/upstream/repros/conv2d-runtime-redistribution.py]   # exit 1 while the bug is there
        classes: 2                                 # how many keys follow (checked)
        keys:
          - conv2d forward input=R weight=S(0)
          - ...

A key is a finding's class (:func:`shardverify.features.dtensor.verdicts.class_key`): the op, the phase and
each operand's placements, the same on every mesh. An entry with ``culprits`` or ``severity``
accepts a finding of its keys only when the finding's culprit and severity
(:mod:`shardverify.features.dtensor.rootcause`) are listed too: a second fault under a known key is a new
class. An entry without a ``slug`` (a user's own file) accepts its keys by key alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardverify.spec.fields import Fields
from shardverify.spec.loader import load_yaml

__all__ = ["Accepted", "RootCause", "load_accepted", "render_accepted"]

_SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_SEVERITIES = ("wrong shape", "wrong values", "rounding", "fails later")


@dataclass(frozen=True)
class RootCause:
    """One entry: a fault and the classes it causes."""

    slug: str                      # "" in a file without slugs
    reason: str
    keys: tuple[str, ...]
    culprits: tuple[str, ...] = ()     # empty: any culprit
    severity: tuple[str, ...] = ()     # empty: any severity
    repros: tuple[str, ...] = ()       # scripts (paths from the repository root) that exit 1 while it reproduces
    page: str = ""
    where: str = ""                # file:line of the entry, for messages

    def accepts(self, culprit: str, severity: str) -> bool:
        """Whether a finding of one of its keys with this culprit and severity is this fault."""
        return ((not self.culprits or not culprit or culprit in self.culprits)
                and (not self.severity or not severity or severity in self.severity))


@dataclass(frozen=True)
class Accepted:
    reasons: dict[str, str]      # class key -> reason
    torch: str = ""
    causes: tuple[RootCause, ...] = ()

    def reason(self, key: str) -> str | None:
        return self.reasons.get(key)

    def cause(self, key: str) -> RootCause | None:
        """The root cause listing ``key``."""
        return next((c for c in self.causes if key in c.keys), None)

    def accepts(self, key: str, culprit: str = "", severity: str = "") -> bool:
        """Whether a finding of class ``key`` with this culprit and severity is listed."""
        if key not in self.reasons:
            return False
        cause = self.cause(key)
        return cause is None or cause.accepts(culprit, severity)


def load_accepted(path: Path) -> Accepted:
    """Read and validate ``path`` eagerly (errors name its file, line and field)."""
    root = load_yaml(path)
    fields = Fields(root)
    version = fields.optional("torch", str)
    entries = fields.required("accepted", list)
    fields.finish()
    reasons: dict[str, str] = {}
    causes: list[RootCause] = []
    slugs: dict[str, str] = {}
    for entry in entries.value:
        item = Fields(entry)
        slug = item.optional("slug", str)
        reason = item.required("reason", str)
        culprits = item.optional("culprits", list)
        severity = item.optional("severity", list)
        repros = item.optional("repros", list)
        page = item.optional("page", str)
        counted = item.optional("classes", int)
        keys = item.required("keys", list)
        item.finish()
        if not str(reason.value).strip():
            raise reason.error("an accepted class needs a reason")
        where = f"{path}:{getattr(entry, 'line', '?')}"
        name = ""
        if slug is not None:
            name = str(slug.value)
            if not _SLUG.match(name):
                raise slug.error(f"a slug is lower-case words joined by '-' (such as 'cumsum-negative-dim'), got {name!r}")
            if name in slugs:
                raise slug.error(f"root cause {name!r} is listed twice (first at {slugs[name]}): one entry per root cause")
            slugs[name] = where
            if counted is None:
                raise item.node.error(f"root cause {name!r} needs 'classes': how many keys it lists ({len(keys.value)})")
        if counted is not None and counted.value != len(keys.value):
            raise counted.error(f"says {counted.value} classes, but 'keys' lists {len(keys.value)}: correct the count")
        if not keys.value and not (repros is not None and repros.value):
            raise keys.error("an entry without keys needs 'repros' (the scripts that watch it)")
        texts = {}
        for name_, node in (("culprits", culprits), ("severity", severity), ("repros", repros)):
            values = [] if node is None else node.value
            for value in values:
                if not isinstance(value.value, str) or not value.value.strip():
                    raise value.error(f"each of '{name_}' is a non-empty string, got {value.value!r}")
                if name_ == "severity" and value.value not in _SEVERITIES:
                    raise value.error(f"a severity is one of {', '.join(_SEVERITIES)}; got {value.value!r}")
                if name_ == "repros" and (value.value.startswith("/") or ".." in Path(value.value).parts):
                    raise value.error(f"a repro is a path inside the repository, got {value.value!r}")
            texts[name_] = tuple(str(v.value) for v in values)
        listed = []
        for key in keys.value:
            if not isinstance(key.value, str) or len(key.value.split(" ")) < 3:
                raise key.error(f"expected a class key such as 'conv2d forward input=R weight=S(0)', got {key.value!r}")
            if key.value in reasons:
                raise key.error(f"class {key.value!r} is listed twice")
            reasons[key.value] = str(reason.value).strip()
            listed.append(key.value)
        causes.append(RootCause(name, str(reason.value).strip(), tuple(listed), texts["culprits"], texts["severity"],
                                texts["repros"], str(page.value) if page is not None else "", where))
    return Accepted(reasons, str(version.value) if version is not None else "", tuple(causes))


def render_accepted(causes: Sequence[RootCause], torch_version: str) -> str:
    """The file listing ``causes`` in this module's format, one entry per root cause (what
    ``--write-accepted`` writes; :func:`load_accepted` reads it back)."""
    lines = ["# DTensor's known faults, one entry per root cause: the classes each causes, the culprit the harness",
             "# names for them and their severity. A class found that is not listed here, or found with a culprit or",
             "# severity its entry does not list, makes `shardverify dtensor` exit 1.",
             f"torch: {torch_version}", "accepted:"]
    for cause in causes:
        lines.append(f"  # {len(cause.keys)} class(es)" + (f", {', '.join(cause.severity)}" if cause.severity else ""))
        lines.append(f"  - slug: {cause.slug}")
        lines.append(f"    reason: {_quoted(cause.reason)}")
        if cause.page:
            lines.append(f"    page: {cause.page}")
        if cause.repros:
            lines.append("    repros: [" + ", ".join(cause.repros) + "]")
        if cause.culprits:
            lines.append("    culprits:")
            lines += [f"      - {_quoted(culprit)}" for culprit in cause.culprits]
        if cause.severity:
            lines.append(f"    severity: [{', '.join(cause.severity)}]")
        lines.append(f"    classes: {len(cause.keys)}")
        lines.append("    keys:" if cause.keys else "    keys: []")
        lines += [f"      - {_quoted(key)}" for key in cause.keys]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
