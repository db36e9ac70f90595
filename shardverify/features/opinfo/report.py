"""The OpInfo sweep as a reader wants it: per op, the calls served (by the grid, on demand),
refused (grouped by reason), left to other ops by the capture, and every strategy found wrong."""

from __future__ import annotations

import re
from collections import Counter

import torch

from shardverify.features.opinfo.sweep import OUTCOMES, RANDOM, SweepResult

__all__ = ["reason_class", "user_words", "table", "totals", "markdown", "entry_of"]


def reason_class(reason: str) -> str:
    """A refusal's reason without what varies from call to call (node names, shapes, values)."""
    text = re.sub(r"node '[^']*'", "node", reason)
    text = re.sub(r"\([^()]*\)", "(..)", text)
    text = re.sub(r"\{[^{}]*\}", "{..}", text)
    text = re.sub(r"=\S+", "=..", text)
    text = re.sub(r"-?\d+", "N", text)
    return text[:140]


#: torch's words for a capture it refused, and what they mean to the reader: (pattern, said)
_CAPTURE_WORDS = (
    (r"symbolically traced variables cannot be used as inputs to control flow",
     "torch.fx cannot trace it: the call branches in Python on a tensor's value (torch.export can)"),
    (r"descriptor '\w+' for 'torch._C.TensorBase' objects doesn't apply to a 'Proxy'",
     "torch.fx cannot trace it: a tensor's C method is called on the traced value (torch.export can)"),
    (r"GuardOnDataDependentSymNode|DataDependentOutputException|DynamicOutputShapeException|"
     r"PendingUnbackedSymbolNotFound|data-dependent",
     "torch.export cannot capture it: the shape or value of a result depends on the input's values"),
)


def user_words(outcome: str, reason: str) -> str:
    """A stored reason as the page says it to its reader: a capture torch refused in plain words
    (the raw error stays in the stored result), an op no spec serves named with why none can where
    its output's shape depends on the values (``nonzero``, ``unique``: no layout's blocks can say
    their shapes ahead)."""
    if outcome == "not-captured":
        said = next((words for pattern, words in _CAPTURE_WORDS if re.search(pattern, reason)), None)
        return said or reason
    if outcome != "no-handler" or not reason.startswith("captured as "):
        return reason
    name = reason.removeprefix("captured as ")
    found = re.fullmatch(r"aten\.(\w+)\.(\w+)", name)
    if found is None:   # a torch-level call under fx
        return f"{name}: no spec serves it, and it traces to no ATen ops that are served"
    op = getattr(getattr(torch.ops.aten, found.group(1), None), found.group(2), None)
    if op is not None and torch.Tag.dynamic_output_shape in op.tags:
        return f"{name}: its output's shape depends on the input's values; no spec serves it"
    return f"{name}: no spec serves it, and it decomposes into no op that is served"


def entry_of(outcome) -> str:
    """The OpInfo entry a call's sample came from."""
    return outcome.sample.split("#", 1)[0]


def _row(entry: str, mine: list) -> list[str]:
    counts = Counter(o.outcome for o in mine)
    calls = len(mine) - counts["folded"]
    served = counts["grid"] + counts["on-demand"]
    specs = dict.fromkeys(name for o in mine for name in (o.served_by or (o.op,)))
    return [entry, " ".join(specs), str(calls), f"{served} ({100 * served / calls:.0f}%)" if calls else "0",
            *(str(counts[k]) for k in OUTCOMES), str(sum(o.checked for o in mine)),
            str(sum(len(o.wrong) for o in mine)), str(sum(len(o.wrong_extremum) for o in mine))]


HEADER = ["OpInfo entry", "specs", "calls", "served", *OUTCOMES, "grid strategies checked", "wrong",
          "wrong partial max/min"]


def table(result: SweepResult) -> list[list[str]]:
    """One row per OpInfo entry, each call (sample x capture x mesh) counted once."""
    by_entry: dict[str, list] = {}
    for o in result.outcomes:
        by_entry.setdefault(entry_of(o), []).append(o)
    return [_row(entry, mine) for entry, mine in by_entry.items()]


def _capture_totals(outcomes: list) -> list[str]:
    lines = []
    for capture in sorted({o.capture for o in outcomes}):
        mine = [o for o in outcomes if o.capture == capture and o.outcome != "folded"]
        served = sum(o.outcome in ("grid", "on-demand") for o in mine)
        folded = sum(o.capture == capture and o.outcome == "folded" for o in outcomes)
        share = f"{100 * served / len(mine):.1f}%" if mine else "no call"
        random = sum(RANDOM in o.reason for o in mine)
        defined = len(mine) - random
        lines.append(f"- {capture}: {served} of {len(mine)} calls served ({share})"
                     + (f" ({folded} more the capture folded away: no op left to serve)" if folded else "") + ", "
                     f"{sum(o.outcome == 'on-demand' for o in mine)} of them verified on demand, "
                     f"{sum(o.sharded > 0 for o in mine)} with a strategy that shards"
                     + (f"; {random} draw random numbers and no spec serves them" if random else "")
                     + (f": {served} of the other {defined} served ({100 * served / defined:.1f}%)"
                        if random and defined else ""))
    return lines


