"""Stored results of `shardverify dtensor --results DIR`: one JSON file per (op spec content,
mesh, torch version, limit), so a run over every spec (hours on a shared machine) can stop at
any point and continue where it stopped, and later sessions add to it.

A file holds every case of the spec on that mesh as far as it ran: a finished case, and the
case in progress with the combinations it executed (they run in a fixed order, so it resumes at
the next one). A spec whose file changed gets a new hash, so its old results are never reused
for it; a run with another ``--budget`` re-runs the cases (``too-slow`` depends on it), and so
does a run stored by another version of the harness (:data:`HARNESS`).
Findings are stored without their repro scripts (``--repros`` needs a fresh run).

A results folder is committed, so a stored file is untrusted input: it is read and written by
:mod:`shardverify.stored` and checked field by field (:func:`check_result`), and a case whose
counts do not add up (a finding deleted, a class count edited) is refused, naming the file and field.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shardverify.features.dtensor.verdicts import CLASSES
from shardverify.errors import SpecError
from shardverify.files import read_regular_file, write_file_atomic
from shardverify.spec.limits import MAX_JSON_BYTES
from shardverify.stored import StoreError, items, need, read_json, safe_name, write_json

__all__ = ["HARNESS", "StoredRun", "spec_hash", "store_path", "load_stored", "save_stored", "check_result",
           "read_running", "write_running", "read_saved_run", "made_by", "open_run"]

VERSION = 1

#: The DTensor harness's behaviour version. Bump it with any change to how a combination is built,
#: executed or classified (execute.py, hooks.py, verdicts.py...) that can change a stored outcome:
#: a run stored under another version is never read as this harness's: a run with ``--results``
#: runs it again, ``--from-json`` leaves it out and says so. (Results are keyed by the spec file's
#: hash; without this, a fixed harness bug lived on in the store: conv1d's nn.Module results, made
#: before CommDebugMode's module hooks were taken out of the forward, kept a silent class that real
#: gloo processes showed to be a late failure.) Files from before the field are version 1.
HARNESS = 1


def spec_hash(spec, root: Path = Path(".")) -> str:
    """The first 12 hex digits of the sha256 of the spec's file."""
    path = Path(spec.source)
    if not path.is_absolute() and not path.exists():
        path = root / path
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@dataclass
class StoredRun:
    """One spec on one mesh: its cases (in order), the results of those that ran, which are done."""

    spec: str
    spec_hash: str
    mesh: tuple[int, ...]
    torch: str
    limit: int | None
    budget: float | None
    cases: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)      # case id -> CaseResult as to_json saves it
    done: list[str] = field(default_factory=list)    # case ids finished
    died: dict = field(default_factory=dict)         # case id -> {combination index: the stage a process died in}
    harness: int = HARNESS                           # the harness version that made it

    @property
    def complete(self) -> bool:
        return bool(self.cases) and all(c in self.done for c in self.cases)

    def to_json(self) -> dict:
        return {"version": VERSION, "spec": self.spec, "spec_hash": self.spec_hash, "mesh": list(self.mesh),
                "torch": self.torch, "limit": self.limit, "budget": self.budget, "complete": self.complete,
                "cases": self.cases, "done": self.done, "died": self.died, "harness": self.harness,
                "results": {case: _slim(result) for case, result in self.results.items()}}

    @classmethod
    def from_json(cls, item: dict, file: str = "<stored run>") -> "StoredRun":
        """The run ``item`` holds, checked field by field (StoreError naming ``file`` and the field)."""
        version = need(item, "version", int, file=file)
        if version != VERSION:
            raise StoreError(f"stored-result version {version}, this shardverify reads {VERSION}", file=file,
                             field="version")
        mesh = tuple(items(need(item, "mesh", list, file=file), int, file=file, field="mesh"))
        cases = items(need(item, "cases", list, file=file), str, file=file, field="cases")
        done = items(need(item, "done", list, file=file), str, file=file, field="done")
        results = need(item, "results", dict, file=file)
        for case, result in results.items():
            check_result(result, file, f"results.{case}", slim=True, case=case, mesh=mesh)
        if missing := [case for case in done if case not in results]:
            raise StoreError(f"cases marked done without a result: {missing[:3]}", file=file, field="done")
        died = {}
        for case, stages in need(item, "died", dict, file=file, default={}).items():
            for index in need(item["died"], case, dict, file=file, where="died"):
                need(stages, index, str, file=file, where=f"died.{case}")
            # what is no combination of a case (a cut-short .running file's) skips nothing: left out
            died[case] = {index: stage for index, stage in stages.items() if index.isdigit()}
        return cls(need(item, "spec", str, file=file), need(item, "spec_hash", str, file=file), mesh,
                   need(item, "torch", str, file=file), need(item, "limit", (int, type(None)), file=file),
                   need(item, "budget", (float, type(None)), file=file), list(cases),
                   {case: _whole(result) for case, result in results.items()}, list(done), dict(died),
                   need(item, "harness", int, file=file, default=1))


