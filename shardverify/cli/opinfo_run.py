"""`shardverify verify --opinfo`: every op spec served on PyTorch's OpInfo samples of its targets.

Each sample is captured with torch.fx and torch.export and served on each mesh as a plan serves a
call (the grid's strategies, or those verified on demand); every strategy served on the grid is
verified at the call too. Exit 1 when a served strategy is wrong at a call or a call raised a raw
exception where a reason was owed, or when a requested entry was not swept (nor read from current
stored results): a sweep that skipped an entry checked nothing of it, so it is no pass."""

from __future__ import annotations

import argparse
import sys

import torch

from shardverify.errors import ShardVerifyError
from shardverify.files import write_file_atomic

__all__ = ["run_opinfo"]


def _entries(specs: list, every: bool = False) -> tuple[list[tuple[object, str, list, list]], list[str]]:
    """(entry, the first spec listing it, every listing spec's targets, their dotted names) of each
    OpInfo entry of the specs' targets, once: a call reaching several specs is swept and counted
    once; and the specs whose targets have no OpInfo entry (nothing of theirs can be swept).
    ``every``: then every other entry of op_db, under its own name with no targets (what its
    samples call decides which specs serve them)."""
    from shardverify.features.opinfo.samples import entries_for, op_db
    from shardverify.features.opinfo.sweep import entry_name
    from shardverify.spec.names import resolve_dotted

    found: dict[str, tuple[object, str, list, list]] = {}
    without: list[str] = []
    for spec in specs:
        names = [t.name for t in spec.targets]
        targets = [resolve_dotted(name) for name in names]
        listed = entries_for(targets)
        if not listed:
            without.append(spec.name)
        for entry in listed:
            name = entry_name(entry)
            if name in found:
                for target, dotted in zip(targets, names):
                    if target not in found[name][2]:
                        found[name][2].append(target)
                        found[name][3].append(dotted)
            else:
                found[name] = (entry, spec.name, list(targets), list(names))
    if every:
        for entry in op_db():
            found.setdefault(entry_name(entry), (entry, entry_name(entry), [], []))
    return list(found.values()), without


class _Tally:
    """What the sweep has counted so far: every entry's calls, the entries per commit their results
    were swept at, and the requested entries not swept (each with why)."""

    def __init__(self, total) -> None:
        self.total = total
        self.commits: dict[str, int] = {}
        self.unswept: list[str] = []
        self.listed: set[str] | None = None   # with --opinfo-every-entry: the entries the specs' targets list
        self.skipped: list[str] = []           # entries no spec lists that have no sample to call, each with why

    def count(self, name: str, op: str, found, commit: str, how: str, where: str) -> None:
        self.commits[commit] = self.commits.get(commit, 0) + 1
        print(f"opinfo {where} {name} ({op}): {len(found.outcomes)} calls, {found.seconds:.1f}s, {how}",
              file=sys.stderr, flush=True)
        self.total.outcomes += found.outcomes
        self.total.defects += found.defects
        self.total.seconds += found.seconds


def run_opinfo(args: argparse.Namespace, specs: list) -> int:
    import time

    from shardverify.features.opinfo.store import default_results_dir, rule_digests, settings_key, source_commit
    from shardverify.features.opinfo.sweep import SweepResult

    meshes = args.mesh or [(2, 2), (4,)]
    captures = ("fx", "export")
    try:
        folder = args.opinfo_results or default_results_dir()
    except ShardVerifyError as error:     # no $HOME to keep them under
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = settings_key(args.opinfo_samples, meshes, captures, 0)
    source_commit(), rule_digests()   # the code and the rules this process loaded, taken before any sweeping
    tally = _Tally(SweepResult())
    wall = time.perf_counter()
    try:
        _sweep(args, specs, folder, settings, meshes, captures, tally)
    except ShardVerifyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nshardverify verify --opinfo: interrupted (the entries swept so far are stored); exit 130",
              file=sys.stderr)
        return 130
    wall = time.perf_counter() - wall
    _print_table(tally.total)
    if args.report is not None and not _write_report(args, tally, wall):
        return 2
    return _summary(tally, wall)