def totals(result: SweepResult, listed: set[str] | None = None) -> list[str]:
    """Served shares per capture; with ``listed`` (a sweep of every op_db entry: the entries the
    specs' targets list), over every entry, then over those alone."""
    if listed is None:
        return _capture_totals(result.outcomes)
    entries = {entry_of(o) for o in result.outcomes}
    own = [o for o in result.outcomes if entry_of(o) in listed]
    return [f"Over every op_db entry swept ({len(entries)}):", *_capture_totals(result.outcomes),
            f"Over the entries the specs' targets list ({len(entries & listed)} of them):", *_capture_totals(own)]


def markdown(result: SweepResult, command: str, torch_version: str, commits: dict[str, int] | None = None,
             wall: float | None = None, unswept: list[str] | None = None, listed: set[str] | None = None,
             skipped: list[str] | None = None) -> str:
    """The page docs/opinfo.md holds. ``commits``: entries per commit their results were swept at;
    ``wall``: the seconds the command took (less than the sweep's where stored results were read);
    ``listed``: a sweep of every op_db entry, these the entries the specs' targets list;
    ``skipped``: entries that gave no call, each with why."""
    counts = result.counts()
    checked = sum(o.checked for o in result.outcomes)
    lines = ["# PyTorch's OpInfo samples against the op specs", "",
             f"Generated by `{command}` (torch {torch_version}; sweeping took {result.seconds:.0f} s"
             + (f", this run {wall:.0f} s" if wall is not None else "") + ")."
             + (" Results swept at commit " + ", ".join(f"{c or 'unknown'} ({n} entries)" for c, n in commits.items())
                + "." if commits else ""),
             ("Every OpInfo sample of every entry of PyTorch's op_db (an entry no spec lists matched by the op nodes "
              "its captures hold; CPU, float64 where the entry has it; a fixed draw where an entry has many) is captured as a"
              if listed is not None else
              "Every OpInfo sample of every op spec's targets (CPU, float64; a fixed draw where an entry has many) is captured as a"),
             "one-op module with torch.fx and with torch.export and served on each mesh as a plan would serve",
             "it. A call the spec's grid covers is served by it, and its strategies are verified at the call",
             "too; a call outside the grid is verified on demand, its failing strategies never served.",
             "A call is one sample under one capture on one mesh, counted once whichever specs list its",
             "entry; it is served when every op node it was captured as is served, else it counts under",
             "its worst node's outcome.", "",
             f"**{sum(counts.values())} calls**: " + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES) + ".",
             f"{checked} grid-served strategies checked at their call, "
             f"{sum(len(o.wrong) for o in result.outcomes)} wrong; "
             f"{len(result.defects)} rule defect(s) found on demand (strategies not offered).", "",
             *totals(result, listed), "",
             *([f"**Skipped: {len(skipped)} OpInfo entries** no spec lists gave no call to sweep: "
                f"{', '.join(skipped)}.", ""] if skipped else []),
             *([f"**Not swept: {len(unswept)} OpInfo entries** (no current stored results; "
                f"these calls are in no count above): {', '.join(unswept)}.", ""] if unswept else []), "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table(result)]
    reasons = Counter((o.outcome, reason_class(user_words(o.outcome, o.reason))) for o in result.outcomes
                      if o.outcome not in ("grid", "on-demand", "folded"))
    if reasons:
        lines += ["", "## What is not served, by reason", "", "| outcome | reason | calls |", "|---|---|---|"]
        lines += [f"| {outcome} | {reason.replace('|', '/')} | {n} |" for (outcome, reason), n in reasons.most_common()]
    if result.defects:
        lines += ["", "## Rule defects found on demand", ""] + [f"- {d}" for d in result.defects]
    wrong = result.wrong
    if wrong:
        lines += ["", "## Grid-served strategies wrong at a call", ""]
        lines += [f"- {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: {', '.join(o.wrong)}" for o in wrong]
    extremum = [o for o in result.outcomes if o.wrong_extremum]
    if extremum:
        lines += ["", "## Partial max/min strategies wrong at a call (plans never serve these)", ""]
        lines += [f"- {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: {', '.join(o.wrong_extremum)}"
                  for o in extremum]
    return "\n".join(lines) + "\n"
