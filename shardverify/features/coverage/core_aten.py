"""The Core ATen catalogue: every overload the pinned torch tags ``torch.Tag.core`` (the op set
``torch.export`` decomposes models into), each with the op spec that serves it, the reason from
``specs/coverage/core_aten.yaml`` why no layout of it can be verified, or "no spec yet".

Nothing is left out silently: every core overload lands in exactly one of the three, and the
reasons file may name only core overloads that no spec serves (a stale entry is an error)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardverify.spec.fields import Fields
from shardverify.spec.loader import Node, load_yaml

__all__ = ["Overload", "Packet", "Catalogue", "core_overloads", "load_reasons", "catalogue",
           "REASONS_FILE"]

#: the reasons file, relative to the specs folder
REASONS_FILE = Path("coverage") / "core_aten.yaml"

SERVED, REASON, NO_SPEC = "served", "reason", "no spec yet"


@dataclass(frozen=True)
class Overload:
    """One core overload (``aten.abs.default``) and how it is accounted for."""

    name: str
    status: str                  # SERVED | REASON | NO_SPEC
    specs: tuple[str, ...] = ()  # the spec files serving it (SERVED)
    reason: str = ""             # why no layout can be verified (REASON)


@dataclass(frozen=True)
class Packet:
    """An op packet (``aten.abs``) and its core overloads."""

    name: str
    overloads: tuple[Overload, ...]

    @property
    def status(self) -> str:
        """SERVED when every overload is; NO_SPEC when any lacks both a spec and a reason;
        REASON otherwise (all stated, at least one by reason)."""
        states = {overload.status for overload in self.overloads}
        if NO_SPEC in states:
            return NO_SPEC
        return SERVED if states == {SERVED} else REASON


@dataclass(frozen=True)
class Catalogue:
    torch_version: str
    packets: tuple[Packet, ...]

    def count(self, status: str, *, packets: bool = True) -> int:
        items = self.packets if packets else [o for p in self.packets for o in p.overloads]
        return sum(1 for item in items if item.status == status)

    @property
    def partly_served(self) -> int:
        """Packets with some overloads served and others with no spec yet (counted as NO_SPEC)."""
        return sum(1 for p in self.packets if p.status == NO_SPEC and any(o.status == SERVED for o in p.overloads))

    def as_json(self) -> dict:
        return {"torch": self.torch_version,
                "totals": {kind: {"packets": len(self.packets) if kind == "all" else self.count(kind),
                                  "overloads": (sum(len(p.overloads) for p in self.packets) if kind == "all"
                                                else self.count(kind, packets=False))}
                           for kind in ("all", SERVED, REASON, NO_SPEC)},
                "partly_served_packets": self.partly_served,
                "packets": [{"packet": p.name, "status": p.status,
                             "overloads": [{"overload": o.name, "status": o.status, "specs": list(o.specs),
                                            "reason": o.reason or None} for o in p.overloads]}
                            for p in self.packets]}


def core_overloads() -> dict[str, tuple[str, ...]]:
    """{packet: overload names} of every ATen overload tagged core, sorted. The packets come from
    the dispatcher's full list: ``dir(torch.ops.aten)`` names only the packets loaded so far."""
    packets = sorted({name.split("::", 1)[1].split(".", 1)[0]
                      for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::")})
    found: dict[str, list[str]] = {}
    for name in packets:
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):   # a name the dispatcher lists but Python cannot load
            continue
        for overload in packet.overloads():
            if torch.Tag.core in getattr(packet, overload).tags:
                found.setdefault(f"aten.{name}", []).append(f"aten.{name}.{overload}")
    return {packet: tuple(sorted(names)) for packet, names in sorted(found.items())}


def load_reasons(path: Path, core: dict[str, tuple[str, ...]], served: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{overload: reason} from the reasons file; errors name its file, line and field: an
    overload that is not core in this torch, one a spec serves, one listed twice, an empty reason."""
    fields = Fields(load_yaml(path))
    fields.optional("torch", str)
    entries = fields.required("unverifiable", list)
    fields.finish()
    known = {name for names in core.values() for name in names}
    reasons: dict[str, str] = {}
    for entry in entries.value:
        item = Fields(entry)
        reason = item.required("reason", str)
        overloads = item.required("overloads", list)
        item.finish()
        text = " ".join(str(reason.value).split())
        if not text:
            raise reason.error("an unverifiable overload needs a reason")
        for node in overloads.value:
            reasons[_checked(node, known, served, reasons)] = text
    return reasons


def _checked(node: Node, known: set[str], served: dict[str, tuple[str, ...]], reasons: dict[str, str]) -> str:
    name = node.value
    if not isinstance(name, str) or name not in known:
        raise node.error(f"{name!r} is not a Core ATen overload of torch {torch.__version__} "
                         "(write it as aten.<op>.<overload>)")
    if name in served:
        raise node.error(f"{name} is served by {', '.join(served[name])}; drop it from the reasons")
    if name in reasons:
        raise node.error(f"{name} is listed twice")
    return name


def served_overloads(specs: list[tuple[str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
    """{aten overload: spec files} from (spec file, target names) pairs."""
    served: dict[str, list[str]] = {}
    prefix = "torch.ops."
    for source, targets in specs:
        for target in targets:
            if target.startswith(prefix + "aten."):
                served.setdefault(target[len(prefix):], []).append(source)
    return {name: tuple(files) for name, files in served.items()}


def catalogue(specs: list[tuple[str, tuple[str, ...]]], reasons_path: Path) -> Catalogue:
    """Every core overload with its spec (``specs``: spec file, target names), its reason from
    ``reasons_path``, or NO_SPEC."""
    core = core_overloads()
    served = served_overloads(specs)
    reasons = load_reasons(reasons_path, core, served)
    packets = []
    for packet, names in core.items():
        packets.append(Packet(packet, tuple(
            Overload(name, SERVED, specs=served[name]) if name in served
            else Overload(name, REASON, reason=reasons[name]) if name in reasons
            else Overload(name, NO_SPEC) for name in names)))
    return Catalogue(torch.__version__, tuple(packets))