_TEXT = (str, type(None))
#: a finding's fields as stored: (name, kind); "class" is checked against CLASSES
_FINDING = (("phase", _TEXT), ("layouts", dict), ("placements", dict), ("detail", _TEXT), ("rule", _TEXT),
            ("runtime", _TEXT), ("local_strategy", str), ("comms", _TEXT))


def check_result(item, file: str, where: str, *, slim: bool = False, case: str | None = None,
                 mesh: tuple | None = None) -> None:
    """A stored case result (:meth:`CaseResult.to_json`; ``slim``: as :func:`_slim` stores it,
    its findings without what they repeat) checked field by field, and its counts against its
    findings: the combinations executed are the sum of the counts, and every class but
    ``agrees`` and ``too-slow`` (a too-slow combination that ends a case early records none) has
    as many findings as its count. StoreError naming ``file`` and the field otherwise."""
    op = need(item, "op", str, file=file, where=where)
    if need(item, "case", str, file=file, where=where) != case and case is not None:
        raise StoreError(f"the result of case {item['case'][:60]!r} stored under {case[:60]!r}", file=file,
                         field=f"{where}.case")
    shape = tuple(items(need(item, "mesh", list, file=file, where=where), int, file=file, field=f"{where}.mesh"))
    if mesh is not None and shape != mesh:
        raise StoreError(f"a result on mesh {list(shape)} in the file of mesh {list(mesh)}", file=file,
                         field=f"{where}.mesh")
    combinations = need(item, "combinations", int, file=file, where=where)
    executed = need(item, "executed", int, file=file, where=where)
    counts = need(item, "counts", dict, file=file, where=where)
    for name in counts:
        if name not in CLASSES or need(counts, name, int, file=file, where=f"{where}.counts") < 0:
            raise StoreError(f"not a class with a count: {name[:40]!r}: {counts[name]!r:.40}", file=file,
                             field=f"{where}.counts")
    need(item, "note", _TEXT, file=file, where=where)
    need(item, "seconds", float, file=file, where=where)
    findings = items(need(item, "findings", list, file=file, where=where), dict, file=file, field=f"{where}.findings")
    found: Counter = Counter()
    for index, finding in enumerate(findings):
        at = f"{where}.findings[{index}]"
        klass = need(finding, "class", str, file=file, where=at)
        if klass not in CLASSES or klass == "agrees":
            raise StoreError(f"not a class of finding: {klass[:40]!r}", file=file, field=f"{at}.class")
        found[klass] += 1
        for name, kind in _FINDING:
            need(finding, name, kind, file=file, where=at)
        for name in ("layouts", "placements"):
            for role in finding[name]:
                need(finding[name], role, str, file=file, where=f"{at}.{name}")
        need(finding, "culprit", _TEXT, file=file, where=at, default=None)
        if not slim:
            need(finding, "case", str, file=file, where=at)
            items(need(finding, "mesh", list, file=file, where=at), int, file=file, field=f"{at}.mesh")
            if need(finding, "op", str, file=file, where=at) != op:
                raise StoreError(f"a finding of op {finding['op'][:40]!r} in a result of {op[:40]!r}", file=file,
                                 field=f"{at}.op")
    if not 0 <= executed <= combinations or sum(counts.values()) != executed:
        raise StoreError(f"the counts do not add up: {sum(counts.values())} counted, {executed} executed of "
                         f"{combinations} combinations", file=file, field=f"{where}.counts")
    for klass in set(counts) | set(found):
        want = counts.get(klass, 0)
        if klass != "agrees" and (found[klass] > want if klass == "too-slow" else found[klass] != want):
            raise StoreError(f"the counts do not add up: {want} {klass} counted, {found[klass]} stored as "
                             f"findings", file=file, field=f"{where}.findings")


#: what every finding of a case repeats from the case (and its class key, recomputed on reading)
_REPEATED = ("op", "case", "mesh", "key")


def _slim(result: dict) -> dict:
    """A case's result without what its findings repeat (the stored results stay small enough to commit)."""
    return {**result, "findings": [{k: v for k, v in f.items() if k not in _REPEATED} for f in result["findings"]]}


def _whole(result: dict) -> dict:
    """:func:`_slim` undone: each finding gets its case's op, case and mesh back (the case's, never
    ones a stored finding holds itself: those were not checked, and a finding's mesh picks its repro)."""
    same = {"op": result["op"], "case": result["case"], "mesh": result["mesh"]}
    return {**result, "findings": [{**f, **same} for f in result["findings"]]}


def store_path(folder: Path, spec_name: str, digest: str, mesh, torch_version: str, limit: int | None) -> Path:
    """DIR/torch-VERSION/SPEC.MESH.limitN.HASH.json (limit0: every combination)."""
    mesh_text = "x".join(str(int(m)) for m in mesh)
    return (Path(folder) / f"torch-{safe_name(torch_version)}"
            / f"{safe_name(spec_name)}.{mesh_text}.limit{int(limit or 0)}.{safe_name(digest)}.json")