def _sweep(args: argparse.Namespace, specs: list, folder, settings, meshes, captures, tally: _Tally) -> None:
    """Every OpInfo entry of the specs' targets swept (or read from current stored results), each
    claimed by one process at a time; an entry another live process holds is read after the rest.
    With --cluster the entries to sweep are units on Ray workers and this process stores each."""
    from shardverify.features.opinfo.store import claim_entry, held, load_entry, release_entry, save_entry, source_commit
    from shardverify.features.opinfo.samples import no_sample_reason
    from shardverify.features.opinfo.sweep import entry_name, sweep_entry
    from shardverify.verify.on_demand import OnDemandVerifier

    unswept = tally.unswept
    busy: list[tuple[str, str, str]] = []    # entries another live process held when reached
    every = getattr(args, "opinfo_every_entry", False)
    entries, without = _entries(specs, every)
    if every:
        tally.listed = {entry_name(entry) for entry, _, targets, _ in entries if targets}
    if args.specs:    # a spec named on the command line with nothing to sweep is no pass
        unswept += [f"spec {op} (its targets have no OpInfo entry)" for op in without]
    pending: list[tuple[int, str, str, list]] = []   # --cluster: (position, entry, spec, target names) to sweep
    with OnDemandVerifier() as verifier:
        for i, (entry, op, targets, names) in enumerate(entries, 1):
            name = entry_name(entry)
            stored = None if args.opinfo_fresh else load_entry(folder, name, settings)
            missing = "no current stored results"
            if stored is not None and not stored[0].outcomes and targets:   # a file of no call checks nothing
                stored, missing = None, "its stored results hold no call"
                print(f"opinfo: {name}: {missing}; not taken as swept", file=sys.stderr)
            if stored is not None:
                found, commit = stored
                how = f"stored (swept at {commit or 'an unknown commit'})"
            elif args.opinfo_stored:
                unswept.append(f"{name} ({held(folder, name) or missing})")
                continue
            elif args.cluster is not None:   # the driver alone writes the folder: no lock, unless a process here holds one
                if why := held(folder, name):
                    busy.append((op, name, why))
                else:
                    pending.append((i, name, op, names))
                continue
            else:
                claimed, why = claim_entry(folder, name)
                if not claimed:
                    busy.append((op, name, why))
                    continue
                if why:
                    print(f"opinfo: {name}: {why}", file=sys.stderr, flush=True)
                try:
                    if why:   # a sweeper died holding it: swept where a crash cannot end this run
                        failed = _sweep_isolated(name, op, names, meshes, captures, args.opinfo_samples, folder,
                                                 settings)
                        stored = None if failed else load_entry(folder, name, settings)
                        if stored is None:
                            unswept.append(f"{name} ({failed or 'its child process stored no results'})")
                            continue
                        found = stored[0]
                    else:
                        found = sweep_entry(entry, op, targets, meshes, captures, args.opinfo_samples, verifier)
                        save_entry(folder, name, settings, found)
                finally:
                    release_entry(folder, name)
                commit, how = source_commit(), "swept" + (" in a child process" if why else "")
            if not found.outcomes:
                if targets:
                    unswept.append(f"{name} (no sample of it was called: nothing checked)")
                else:   # an entry no spec lists, with no CPU sample in a dtype the sweep draws
                    tally.skipped.append(f"{name} ({no_sample_reason(entry)})")
                continue
            tally.count(name, op, found, commit, how, f"[{i}/{len(entries)}]")
    if pending:
        from shardverify.cli.opinfo_cluster import sweep_entries_on_cluster

        swept = sweep_entries_on_cluster(args, [(name, op, names) for _, name, op, names in pending], folder,
                                         settings, meshes, captures)
        for (i, name, op, names), found in zip(pending, swept):
            if isinstance(found, str):
                unswept.append(f"{name} ({found})")
            elif not found.outcomes and not names:
                tally.skipped.append(f"{name} ({no_sample_reason(entries[i - 1][0])})")
            elif not found.outcomes:
                unswept.append(f"{name} (no sample of it was called: nothing checked)")
            else:
                tally.count(name, op, found, source_commit(), "swept on the cluster", f"[{i}/{len(entries)}]")
    for op, name, why in busy:   # swept by another process meanwhile, or not swept at all
        stored = load_entry(folder, name, settings)
        if stored is not None and stored[0].outcomes:
            tally.count(name, op, stored[0], stored[1], "stored by the process that held it", "[after]")
        else:
            unswept.append(f"{name} ({why})")


