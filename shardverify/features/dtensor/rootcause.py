"""Root causes: the classes of a DTensor run grouped by the culprit the harness names, and each
finding's severity.

A class key (:func:`shardverify.features.dtensor.verdicts.class_key`) says which op and which operand
placements went wrong; many keys share one fault (161 conv classes are one runtime handler). The
*culprit* of a finding is what the harness found at fault, reduced to what stays the same across
the layouts one bug reaches: the first wrong aten op, forward or backward, and whether its rule or
the runtime is to blame (``runtime of aten.convolution.default (forward)``, ``forward rule of
aten.cumsum.default (forward)``, ``backward rule of aten.avg_pool2d_backward.default (backward)``,
``a plain tensor handed to aten.select_scatter.default (backward)``). It is read from the
finding's attribution when it has one, else from the call's rule, the runtime's verdict and the
error (findings stored before attribution was made, and a class's later findings, carry none).

The *severity* of a finding: ``wrong shape``, ``wrong values``, ``rounding`` (a low-precision
output within a few units in the last place of its dtype of the reference, :data:`FEW_ULPS`: a
cast of a partial sum rounds each rank's piece, which DTensor keeps by design; not counted as
silent corruption) or ``fails later`` (a late failure).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from shardverify.features.dtensor.accepted import Accepted, RootCause

__all__ = ["SEVERITIES", "FEW_ULPS", "ROUNDING_MARK", "culprit_of", "severity_of", "is_corruption",
           "fine_key", "rule_function", "ClassSummary", "class_summaries", "UNEXPLAINED", "found_causes"]

SEVERITIES = ("wrong shape", "wrong values", "rounding", "fails later")

#: a low-precision output this many ulps (of its dtype, at its largest reference value) from the
#: reference is rounding, not corruption: a partial sum cast down rounds each rank's piece
FEW_ULPS = 4.0

#: how execute.py's comparison says a difference is within :data:`FEW_ULPS` (read back here)
ROUNDING_MARK = "ulps of its largest value"

_ATEN = re.compile(r"\b(aten\.[\w.]+)")
_CULPRIT = re.compile(r"^(forward rule|backward rule|runtime) of (\w+\.[\w.]+) \((forward|backward)\)")
_MISSING = re.compile(r"Operator (aten\.[\w.]+) does not have a sharding strategy")
_NUMBERS = re.compile(r"\d+")
_RULE_OP = re.compile(r"^\w+\.[\w.]+:")


def culprit_of(finding) -> str:
    """The finding's culprit in one line (see the module's docstring); "" for classes this
    does not judge (agrees, raises...)."""
    klass, phase = finding.klass, finding.phase or "forward"
    detail, rule, runtime, culprit = finding.detail or "", finding.rule or "", finding.runtime or "", finding.culprit or ""
    if klass not in ("silent-wrong", "late-failure"):
        return ""
    found = _CULPRIT.match(culprit)
    if found:
        return f"{found.group(1)} of {found.group(2)} ({found.group(3)})"
    missing = _MISSING.search(detail) or _MISSING.search(culprit)
    if missing:
        return f"backward rule of {missing.group(1)} (backward)"
    if "got mixed torch.Tensor and DTensor" in detail or "a plain torch.Tensor" in culprit:
        op = _ATEN.search(detail) or _ATEN.search(culprit)
        return f"a plain tensor handed to {op.group(1) if op else 'an aten op'} ({phase})"
    called = rule.split(":")[0] if _RULE_OP.match(rule) else ""
    if called and phase == "forward" and ("runtime never applies" in runtime or "did not redistribute" in rule):
        return f"runtime of {called} ({phase})"
    if klass == "late-failure":
        return f"{phase} raises {_error_words(detail)}"
    if called and phase == "forward":
        return f"forward rule of {called} (forward)"
    return f"{phase} of {finding.op}, not attributed"


def _error_words(detail: str) -> str:
    """The error a late failure raised, without its sizes (the same fault on another shape)."""
    text = detail.split("raises ", 1)[1] if "full_tensor() raises " in detail else detail
    kind, _, message = text.partition(":")
    return f"{kind.strip()}: {_NUMBERS.sub('N', message.strip())[:60]}".rstrip(": ") if message else kind.strip()[:60]


def severity_of(finding) -> str:
    """``wrong shape``, ``wrong values``, ``rounding`` or ``fails later`` (silent and late
    findings), "" for the other classes."""
    if finding.klass == "late-failure":
        return "fails later"
    if finding.klass != "silent-wrong":
        return ""
    detail = finding.detail or ""
    if "holds shape" in detail:
        return "wrong shape"
    if ROUNDING_MARK in detail:
        return "rounding"
    return "wrong values"


def is_corruption(finding) -> bool:
    """A finding the accepted file gates: a silent one beyond rounding, or a late failure."""
    return finding.klass in ("silent-wrong", "late-failure") and severity_of(finding) != "rounding"


def fine_key(finding) -> str:
    """The class key with the culprit and the severity: a second fault under a known key is
    another class."""
    return f"{finding.key()} [{culprit_of(finding)}; {severity_of(finding)}]"


def rule_function(culprit: str) -> str:
    """The DTensor function behind a culprit on the installed torch (its rule, or the runtime
    handler that replaces the generic dispatch), e.g. ``scan_strategy
    (torch.distributed.tensor._ops._math_ops)``; "" when none is registered or torch is older."""
    found = _CULPRIT.match(culprit)
    op_name = found.group(2) if found else ""
    if not op_name:
        return ""
    try:
        import torch
        from torch.distributed.tensor import DTensor

        packet, _, overload = op_name.removeprefix("aten.").rpartition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)
        dispatcher = DTensor._op_dispatcher
        function = (dispatcher._custom_op_handlers.get(op) if found.group(1) == "runtime" else None) \
            or dispatcher.sharding_propagator.op_strategy_funcs.get(op) \
            or dispatcher.sharding_propagator.op_to_rules.get(op)
    except Exception:  # noqa: BLE001 - a private table that moved: the function is not named
        return ""
    if function is None:
        return ""
    return f"{getattr(function, '__name__', type(function).__name__)} ({getattr(function, '__module__', '?')})"


@dataclass(frozen=True)
class ClassSummary:
    """One gated class of a run: its key, culprit, severities and how many combinations."""

    key: str
    culprit: str
    severities: tuple[str, ...]
    combinations: int
    meshes: tuple[tuple[int, ...], ...]
    findings: tuple = ()


def class_summaries(results) -> dict[str, ClassSummary]:
    """Each silent or late class of ``results`` by key: its culprit (the first finding's that
    the harness attributed, else the first finding's as read from its rule and error), its
    severities, its combinations and meshes."""
    by_key: dict[str, list] = defaultdict(list)
    for r in results:
        for f in r.findings:
            if f.klass in ("silent-wrong", "late-failure"):
                by_key[f.key()].append(f)
    out = {}
    for key, found in by_key.items():
        named = next((f for f in found if f.culprit), found[0])
        out[key] = ClassSummary(key, culprit_of(named), tuple(sorted({severity_of(f) for f in found})), len(found),
                                tuple(sorted({tuple(f.mesh) for f in found})), tuple(found))
    return out


#: the reason of a root cause --write-accepted found and the accepted file does not explain
UNEXPLAINED = "to fill in: why DTensor is wrong here, and whether every class below is this one fault"
_NOT_SLUG = re.compile(r"[^a-z0-9]+")


def found_causes(results, accepted: Accepted | None) -> list[RootCause]:
    """The silent-corruption and late-failure classes of ``results`` as root causes: a class its
    accepted entry accepts (its key, culprit and severity listed) under that entry (slug, reason,
    page, repros, culprits and severity as the entry has them), in the file's order; every other
    class under a new cause per culprit, its slug made from the culprit and its reason
    :data:`UNEXPLAINED`. Rounding within a few ulps of a low-precision dtype is left out."""
    summaries = {key: c for key, c in class_summaries(results).items()
                 if any(is_corruption(f) for f in c.findings)}
    causes = list(accepted.causes) if accepted is not None else []
    kept: dict[int, list[str]] = defaultdict(list)
    fresh: dict[str, list[ClassSummary]] = defaultdict(list)
    for key, summary in sorted(summaries.items()):
        index = next((i for i, c in enumerate(causes) if key in c.keys), None)
        if index is not None and all(causes[index].accepts(culprit_of(f), severity_of(f))
                                     for f in summary.findings if is_corruption(f)):
            kept[index].append(key)
        else:
            fresh[summary.culprit].append(summary)
    taken = {c.slug for c in causes if c.slug}
    out = []
    for index, cause in enumerate(causes):
        if kept.get(index):
            # an entry without a slug (a file of the older format) gets one made from its reason
            slug = cause.slug or _new_slug(cause.reason, taken)
            out.append(RootCause(slug, cause.reason, tuple(kept[index]), cause.culprits, cause.severity, cause.repros,
                                 cause.page))
    for culprit, found in sorted(fresh.items()):
        severities = {s for c in found for s in c.severities if s != "rounding"}
        out.append(RootCause(_new_slug(culprit, taken), UNEXPLAINED, tuple(c.key for c in found),
                             (culprit,) if culprit else (), tuple(s for s in SEVERITIES if s in severities)))
    return out


def _new_slug(text: str, taken: set[str]) -> str:
    """A slug made from ``text``'s first words, not one of ``taken`` (which it joins)."""
    base = "-".join(_NOT_SLUG.sub("-", text.lower()).strip("-").split("-")[:8]) or "unattributed"
    slug, n = base, 2
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    taken.add(slug)
    return slug
