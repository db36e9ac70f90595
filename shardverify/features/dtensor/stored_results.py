"""Reading a --results folder back (``dtensor --from-json DIR``, the sweep's resume): each
case's best stored result at this torch and harness version, and a sentence saying how complete
they are. Apart from :mod:`shardverify.features.dtensor.run` because it only reads what a run stored."""

from __future__ import annotations

from pathlib import Path

from shardverify.features.dtensor.run import CaseResult
from shardverify.features.dtensor.store import HARNESS, StoredRun, load_stored, spec_hash, store_path

__all__ = ["stored_results", "stored_runs"]


def stored_results(store: Path, specs, meshes, limit: int | None, root: Path = Path(".")) -> tuple[list[CaseResult], str]:
    """The results a folder holds for ``specs`` on ``meshes`` (each spec's own meshes when None)
    at this torch version and ``limit``, and a sentence saying how much of that is complete:
    (spec, mesh) pairs finished, in progress (their cases so far) and not run, by name.

    With ``limit`` None (every combination), a case the full run has not finished is read from
    the largest evenly spaced sample stored for it (``--limit N``), and said: every combination
    of every op on three meshes is more than this machine can run (hours per op spec on the
    larger grids), and a stated sample says more than "not run"."""
    import torch

    results: list[CaseResult] = []
    complete, sampled, partial, missing, unrun = [], [], [], [], []
    absent, seconds, sample_limits, stale, current = 0, 0.0, set(), [], 0
    for spec in specs:
        digest = spec_hash(spec, root)
        shapes = meshes or spec.verify.meshes
        runs = {tuple(m): stored_runs(store, spec.name, digest, m, torch.__version__, limit) for m in shapes}
        stale += [f"{run.spec} {_shape(run.mesh)} (version {run.harness})" for found in runs.values() for run in found
                  if run.harness != HARNESS]
        runs = {mesh: [run for run in found if run.harness == HARNESS] for mesh, found in runs.items()}
        current += sum(len(found) for found in runs.values())
        if not any(runs.values()):
            unrun.append(spec.name)      # said by name alone
            absent += len(shapes)
            continue
        for mesh in shapes:
            mesh = tuple(mesh)
            found_cases, finished, from_sample = _merged_cases(runs[mesh], sampling=limit is None)
            name = f"{spec.name} {_shape(mesh)}"
            if not found_cases:
                missing.append(name)
                continue
            if not finished:
                partial.append(name)
            elif from_sample:
                sampled.append(name)
                sample_limits |= from_sample
            else:
                complete.append(name)
            for found in found_cases:
                seconds += found.seconds
                results.append(found)
    total = len(complete) + len(sampled) + len(partial) + len(missing) + absent
    note = (f"the stored results in `{store}` (torch {torch.__version__}, --limit {limit or 0}): {len(complete)} of "
            f"{total} (op spec, mesh) pairs complete")
    if sampled:
        note += (f", {len(sampled)} complete where some cases ran an evenly spaced sample of their combinations "
                 f"(--limit {', '.join(map(str, sorted(sample_limits)))}; each such case's note says how many of "
                 "its combinations were not executed)")
    note += (f", {len(partial)} in progress (their finished cases and the combinations executed so far are counted "
             f"below), {len(missing) + absent} not run; {sum(r.executed for r in results):,} of the stored cases' "
             f"{sum(r.combinations for r in results):,} combinations executed, {seconds / 60:.0f} min of execution stored.")
    if partial:
        note += " In progress: " + ", ".join(partial) + "."
    if missing:
        note += " Not run: " + ", ".join(missing) + "."
    if unrun:
        note += f" Not run on any mesh ({len(unrun)} specs): " + ", ".join(unrun) + "."
    note += (f" Each of the {current} stored file(s) read was made by this version (torch {torch.__version__}, "
             f"DTensor harness {HARNESS}).")
    if stale:
        note += (f" Left out, made by another version of the harness than this one's ({HARNESS}), to be run again: "
                 + ", ".join(stale) + ".")
    others = sorted(p.name for p in Path(store).glob("torch-*") if p.name != f"torch-{torch.__version__}")
    if others:
        note += " Not read, made by another torch: " + ", ".join(others) + "."
    return results, note


def stored_runs(store: Path, spec_name: str, digest: str, mesh, torch_version: str,
                 limit: int | None) -> list[StoredRun]:
    """The stored runs of one spec on one mesh to read, best first: the run at ``limit``; with
    ``limit`` None (every combination) also each stored sample, the largest first."""
    wanted = load_stored(store_path(store, spec_name, digest, mesh, torch_version, limit))
    runs = [wanted] if wanted is not None else []
    if limit is None:
        pattern = store_path(store, spec_name, digest, mesh, torch_version, None).name.replace(".limit0.", ".limit*.")
        samples = [load_stored(path) for path in store.joinpath(f"torch-{torch_version}").glob(pattern)]
        runs += sorted((run for run in samples if run is not None and run.limit), key=lambda run: -run.limit)
    return runs


def _merged_cases(runs: list[StoredRun], sampling: bool) -> tuple[list[CaseResult], bool, set[int]]:
    """Each case from the first run (best first) that finished it, else from the first that has
    it in progress; whether every case finished, and (``sampling``: samples stand in for the
    full run) the sample limits any finished case came from."""
    if not runs or not any(run.results for run in runs):
        return [], False, set()
    cases = next((run.cases for run in runs if run.cases), [])
    found, finished, limits = [], True, set()
    for case_id in cases:
        done = next((run for run in runs if case_id in run.done), None)
        run = done or next((run for run in runs if case_id in run.results), None)
        if run is None:
            finished = False
            continue
        result = CaseResult.from_json(run.results[case_id])
        if done is None:
            finished = False
            left = f"in progress: {result.executed} of {result.combinations} combinations executed so far, the rest not run yet"
            result.note = f"{result.note}; {left}" if result.note else left
        elif sampling and run.limit:
            limits.add(run.limit)
        result.resumed = True
        found.append(result)
    return found, finished, limits


def _shape(mesh) -> str:
    return "(" + ", ".join(map(str, mesh)) + (",)" if len(mesh) == 1 else ")")
