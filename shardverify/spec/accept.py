"""``audit: accept:`` in an op spec: known missing strategies, each with the reason it is
acceptable, so the audit (and CI) fails only on a *new* gap.

```yaml
audit:
  accept:
    - reason: the bias is post-added, never a partial sum
      match: {any_input: "* P(*"}      # role (or output / any_input) -> glob on its layout
      mesh: [2, 2]                      # optional: only on this mesh
      where: {bias: true}               # optional: only at these grid values
```
A glob's only wildcard is ``*`` (any text); everything else, brackets included, is literal,
so ``"[S0, *]"`` reads like the layouts the audit prints. A role may take a list of globs
(any of them matches); every role listed must match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardverify.spec.fields import Fields, as_shape, check_type
from shardverify.spec.loader import Node
from shardverify.spec.values import parse_where

__all__ = ["AcceptEntry", "parse_audit", "glob_matches", "family_gaps"]

SPECIAL_ROLES = ("output", "any_input")


@dataclass(frozen=True)
class AcceptEntry:
    """One accepted gap: combinations whose layouts match every glob of ``match``."""

    reason: str
    match: tuple[tuple[str, tuple[str, ...]], ...]
    meshes: tuple[tuple[int, ...], ...] = ()
    where: tuple[tuple[str, object], ...] = ()
    file: str = ""
    line: int = 0

    def applies(self, mesh: tuple[int, ...], point: dict, layouts: dict[str, str], outputs: str) -> bool:
        """Does this entry cover a combination (``layouts``: role -> layout text) on ``mesh``
        at grid ``point``?"""
        if self.meshes and tuple(mesh) not in self.meshes:
            return False
        if any(key not in point or point[key] != value for key, value in self.where):
            return False
        for role, patterns in self.match:
            if role == "output":
                texts = [outputs]
            elif role == "any_input":
                texts = list(layouts.values())
            else:
                texts = [layouts[role]] if role in layouts else []
            ok = any(glob_matches(p, text) for p in patterns for text in texts)
            if not ok:
                return False
        return True

    def where_text(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


def family_gaps(family: str) -> tuple[AcceptEntry, ...]:
    """The gaps generator family ``family`` declares for every spec using it (KnownGap), as
    accept entries naming the family."""
    from shardverify.strategies import generators as _generators  # noqa: F401  (registers the families)
    from shardverify.strategies.generators.registry import known_gaps
    from shardverify.strategies.rules import generator as _rules  # noqa: F401  (registers `rules`)

    return tuple(AcceptEntry(gap.reason, gap.match, file=f"the {family!r} generator family")
                 for gap in known_gaps(family))


def glob_matches(pattern: str, text: str) -> bool:
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, text) is not None


def parse_audit(node: Node | None, roles: set[str], grid: dict[str, tuple], meshes: tuple[tuple[int, ...], ...]
                ) -> tuple[tuple[AcceptEntry, ...], tuple[tuple[int, ...], ...] | None, str]:
    """An ``audit:`` mapping: its accepted gaps, and the meshes the generated audit test runs on
    (``meshes:``, some of the spec's ``meshes``; None: the default, its 1-D and 2-D ones: an op
    with many operands enumerates layouts combinatorially, and its audit on a 2-D mesh can take a
    minute, which a spec may leave to ``shardverify audit --mesh``), and ``skip:``, why the audit
    cannot run the op at all (a kernel that reads out of bounds on the mismatched local shapes the
    audit tries: it is never run, and every audit says so). SpecError naming file:line on any mistake."""
    if node is None:
        return (), None, ""
    fields = Fields(node)
    accept_node = fields.optional("accept", list)
    meshes_node = fields.optional("meshes", list)
    skip_node = fields.optional("skip", str)
    fields.finish()
    skip = " ".join(str(skip_node.value).split()) if skip_node is not None else ""
    if skip_node is not None and not skip:
        raise skip_node.error("'skip' says why the audit cannot run the op; give a reason")
    if skip and (accept_node is not None or meshes_node is not None):
        raise skip_node.error("an audit that is skipped takes no 'accept' or 'meshes'")
    chosen = None
    if meshes_node is not None:
        chosen = tuple(as_shape(item, allow_empty=False) for item in meshes_node.value)  # type: ignore[union-attr]
        if not chosen or any(m not in meshes for m in chosen):
            raise meshes_node.error(f"audit meshes are some of the spec's meshes {[list(m) for m in meshes]}, "
                                    f"got {[list(m) for m in chosen]}")
    if accept_node is None:
        return (), chosen, skip
    entries = []
    for item in check_type(accept_node, list).value:  # type: ignore[union-attr]
        f = Fields(item)
        reason_node = f.required("reason", str)
        match_node = f.required("match", dict)
        mesh_node = f.optional("mesh", list)
        where_node = f.optional("where", dict)
        f.finish()
        reason = str(reason_node.value).strip()
        if not reason:
            raise reason_node.error("an accepted gap needs a reason")
        match = []
        for role, glob_node in match_node.value.items():  # type: ignore[union-attr]
            if role not in roles and role not in SPECIAL_ROLES:
                raise glob_node.error(f"'{role}' is not an operand role; use one of "
                                      f"{', '.join(sorted(roles | set(SPECIAL_ROLES)))}")
            items = glob_node.value if isinstance(glob_node.value, list) else [glob_node]
            if not items:
                raise glob_node.error(f"list at least one layout glob for '{role}'")
            for glob in items:  # type: ignore[union-attr]
                check_type(glob, str)
            match.append((role, tuple(str(glob.value) for glob in items)))  # type: ignore[union-attr]
        if not match:
            raise match_node.error("match at least one role's layout (e.g. {any_input: \"* P(*\"})")
        meshes: tuple[tuple[int, ...], ...] = ()
        if mesh_node is not None:
            items = mesh_node.value
            nested = items and all(isinstance(i.value, list) for i in items)  # type: ignore[union-attr]
            meshes = (tuple(as_shape(i, allow_empty=False) for i in items) if nested  # type: ignore[union-attr]
                      else (as_shape(mesh_node, allow_empty=False),))
        entries.append(AcceptEntry(reason, tuple(match), meshes, parse_where(where_node, grid), item.file, item.line))
    return tuple(entries), chosen, skip
