"""What one DTensor execution means: its class, its rule-level verdict beside it, and the key a
silent-corruption finding is accepted under.

The classes, most important first:

* ``silent-wrong``: DTensor returns wrong values or shapes (forward) or wrong gradients
  (backward) and raises nothing: what corrupts training.
* ``late-failure``: the op returned a DTensor, and a later step raises: its ``full_tensor()``
  (the output's placements do not fit its local pieces), the backward, or a gradient's
  ``full_tensor()``. Between silent and raising: nothing is wrong where the op was called, the
  error comes from elsewhere, and a program that never reads the value back goes on with it.
* ``raises``: DTensor raises on these input placements (every placement is a legal DTensor input;
  it should compute, redistributing if it must).
* ``missed-optimisation``: right, but DTensor moved data in the forward (a collective, or an input
  whose placements its runtime changed) where the audit found a strategy that runs on these
  layouts with no communication. A view's arguments rewritten to local sizes move nothing and
  are not counted; nor is this check's own gather of the output before the backward.
* ``agrees``: right values and gradients, communicating only where no local strategy exists.
* ``not-expressible``: DTensor's placements do not hold the layout (nothing is claimed).
* ``not-simulated``: LocalTensorMode itself fails on the combination (combining the ranks' results
  of an op that differ in structure, as uneven chunks do): nothing is claimed in process; real
  gloo processes run it.
* ``too-slow``: DTensor did not finish within the budget (nothing is claimed; the case's other
  combinations are not executed, and the report says how many).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardverify.features.dtensor.execute import Execution

__all__ = ["CLASSES", "Finding", "classify", "class_key"]

_PLACEMENT = re.compile(r"_S\(\d+, sf=\d+\)|S\(\d+\)|P\(\w+\)|R")   # placements_text's names

CLASSES: dict[str, str] = {
    "silent-wrong": "DTensor computes wrong values or shapes silently",
    "late-failure": "the op returned; its output's full_tensor(), the backward or a gradient raises later",
    "raises": "DTensor raises",
    "missed-optimisation": "DTensor moves data (a collective or a placement change) where a local strategy exists",
    "agrees": "DTensor computes the right values and gradients",
    "not-expressible": "the layout is not expressible in DTensor placements",
    "not-simulated": "LocalTensorMode cannot run the combination in one process (nothing claimed)",
    "too-slow": "DTensor did not finish the combination within the time budget",
}


@dataclass(frozen=True)
class Finding:
    """One (op, case, mesh, input layouts) executed on DTensor, classified."""

    op: str
    case: str
    mesh: tuple[int, ...]
    layouts: tuple[tuple[str, str], ...]        # (role, shardverify layout)
    placements: tuple[tuple[str, str], ...]     # (role, DTensor placements)
    klass: str
    phase: str                                  # "forward" | "backward" | ""
    detail: str
    rule: str                                   # DTensor's rule-level verdict, "" when not determined
    runtime: str                                # what the runtime did against the rule
    local_strategy: str                         # the audit: the local strategy's outputs, or why none
    comms: str                                  # collectives DTensor ran (forward; backward)
    repro: str = ""                             # a standalone script (the first silent finding of its class)
    culprit: str = ""                           # the first aten op found wrong and who is to blame (attribute.py)

    @property
    def line(self) -> str:
        return " ".join(f"{role}={text}" for role, text in self.placements)

    def key(self) -> str:
        return class_key(self.op, self.phase, self.placements, self.klass)

    @classmethod
    def from_json(cls, item: dict) -> "Finding":
        return cls(item["op"], item["case"], tuple(item["mesh"]), tuple(item["layouts"].items()),
                   tuple(item["placements"].items()), item["class"], item["phase"] or "", item["detail"] or "",
                   item["rule"] or "", item["runtime"] or "", item["local_strategy"], item["comms"] or "",
                   culprit=item.get("culprit") or "")

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "mesh": list(self.mesh), "class": self.klass,
                "phase": self.phase or None, "layouts": dict(self.layouts), "placements": dict(self.placements),
                "detail": self.detail or None, "rule": self.rule or None, "runtime": self.runtime or None,
                "local_strategy": self.local_strategy, "comms": self.comms or None, "culprit": self.culprit or None,
                "key": self.key()}


def class_key(op: str, phase: str, placements: tuple[tuple[str, str], ...], klass: str = "silent-wrong") -> str:
    """The class a finding belongs to, the same on every mesh: the op, the phase (``-late``
    after it for a late failure) and, per operand, the set of placements other than R it holds
    (``weight=S(0)`` on (4,) and on (2, 2) as ``[R, S(0)]`` are one class)."""
    parts = []
    for role, text in placements:
        kinds = sorted(set(_PLACEMENT.findall(text)) - {"R"})
        parts.append(f"{role}={'+'.join(kinds) or 'R'}")
    word = (phase or "-") + ("-late" if klass == "late-failure" else "")
    return f"{op} {word} {' '.join(parts)}"


def classify(execution: Execution, valid_locally: bool) -> tuple[str, str]:
    """(class, phase) of an execution; ``valid_locally``: the audit found a strategy running
    these input layouts with no communication."""
    failed = execution.failed
    if failed == "inputs":
        return "not-expressible", ""
    if failed == "too-slow":
        return "too-slow", ""
    if failed == "not-simulated":
        return "not-simulated", ""
    if failed == "died":      # the process running it died (a native crash), found when the run resumed
        return "raises", ""
    if failed == "forward-raises":
        return "raises", "forward"
    if failed == "forward-wrong":
        return "silent-wrong", "forward"
    if failed == "forward-late":
        return "late-failure", "forward"
    if failed in ("backward-raises", "backward-late"):
        return "late-failure", "backward"
    if failed == "backward-wrong":
        return "silent-wrong", "backward"
    if execution.moved_data and valid_locally:
        return "missed-optimisation", ""
    return "agrees", ""


def runtime_against_rule(execution: Execution, klass: str) -> str:
    """Says where the fault lies when the rule and the runtime part ways."""
    rule = execution.rule
    if rule is None or klass != "silent-wrong" or execution.failed == "backward-wrong":
        return ""   # a wrong gradient is the backward's ops' doing, not the forward rule's (attribute.py)
    if rule.local is False and rule.redistributed is False:
        return "the rule asks for a redistribution the runtime never applies: the rule is right, the runtime wrong"
    if rule.local:
        return "the rule runs these placements locally: the rule is wrong"
    return ""
