"""The DTensor execution report: the terminal summary and the Markdown page (docs/dtensor.md)
that ``shardverify dtensor --write`` regenerates."""

from __future__ import annotations

from collections import Counter, defaultdict

from shardverify.features.dtensor.accepted import Accepted
from shardverify.features.dtensor.rootcause import (FEW_ULPS, class_summaries, culprit_of, fine_key, is_corruption,
                                           rule_function, severity_of)
from shardverify.features.dtensor.verdicts import CLASSES

__all__ = ["GATED", "new_classes", "new_class_name", "silent_restated", "root_cause_sections", "summary", "case_table", "case_notes", "class_lines", "example", "markdown",
           "gloo_lines", "gloo_text"]

ORDER = tuple(CLASSES)


def _mesh(mesh) -> str:
    return "(" + ", ".join(map(str, mesh)) + (",)" if len(mesh) == 1 else ")")


#: the classes the accepted file gates: DTensor returned a result that is wrong (silently) or
#: that fails later, far from the op (its output's full_tensor(), the backward, a gradient)
GATED = ("silent-wrong", "late-failure")


def new_classes(results, accepted: Accepted | None) -> list:
    """The silent-corruption and late-failure findings whose class ``accepted`` does not list,
    or lists with another culprit or severity (one per class; rounding within a few ulps of a
    low-precision output is no corruption, :mod:`shardverify.features.dtensor.rootcause`)."""
    seen, found = set(), []
    for r in results:
        for f in r.findings:
            if not is_corruption(f):
                continue
            listed = accepted is not None and accepted.reason(f.key()) is not None
            name = fine_key(f) if listed else f.key()     # an unlisted key is one new class, whatever its culprits
            if name not in seen and (accepted is None or not accepted.accepts(f.key(), culprit_of(f), severity_of(f))):
                seen.add(name)
                found.append(f)
    return found


def new_class_name(f, accepted: Accepted | None) -> str:
    """A new class as the report names it: its key, with its culprit and severity when the key
    itself is accepted (a second fault under a known key)."""
    return fine_key(f) if accepted is not None and accepted.reason(f.key()) else f.key()


def _by_key(results, klass: str) -> dict[str, list]:
    """Findings of ``klass`` by class key; silent ones within rounding are under "rounding"."""
    by_key: dict[str, list] = defaultdict(list)
    for r in results:
        for f in r.findings:
            rounding = f.klass == "silent-wrong" and severity_of(f) == "rounding"
            if (f.klass == klass and not rounding) or (klass == "rounding" and rounding):
                by_key[f.key()].append(f)
    return by_key


def summary(results, accepted: Accepted | None, show: int = 5, confirmations: dict | None = None) -> str:
    """The terminal summary; ``confirmations``: class key -> its run on real gloo processes
    (:mod:`shardverify.features.dtensor.confirm`), shown beside each class and counted at the end."""
    return "\n".join(case_table(results) + case_notes(results) + class_lines(results, accepted, show, confirmations))


