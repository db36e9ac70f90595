"""The per-op audit report for the docs: one summary row per op (what is offered, valid,
covered, missing, accepted), the accepted gaps with their reasons (a family's once, a spec's
under its op), and the missing combinations and errors of each op that has any."""

from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ["markdown_report"]

FAMILY = "the '"   # accept reasons of family gaps start "the 'rules' generator family: ..."


def _mesh_text(meshes) -> str:
    return " ".join("x".join(map(str, mesh)) for mesh in meshes)


def markdown_report(rows) -> str:
    """Markdown: a table with one row per op (summed over its cases and meshes), then the
    accepted gaps and what is missing."""
    by_op: dict[str, list] = defaultdict(list)
    for row in rows:
        by_op[row.op].append(row)
    out = ["| op | meshes | cases | offered | valid | covered | missing | accepted (family) | "
           "accepted (spec) | incorrect |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    family_reasons: Counter = Counter()
    sections = []
    for op, rs in by_op.items():
        accepted = [f.accepted for r in rs for f in r.accepted]
        family = [reason for reason in accepted if reason.startswith(FAMILY)]
        family_reasons.update(family)
        meshes = list(dict.fromkeys(r.mesh for r in rs))
        cases = len({r.case for r in rs})
        out.append(f"| {op} | {_mesh_text(meshes)} | {cases} | {sum(r.offered for r in rs)} | "
                   f"{sum(r.valid for r in rs)} | {sum(r.covered for r in rs)} | "
                   f"{sum(len(r.missing) for r in rs)} | {len(family)} | {len(accepted) - len(family)} | "
                   f"{sum(len(r.incorrect) for r in rs)} |")
        section = []
        spec_reasons = Counter(reason for reason in accepted if not reason.startswith(FAMILY))
        if spec_reasons:
            section += ["Accepted by the spec:", ""]
            section += [f"- {n} x {' '.join(reason.split())}" for reason, n in spec_reasons.most_common()]
        for kind in ("incorrect", "missing"):
            found = Counter(f.line for r in rs for f in getattr(r, kind))
            if found:
                section += ["", f"{kind.capitalize()}:", ""] if section else [f"{kind.capitalize()}:", ""]
                section += [f"- `{line}`" + (f" ({n} cases)" if n > 1 else "") for line, n in found.most_common(12)]
                if len(found) > 12:
                    section.append(f"- ... {len(found) - 12} more")
        errors = [f"{r.case} on {list(r.mesh)}: {r.error}" for r in rs if r.error]
        if errors:
            section += ["", "Errors:", ""] + [f"- {e}" for e in errors]
        if section:
            sections += ["", f"### {op}", ""] + section
    if family_reasons:
        out += ["", "Accepted by the generator family (combinations over every op above):", ""]
        out += [f"- {n} x {' '.join(reason.split())}" for reason, n in family_reasons.most_common()]
    return "\n".join(out + sections) + "\n"
