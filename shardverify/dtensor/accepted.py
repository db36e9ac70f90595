"""The accepted file: DTensor's known silent-corruption classes, each with its reason.

``shardverify dtensor`` exits 1 when it finds a silent-corruption class this file does not list,
so CI can gate on DTensor's behaviour changing (a new torch, a new rule of the user's own)::

    torch: 2.13.0            # the version the classes were found on (informative)
    accepted:
      - reason: aten.convolution's runtime handler never applies the redistribution its rule asks for
        keys:
          - conv2d forward input=R weight=S(0)
          - ...

A key is a finding's class (:func:`shardverify.dtensor.verdicts.class_key`): the op, the phase and
each operand's placements, the same on every mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardverify.spec.fields import Fields
from shardverify.spec.loader import load_yaml

__all__ = ["Accepted", "load_accepted", "render_accepted"]


@dataclass(frozen=True)
class Accepted:
    reasons: dict[str, str]      # class key -> reason
    torch: str = ""

    def reason(self, key: str) -> str | None:
        return self.reasons.get(key)


def load_accepted(path: Path) -> Accepted:
    """Read and validate ``path`` (errors name its file, line and field)."""
    root = load_yaml(path)
    fields = Fields(root)
    version = fields.optional("torch", str)
    entries = fields.required("accepted", list)
    fields.finish()
    reasons: dict[str, str] = {}
    for entry in entries.value:
        item = Fields(entry)
        reason = item.required("reason", str)
        keys = item.required("keys", list)
        item.finish()
        if not str(reason.value).strip():
            raise reason.error("an accepted class needs a reason")
        for key in keys.value:
            if not isinstance(key.value, str) or len(key.value.split(" ")) < 3:
                raise key.error(f"expected a class key such as 'conv2d forward input=R weight=S(0)', got {key.value!r}")
            if key.value in reasons:
                raise key.error(f"class {key.value!r} is listed twice")
            reasons[key.value] = str(reason.value).strip()
    return Accepted(reasons, str(version.value) if version is not None else "")


def render_accepted(keys_by_reason: dict[str, list[str]], torch_version: str) -> str:
    """The file listing ``keys_by_reason`` (what ``--write-accepted`` writes)."""
    lines = ["# DTensor's silent-corruption classes `shardverify dtensor` accepts (each with its reason).",
             "# A class found that is not listed here makes the command exit 1.",
             f"torch: {torch_version}", "accepted:"]
    for reason, keys in keys_by_reason.items():
        lines.append(f"  - reason: {_quoted(reason)}")
        lines.append("    keys:")
        lines += [f"      - {_quoted(key)}" for key in sorted(set(keys))]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
