"""The per-op audit report for the docs: one summary row per op and mesh (what is offered,
valid, covered, missing, accepted), the accepted gaps with their reasons (a family's once, a spec's
under its op), and the missing combinations and errors of each op that has any."""

from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ["markdown_report", "mesh_text", "by_op", "by_mesh"]

FAMILY = "the '"   # accept reasons of family gaps start "the 'rules' generator family: ..."


def mesh_text(meshes) -> str:
    return " ".join("x".join(map(str, mesh)) for mesh in meshes)


def _summary_row(op: str, mesh: tuple[int, ...], rows) -> str:
    accepted = [f.accepted for r in rows for f in r.accepted]
    family = sum(1 for reason in accepted if reason.startswith(FAMILY))
    return (f"| {op} | {mesh_text([mesh])} | {len({r.case for r in rows})} | {sum(r.offered for r in rows)} | "
            f"{sum(r.valid for r in rows)} | {sum(r.covered for r in rows)} | {sum(r.masked for r in rows)} | "
            f"{sum(len(r.missing) for r in rows)} | {family} | {len(accepted) - family} | "
            f"{sum(len(r.incorrect) for r in rows)} |")


def by_op(items) -> dict[str, list]:
    """Audit rows or DTensor reports by op, in the order the ops first appear."""
    found: dict[str, list] = defaultdict(list)
    for item in items:
        found[item.op].append(item)
    return found


def by_mesh(items) -> list[tuple[tuple[int, ...], list]]:
    """(mesh, the items on it), in the order the meshes first appear."""
    return [(mesh, [i for i in items if i.mesh == mesh]) for mesh in dict.fromkeys(i.mesh for i in items)]


def markdown_report(rows) -> str:
    """Markdown: a table with one row per op and mesh (summed over the op's cases), then the
    accepted gaps and what is missing."""
    out = ["| op | mesh | cases | offered | valid | covered | masked ids | missing | accepted (family) | "
           "accepted (spec) | incorrect |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    family_reasons: Counter = Counter()
    sections = []
    for op, rs in by_op(rows).items():
        accepted = [f.accepted for r in rs for f in r.accepted]
        family_reasons.update(reason for reason in accepted if reason.startswith(FAMILY))
        out += [_summary_row(op, mesh, on_mesh) for mesh, on_mesh in by_mesh(rs)]
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
