"""The Markdown table of the propagation comparison (`audit --dtensor`): per op and mesh the
combinations compared, agreed on and disagreed on, then examples of each disagreement."""

from __future__ import annotations

from collections import Counter, defaultdict

from shardverify.features.audit.report import by_mesh, by_op, mesh_text
from shardverify.features.dtensor.propagation import STRIDED

__all__ = ["dtensor_markdown"]

AGREE = ("agree: same output", "agree: equivalent output", "agree: invalid")
SIDES = {"dtensor-missing": "DTensor redistributes a valid combination",
         "dtensor-wrong": "DTensor's output placement is wrong",
         "dtensor-wrong-invalid": "DTensor runs a combination that is invalid without communication, "
                                  "claiming an output placement the local outputs do not form",
         "dtensor-error": "DTensor raises on a valid combination",
         "shardverify-wrong": "the audit called a valid combination invalid",
         "dtensor-strided": "DTensor gives a _StridedShard output for a combination with a block output"}


def _dtensor_row(op: str, mesh: tuple[int, ...], reports) -> str:
    counts: Counter = Counter()
    for r in reports:
        counts.update(r.counts)
    kinds = Counter(d.kind for r in reports for d in r.disagreements)
    disagree = sum(kinds.values())
    agree = sum(counts[k] for k in AGREE)
    invalid = counts["agree: invalid"]
    refused = counts["DTensor error"] - kinds["dtensor-error"]
    strided = counts[STRIDED]
    compared = agree + disagree + refused + strided - kinds["dtensor-strided"]
    notes = "; ".join(dict.fromkeys(r.note.splitlines()[0][:100] for r in reports if r.note))
    return (f"| {op} | {mesh_text([mesh])} | {compared} | {agree - invalid} | {invalid} | {disagree} | "
            f"{refused} | {strided} | {counts['not expressible in DTensor']} | {notes} |")


def dtensor_markdown(reports, show: int = 3) -> str:
    """Markdown for ``--dtensor``: per op and mesh the combinations compared, agreed on and
    disagreed on (and those DTensor cannot express), then per op with disagreements a few
    examples of each kind with who the numerical check says is right."""
    out = ["| op | mesh | compared | agree: same output | agree: both invalid | disagree | "
           "DTensor refuses an invalid one | DTensor output strided | input not expressible | note |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    sections = []
    for op, rs in by_op(reports).items():
        out += [_dtensor_row(op, mesh, on_mesh) for mesh, on_mesh in by_mesh(rs)]
        kinds: dict[str, list] = defaultdict(list)
        for r in rs:
            for d in r.disagreements:
                on_invalid = d.kind == "dtensor-wrong" and d.shardverify.startswith("invalid")
                kinds["dtensor-wrong-invalid" if on_invalid else d.kind].append((r, d))
        if not kinds:
            continue
        sections += ["", f"### {op} (DTensor)", ""]
        for kind, found in kinds.items():
            right = Counter(d.right for _, d in found)
            verdict = ", ".join(f"{who} right in {n}" for who, n in right.most_common())
            sections.append(f"- {len(found)} x {SIDES.get(kind, kind)} ({verdict}), e.g.")
            for r, d in found[:show]:
                sections.append(f"  - {r.case} on {mesh_text([r.mesh])}: `{d.line}`: shardverify `{d.shardverify}`, "
                                f"DTensor `{d.dtensor}`")
    return "\n".join(out + sections) + "\n"