def case_table(results) -> list[str]:
    """One line per case and mesh: combinations, how many ran, and the count of each class."""
    lines = []
    header = ("op", "case", "mesh", "combos", "run", *ORDER, "time")
    rows = [(r.op, r.case, "x".join(map(str, r.mesh)), str(r.combinations), str(r.executed),
             *(str(r.counts.get(k, 0)) for k in ORDER), f"{r.seconds:.1f}s") for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return lines


def case_notes(results) -> list[str]:
    """What each case left out, and why (one line per case that has a note)."""
    return [f"{r.op} {r.case} on {_mesh(r.mesh)}: note: {r.note}" for r in results if r.note]


def class_lines(results, accepted: Accepted | None, show: int = 5, confirmations: dict | None = None,
                blank: bool = True) -> list[str]:
    """Each silent-corruption and late-failure class, those not in the accepted file first, at most
    ``show`` of each kind; ``blank``: a blank line before the first title too."""
    lines: list[str] = []
    fresh_keys = {f.key() for f in new_classes(results, accepted)}
    for klass, title in (("silent-wrong", "DTensor computes wrong values silently"),
                         ("late-failure", "DTensor returns, then fails later"),
                         ("rounding", "Within rounding of a low-precision output (no corruption)")):
        by_key = _by_key(results, klass)
        if not by_key:
            continue
        fresh = sum(key in fresh_keys for key in by_key)
        lines.append(("\n" if blank or lines else "") + f"{title}: {sum(map(len, by_key.values()))} combination(s) "
                     f"in {len(by_key)} class(es), {fresh} not in the accepted file")
        ordered = sorted(by_key.items(), key=lambda item: item[0] not in fresh_keys)
        for key, found in ordered[:show]:
            lines.append(f"  [{_status(key, fresh_keys, confirmations)}] {key}: {len(found)} combination(s); "
                         f"e.g. {example(found[0])}")
        if len(ordered) > show:
            lines.append(f"  ... {len(ordered) - show} more class(es) (--show N, --json or --write)")
    if confirmations is not None:
        lines += gloo_lines(results, confirmations)
    return lines


def example(f) -> str:
    """A finding as the summary quotes its class's example: case, mesh, layouts, what went wrong,
    and who is at fault."""
    return (f"{f.case} on {_mesh(f.mesh)}: {f.line}: {f.detail}"
            + (f"; at fault: {f.culprit}" if f.culprit else f"; {f.rule}" if f.rule else "")
            + (f"; {f.runtime}" if f.runtime else ""))


def _status(key: str, fresh_keys: set, confirmations: dict | None) -> str:
    status = "NEW" if key in fresh_keys else "accepted"
    if confirmations and key in confirmations:
        status += f", gloo: {confirmations[key].status}"
    return status


def gloo_lines(results, confirmations: dict, page: bool = False) -> list[str]:
    """Per gated class kind: how many classes their repro confirmed on real gloo processes, and
    every class not confirmed by name (one not reproduced first: its finding is suspect); for
    the terminal, or (``page``) Markdown list items."""
    lines = []
    rank = {status: i for i, status in enumerate(("not reproduced", "differs", "aborted", "timeout", "error"))}
    for klass in GATED:
        keys = sorted(_by_key(results, klass))
        if not keys:
            continue
        counts = Counter(confirmations[k].status if k in confirmations else "not run" for k in keys)
        told = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=_status_order))
        lines.append(f"- {len(keys)} `{klass}` class(es): {told}" if page else
                     f"\nOn real gloo processes (torchrun), {len(keys)} {klass} class(es): {told}")
        shown = sorted((k for k in keys if k in confirmations and confirmations[k].status != "confirmed"),
                       key=lambda k: (rank.get(confirmations[k].status, 9), k))
        for key in shown:
            c = confirmations[key]
            word = c.status.upper() if c.status == "not reproduced" else c.status
            suspect = "; the in-process finding is suspect" if c.status == "not reproduced" else ""
            lines.append(f"  - **{word}** `{key}`: {c.detail}{suspect}" if page else
                         f"  [{word}] {key}: {c.detail}{suspect}")
    return lines


def _status_order(item) -> tuple:
    order = ("confirmed", "not reproduced", "differs", "aborted", "timeout", "error", "not run")
    return (order.index(item[0]) if item[0] in order else len(order), item[0])


def gloo_text(c) -> str:
    """One class's confirmation in a sentence of the page."""
    where = f"on {c.world} real gloo process{'es' if c.world > 1 else ''} (torchrun, {c.seconds:.0f} s)"
    if c.status == "confirmed":
        return f"**confirmed** {where}: {c.detail}"
    if c.status == "not reproduced":
        return f"**NOT REPRODUCED** {where}: {c.detail}; the in-process finding is suspect"
    return f"**{c.status}** {where}: {c.detail}"