def _sweep_isolated(name: str, op: str, names: list, meshes, captures, limit: int, folder, settings) -> str:
    """Sweep the entry in a child process, which stores its results: '' when it did, else why
    not (the signal a kernel ended it with). For an entry whose sweeper died holding it: a kernel
    that corrupts memory on the data drawn for it would end this run too."""
    import multiprocessing
    import signal

    child = multiprocessing.get_context("spawn").Process(
        target=_child_sweep, args=(name, op, list(names), [tuple(m) for m in meshes], tuple(captures), limit,
                                   str(folder), settings))
    child.start()
    child.join()
    if child.exitcode == 0:
        return ""
    if child.exitcode is not None and child.exitcode < 0:
        return (f"its sweep died of {signal.Signals(-child.exitcode).name} in a child process, as the sweeper "
                f"before it did: a kernel the sweep calls ends the process it runs in")
    return f"its sweep's child process exited with status {child.exitcode}"


def _child_sweep(name: str, op: str, names: list, meshes, captures, limit: int, folder: str, settings: dict) -> None:
    from pathlib import Path

    from shardverify.cli.opinfo_cluster import sweep_entry_unit
    from shardverify.features.opinfo.store import save_entry

    save_entry(Path(folder), name, settings, sweep_entry_unit(name, op, names, meshes, captures, limit))


def _print_table(total) -> None:
    from shardverify.features.opinfo.report import HEADER, table

    rows = table(total)
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for row in [HEADER, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _write_report(args: argparse.Namespace, tally: _Tally, wall: float) -> bool:
    """The markdown page at --report FILE; False, with the error printed, when it cannot be written."""
    from shardverify.features.opinfo.report import markdown

    command = " ".join(["shardverify verify --opinfo", *(args.specs or []),
                        *(["--opinfo-every-entry"] if tally.listed is not None else []),
                        f"--opinfo-samples {args.opinfo_samples}",
                        *([f"--opinfo-results {args.opinfo_results}"] if args.opinfo_results else []),
                        *(["--opinfo-stored"] if args.opinfo_stored else []),
                        *(["--opinfo-fresh"] if args.opinfo_fresh else []), f"--report {args.report}"])
    try:
        write_file_atomic(args.report, markdown(tally.total, command, torch.__version__, commits=tally.commits,
                                                wall=wall, unswept=tally.unswept, listed=tally.listed,
                                                skipped=tally.skipped))
    except OSError as error:
        print(f"error: cannot write {args.report}: {error.strerror or error}", file=sys.stderr)
        return False
    print(f"report written to {args.report}")
    return True


def _summary(tally: _Tally, wall: float) -> int:
    """The defects, raw exceptions and wrong strategies, the totals; the exit status."""
    from shardverify.features.opinfo.report import totals

    total, commits, unswept = tally.total, tally.commits, tally.unswept
    for defect in total.defects:
        print(f"rule defect (not offered): {defect}")
    raw = [o for o in total.outcomes if o.outcome == "raw-error"]
    for o in raw[:20]:
        print(f"raw exception: {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: {o.reason}")
    for o in total.wrong:
        print(f"WRONG: {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: {', '.join(o.wrong)}")
    for o in [o for o in total.outcomes if o.wrong_extremum]:
        print(f"wrong partial max/min (plans never serve these): {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: "
              f"{', '.join(o.wrong_extremum)}")
    counts = total.counts()
    if unswept:
        print(f"\nFAILED: {len(unswept)} of {len(unswept) + sum(commits.values())} requested entries not swept, "
              f"so not checked: {', '.join(unswept)}")
    if tally.skipped:
        print(f"\n{len(tally.skipped)} OpInfo entries no spec lists gave no call to sweep: {', '.join(tally.skipped)}")
    print("\n".join(["", *totals(total, tally.listed)]))
    print(f"\n{sum(counts.values())} calls: " + ", ".join(f"{n} {k}" for k, n in counts.most_common())
          + f"; swept in {total.seconds:.0f}s, this run {wall:.0f}s")
    return 1 if total.wrong or raw or unswept else 0
