"""The per-op audit report for the docs: per op and mesh, what is offered, what is valid,
what is missing, and which accepted gaps (with their reasons) explain the difference."""

from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ["markdown_report"]


def markdown_report(rows) -> str:
    """Markdown: one section per op, one table row per mesh (summed over the op's cases)."""
    by_op: dict[str, list] = defaultdict(list)
    for row in rows:
        by_op[row.op].append(row)
    out = []
    for op, op_rows in by_op.items():
        out += [f"### {op}", "",
                "| mesh | cases | offered | valid | covered | missing | accepted | incorrect |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        meshes = list(dict.fromkeys(row.mesh for row in op_rows))
        for mesh in meshes:
            rs = [row for row in op_rows if row.mesh == mesh]
            out.append(f"| {'x'.join(map(str, mesh))} | {len(rs)} | {sum(r.offered for r in rs)} | "
                       f"{sum(r.valid for r in rs)} | {sum(r.covered for r in rs)} | "
                       f"{sum(len(r.missing) for r in rs)} | {sum(len(r.accepted) for r in rs)} | "
                       f"{sum(len(r.incorrect) for r in rs)} |")
        reasons = Counter(f.accepted for row in op_rows for f in row.accepted)
        errors = [f"{row.case} on {list(row.mesh)}: {row.error}" for row in op_rows if row.error]
        if reasons:
            out += ["", "Accepted gaps (combinations over all cases and meshes above):", ""]
            out += [f"- {n} x {' '.join(reason.split())}" for reason, n in reasons.most_common()]
        missing = Counter(f.line for row in op_rows for f in row.missing)
        if missing:
            out += ["", "Missing (not accepted):", ""]
            out += [f"- `{line}`" + (f" ({n} cases)" if n > 1 else "") for line, n in missing.most_common(12)]
            if len(missing) > 12:
                out.append(f"- ... {len(missing) - 12} more")
        if errors:
            out += ["", "Errors:", ""] + [f"- {e}" for e in errors]
        out.append("")
    return "\n".join(out)