INTRO = """# DTensor executed: what torch.distributed.tensor computes, per op and layout

Generated by `{command}` (torch {torch}); do not edit by hand.

For every case of every op spec, on each mesh, shardverify takes the audit's input layout
combinations (every layout of every operand, each mirror under a swap of mesh axes run too, as
DTensor is not symmetric under one: uneven blocks,
both shard orders as `_StridedShard`, partial-sum inputs made of real per-rank contributions;
not the audit's partial max/min inputs, for which DTensor's `Partial("max")` defines no backward)
and **executes** DTensor on them: each input a DTensor built from the audit's per-rank blocks
(its `full_tensor()` must give back the value, else the layout is *not expressible*), the
op run under DTensor's `LocalTensorMode` on a fake process group (every rank's values at once),
every rank's `full_tensor()` of the output compared with the float64 single-device reference,
then the backward of `sum(output * g)` and every rank's input gradients likewise. Collectives
are counted with `CommDebugMode`. Beside the execution, DTensor's *rule* for the call's aten op
is asked what it decides (run locally, or redistribute the inputs first), and the runtime is
watched for whether it redistributed: "the rule is right, the runtime wrong" is said as such.
A silent finding's combination is then run again with every aten op DTensor runs, forward and
backward, held to the op on its inputs' full values: the first wrong one is named *at fault*
with its placements and who is to blame (the forward rule, a backward rule such as
`select_backward`'s, or the runtime). A backward that raises names the autograd node it raised
in: a missing backward rule (DTensor registers no strategy for its aten op), or a *runtime
function* such as `SelectScatterBackward0` handing DTensor a plain tensor it made itself (no
rule at fault). Silent and late-failure classes not listed in
`specs/dtensor/accepted.yaml` fail the command; `docs/upstream/` holds one page per DTensor bug,
re-run by `shardverify dtensor --upstream`.
`--repros DIR` writes a script per silent-corruption or late-failure class that needs torch alone: `python
script.py` runs it as here, `torchrun --nproc-per-node N script.py` on N real gloo processes
(it checks every output the class's finding checked and takes the same loss's gradient: which
outputs get one picks autograd's backward, native_group_norm's mean and rstd a composite one);
`--confirm` runs each class's script under torchrun, one gloo process per rank, and says per
class whether it reproduced there (*confirmed*; *not reproduced*, which makes the in-process
finding suspect; *differs*, *aborted* by a signal, or *timeout*).

Classes, most important first:
{classes}

A case with more combinations than the limit executes an evenly spaced sample; the table says
how many ran. A run over every spec takes hours: `--results DIR` stores each case's result (one
file per spec content hash, mesh, torch version and limit) and continues an interrupted run at
its next combination; `--from-json DIR` rebuilds this page from what is stored. Every
combination of every op on three meshes is millions of DTensor executions (days on one core):
with `--limit 0`, a case whose full run is not stored is read from the largest evenly spaced
sample stored for it (`--limit N`), and the coverage note and the case's note say so.
`raises` on an uneven layout can be `LocalTensorMode`'s own limit (its tensors
carry per-rank sizes) rather than DTensor's; the detail names the error.
"""