def load_stored(path: Path) -> StoredRun | None:
    """The stored run at ``path``, or None when there is none; StoreError (one line naming the
    file and the field) when it cannot be read or does not check."""
    try:
        document = read_json(path, MAX_JSON_BYTES.value, setting=MAX_JSON_BYTES.env)
        if document is None:
            return None
        run = StoredRun.from_json(document, str(path))
        made_for = store_path(path.parent.parent, run.spec, run.spec_hash, run.mesh, run.torch, run.limit)
        if made_for.relative_to(path.parent.parent) != path.relative_to(path.parent.parent):
            raise StoreError(f"holds the run of {made_for.relative_to(path.parent.parent)}", file=str(path))
        return run
    except StoreError as exc:
        raise StoreError(f"{exc.reason}; not a stored `shardverify dtensor --results` file (remove it to run that "
                         "spec again)", file=exc.file, field=exc.field) from None


def save_stored(path: Path, run: StoredRun) -> None:
    """Written whole or not at all (a run killed mid-write leaves the previous file)."""
    write_json(path, run.to_json())


def open_run(folder: Path, spec_name: str, digest: str, mesh: tuple[int, ...], torch_version: str,
             limit: int | None, budget: float | None, cases: list[str]) -> tuple[StoredRun, Path, Path]:
    """The stored run of one spec on one mesh to continue, its file and its ``.running`` file: a
    new run where none is stored or the stored one had another budget (``too-slow`` depends on
    it) or harness; the combination the last run's process died on (its ``.running`` file, then
    removed) recorded as died, never to run again."""
    path = store_path(folder, spec_name, digest, mesh, torch_version, limit)
    saved = load_stored(path)
    if saved is None or saved.budget != budget or saved.harness != HARNESS:
        saved = StoredRun(spec_name, digest, mesh, torch_version, limit, budget)
    saved.cases = list(cases)
    running = path.with_name(path.name + ".running")   # the combination in progress
    path.parent.mkdir(parents=True, exist_ok=True)
    dead = read_running(running, saved.cases)
    if dead is not None:
        dead_case, index, stage = dead
        saved.died.setdefault(dead_case, {})[index] = f"in {stage or 'its execution'}"
        save_stored(path, saved)
    running.unlink(missing_ok=True)
    return saved, path, running


def read_running(path: Path, cases: list[str]) -> tuple[str, str, str] | None:
    """(case, combination index, stage) of the combination a run was executing when its process
    died, from its ``.running`` file (None when there is none or it names no combination of
    ``cases``); StoreError when it is no regular file (a FIFO, a link, a device: refused unread)."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        text = read_regular_file(path, 1 << 16, follow_symlinks=False).decode("utf-8")
    except (SpecError, UnicodeDecodeError) as exc:
        raise StoreError(getattr(exc, "reason", "not UTF-8 text"), file=str(path)) from None
    case, index, stage = (text.split("\n") + ["", ""])[:3]
    # cut short, or naming no combination of the spec: nothing is skipped, the combination runs again
    return (case, index, stage) if case in cases and index.isdigit() else None


def write_running(path: Path, case: str, index: int, stage: str) -> None:
    """Say which combination is starting, before it runs (:func:`read_running`)."""
    write_file_atomic(path, f"{case}\n{index}\n{stage}\n")


def read_saved_run(path: Path) -> dict:
    """A run ``shardverify dtensor --json`` saved, its results checked as :func:`check_result`
    checks a stored one (counts that do not add up refused); StoreError naming the file and field."""
    file = str(path)
    try:
        document = read_json(path, MAX_JSON_BYTES.value, setting=MAX_JSON_BYTES.env)
        if document is None:
            raise StoreError("no such file", file=file)
        for index, result in enumerate(need(document, "results", list, file=file)):
            check_result(result, file, f"results[{index}]")
        need(document, "torch", str, file=file, default="")
        need(document, "harness", int, file=file, default=0)
    except StoreError as exc:
        raise StoreError(f"{exc.reason}; not a saved `shardverify dtensor --json` run", file=exc.file,
                         field=exc.field) from None
    return document


def made_by(torch_version: str | None, harness: int | None) -> str:
    """Whether a saved run was made by this version: this torch and this DTensor harness (:data:`HARNESS`)."""
    import torch

    if torch_version == torch.__version__ and harness == HARNESS:
        return f"made by this version (torch {torch_version}, DTensor harness {HARNESS})"
    made = f"torch {torch_version or 'unknown'}, DTensor harness {harness or 'unknown (saved before it was recorded)'}"
    return (f"NOT made by this version: made by {made}; this is torch {torch.__version__}, DTensor harness {HARNESS} "
            "(run it again to check it with this one)")