def markdown(results, accepted: Accepted | None, command: str, torch_version: str, show: int = 3,
             note: str = "", confirmations: dict | None = None) -> str:
    """The page; ``note``: what the run covers, when it is not every spec (a saved run's "note");
    ``confirmations``: class key -> its repro's run on real gloo processes (``--confirm``)."""
    classes = "\n".join(f"* `{k}`: {v}" for k, v in CLASSES.items())
    out = [INTRO.format(command=command, torch=torch_version, classes=classes)]
    if note:
        out.append(f"**Coverage.** {note}\n")
    totals: Counter = Counter()
    for r in results:
        totals.update(r.counts)
    executed = sum(r.executed for r in results)
    out.append(f"## Totals\n\n{executed} combinations executed over {len(results)} (op, case, mesh) runs: "
               + ", ".join(f"{totals.get(k, 0)} {k}" for k in ORDER) + ".\n")
    out.append(silent_restated(results) + "\n")
    by_op: dict[str, dict[tuple, Counter]] = defaultdict(lambda: defaultdict(Counter))
    runs: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    notes: dict[tuple, list[str]] = defaultdict(list)
    for r in results:
        by_op[r.op][r.mesh].update(r.counts)
        runs[(r.op, r.mesh)][0] += r.combinations
        runs[(r.op, r.mesh)][1] += r.executed
        shown = [part for part in r.note.split("; ")
                 if part.startswith(("error", "in progress", "no tensor operand", "DTensor took over"))]
        if shown:
            notes[(r.op, r.mesh)].append(f"{r.case}: {'; '.join(shown)[:160]}")
    if confirmations is not None:
        out.append("## On real gloo processes\n\nEach class's repro (the script `--repros` writes) run under "
                   "`torchrun --standalone --nproc-per-node N` (N the mesh's size, gloo on CPU), every process's "
                   "verdict read (`--confirm`; stored beside the results, run again only when the class's "
                   "example changes):\n")
        out += gloo_lines(results, confirmations, page=True) + [""]
    out.append("## Per op and mesh\n")
    out.append("| op | mesh | combinations | executed | " + " | ".join(ORDER) + " | note |")
    out.append("| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in ORDER) + " | --- |")
    for op in sorted(by_op):
        for mesh, counts in by_op[op].items():
            combos, ran = runs[(op, mesh)]
            out.append(f"| {op} | {_mesh(mesh)} | {combos} | {ran} | "
                       + " | ".join(str(counts.get(k, 0)) for k in ORDER)
                       + f" | {'; '.join(notes[(op, mesh)])} |")
    out.append("")
    out += root_cause_sections(results, accepted, confirmations)
    for klass in ("raises", "missed-optimisation", "not-expressible", "not-simulated"):
        found = [f for r in results for f in r.findings if f.klass == klass]
        if not found:
            continue
        out.append(f"## {CLASSES[klass]} (`{klass}`): examples\n")
        per_op: dict[str, list] = defaultdict(list)
        for f in found:
            per_op[f.op].append(f)
        for op, items in sorted(per_op.items()):
            reasons = Counter(_why(f) for f in items)
            out.append(f"- {op}: {len(items)} ({', '.join(f'{n} {why}' for why, n in reasons.most_common(3))})")
            for f in items[:show]:
                extra = f"; {f.comms}" if f.comms else ""
                out.append(f"  - {f.case} on {_mesh(f.mesh)}: `{f.line}`: {f.detail or 'right values'}{extra}")
        out.append("")
    return "\n".join(out)


def _why(finding) -> str:
    """What a finding's example list is grouped by: the error's type, or for a missed
    optimisation whether the forward ran a collective or only changed placements locally."""
    if finding.klass == "missed-optimisation":
        return "with a forward collective" if "forward " in finding.comms else "placement change only"
    return finding.detail.split(":")[0]


def silent_restated(results) -> str:
    """The silent total restated: corruption apart from rounding within a few ulps of a
    low-precision output (rootcause.FEW_ULPS)."""
    silent, rounding = _by_key(results, "silent-wrong"), _by_key(results, "rounding")
    late = _by_key(results, "late-failure")
    return (f"Silent corruption: {sum(map(len, silent.values()))} combinations in {len(silent)} classes "
            f"(wrong shape or wrong values); within {FEW_ULPS:g} ulps of a low-precision output's dtype, rounding "
            f"and not counted as corruption: {sum(map(len, rounding.values()))} combinations in {len(rounding)} "
            f"classes; late failures: {sum(map(len, late.values()))} combinations in {len(late)} classes.")


def root_cause_sections(results, accepted: Accepted | None, confirmations: dict | None = None) -> list[str]:
    """The silent, rounding and late classes grouped by root cause (the accepted file's entries):
    a table with each root cause's culprits, classes and combinations by severity, then each root
    cause's reason and classes; the classes no entry lists last."""
    classes = class_summaries(results)
    causes = list(accepted.causes) if accepted is not None else []
    grouped: dict[str, list] = defaultdict(list)
    for key in sorted(classes):
        cause = accepted.cause(key) if accepted is not None else None
        grouped[(cause.slug or cause.reason[:60]) if cause is not None else ""].append(classes[key])
    out = ["## Root causes\n",
           "Each class below is grouped under the root cause whose entry in `specs/dtensor/accepted.yaml` lists it; "
           "the culprit is what the harness found at fault (the first wrong aten op, forward or backward, its rule "
           "or the runtime), the DTensor function the one that op dispatches to on this torch. Severity per "
           "combination: wrong shape, wrong values, rounding (within a few ulps of a low-precision output: no "
           "corruption), fails later.\n",
           "| root cause | culprit | DTensor function | classes | combinations | wrong shape | wrong values | "
           "rounding | fails later | page |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    named = [(c.slug or c.reason[:60], c) for c in causes] + ([("", None)] if grouped.get("") else [])
    functions: dict[str, str] = {}
    for name, cause in named:
        found = grouped.get(name, [])
        if not found and cause is not None and not cause.repros:
            continue
        severities: Counter = Counter(severity_of(f) for c in found for f in c.findings)
        culprits = sorted({c.culprit for c in found})
        for culprit in culprits:
            functions.setdefault(culprit, rule_function(culprit))
        shown = "; ".join(culprits[:3]) + (f"; {len(culprits) - 3} more" if len(culprits) > 3 else "")
        made = "; ".join(sorted({functions[c] for c in culprits if functions[c]}))
        page = f"[{cause.page}]({cause.page.removeprefix('docs/')})" if cause is not None and cause.page else ""
        out.append(f"| {name or '**not in the accepted file**'} | {shown} | {made} | {len(found)} | "
                   f"{sum(c.combinations for c in found)} | "
                   + " | ".join(str(severities.get(k, 0)) for k in ("wrong shape", "wrong values", "rounding",
                                                                     "fails later"))
                   + f" | {page} |")
    out.append("")
    for name, cause in named:
        found = grouped.get(name, [])
        if not found and cause is not None and not cause.repros:
            continue
        out.append(f"### {name or 'Not in the accepted file'}\n")
        if cause is not None:
            out.append(f"{len(found)} class(es); accepted: {cause.reason}\n")
            if cause.repros:
                out.append("Repro" + ("s" if len(cause.repros) > 1 else "") + " (exit 1 while it reproduces; "
                           "`--gate` runs them): " + ", ".join(f"`{r}`" for r in cause.repros) + "\n")
        for c in found:
            out += _class_item(c, confirmations)
        out.append("")
    return out


def _class_item(c, confirmations: dict | None) -> list[str]:
    f = next((g for g in c.findings if g.culprit), c.findings[0])
    meshes = ", ".join(_mesh(m) for m in c.meshes)
    lines = [f"- `{c.key}`: {c.combinations} combination(s) on {meshes}; {', '.join(c.severities)}; "
             f"culprit: {c.culprit}",
             f"  - e.g. {f.case} on {_mesh(f.mesh)}: `{f.line}`: {f.detail}"]
    if f.rule:
        lines.append(f"  - the call's rule: {f.rule}")
    if f.culprit:
        lines.append(f"  - at fault: {f.culprit}")
    if f.runtime:
        lines.append(f"  - {f.runtime}")
    lines.append(f"  - a local strategy (audit): {f.local_strategy}")
    if confirmations is not None and c.key in confirmations:
        lines.append(f"  - {gloo_text(confirmations[c.key])}")
    elif confirmations is not None and f.klass == "silent-wrong":    # a late failure's is counted above
        lines.append("  - not run on real gloo processes (`--confirm`)")
    return lines
